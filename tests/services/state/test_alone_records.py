"""A process's records of the share it may spend alone: which records a write carries,
which of them the store may keep, and the most careful reading of those a process
decides alone on (`gateway.services.state.alone_records`)."""

from __future__ import annotations

import json

import pytest

from gateway.core.metering.refusals import store_away
from gateway.core.policy.model import Budget
from gateway.services.state.alone_records import (
    ACTIVE,
    Record,
    Records,
    held_for_others,
    key_of,
)
from gateway.services.state.counters import Admission, Limit

T = "b:agent:daily:0"
NOW = 1_000_000.0


def admission(add: int = 1, table: str = T, subject: str = "sb") -> Admission:
    """A requests limit and a tokens limit over two fields, as a budget admits."""
    return Admission((Limit(((table, "r:" + subject),), 10, 1),
                      Limit(((table, "t:" + subject), (table, "rt:" + subject)), 1000, add)),
                     ((table, "r:" + subject, 1, NOW + 86_400),
                      (table, "rt:" + subject, add, NOW + 86_400)))


KNOWN = {T: {"r:sb": 4, "t:sb": 100, "rt:sb": 50}}
R, TOK = key_of(T, "r:sb"), key_of(T, "t:sb")  # the two limits' records


def kept(holder: str, known: dict[str, dict[str, int]], add: int = 1) -> Records:
    """Records of one admission (tokens: ``add``) whose first record the store kept."""
    records = Records()
    records.track(admission(add), NOW)
    first = records.due(holder, known, 2, NOW, 1)
    records.sent(holder, first)
    records.answered(holder, first)
    return records


def held(values: dict[str, object], processes: object = 2,
         demand: dict[str, object] | None = None) -> int:
    """What a limit of 10 over r:x counts as held for one other holder's record."""
    text = json.dumps({"s": 1, "n": processes, "v": values,
                       "d": {"r:x": 100} if demand is None else demand})
    return held_for_others([("other", text)], "me", ["r:x"], 10)


@pytest.mark.parametrize(("found", "expected"), [
    (held({"r:x": 4}), 3),  # (10 - 4) / 2
    (held({"r:x": 3}), 3),  # 7 / 2, rounded down
    (held({"r:x": 10}), 0),
    (held({"r:x": 12}), 0),  # (a reading above the ceiling: nothing, never negative)
    (held({"r:x": 0}, processes=0), 10),  # (no process count: one)
    (held({"r:x": 0}, demand={"r:x": 4}), 4),  # at most its demand
    (held({"r:x": 0}, demand={}), 0),  # it admitted nothing lately
    (held({}), 0),  # it never read r:x: it cannot decide alone on it
])
def test_a_share_is_the_room_divided_rounded_down_at_most_the_demand(
        found: int, expected: int) -> None:
    assert found == expected


def test_the_writers_own_record_holds_nothing_for_it() -> None:
    text = Record(1, (("r:x", 0),), 1, (("r:x", 10),)).encode()
    assert held_for_others([("me", text)], "me", ["r:x"], 10) == 0
    assert held_for_others([("me", text), ("b", text)], "me", ["r:x"], 10) == 10


def test_a_limit_read_is_recorded_and_its_record_kept_once_answered() -> None:
    records = Records()
    records.track(admission(40), NOW)
    assert records.due("h", {}, 2, NOW, 1) == []  # nothing read yet: nothing to record
    due = sorted(records.due("h", KNOWN, 2, NOW, 2))
    assert [(k, r.values, r.processes, r.demand, e) for k, r, e in due] == [
        (R, (("r:sb", 4),), 2, (("r:sb", 1),), NOW + 86_400),
        (TOK, (("rt:sb", 50), ("t:sb", 100)), 2, (("t:sb", 40),), NOW + 86_400)]
    assert json.loads(due[1][1].encode()) == {
        "s": 2, "n": 2, "v": {"rt:sb": 50, "t:sb": 100}, "d": {"t:sb": 40}}
    records.sent("h", due)
    assert records.candidates(R) == []  # not answered: the store may keep none of ours
    records.answered("h", due)
    assert records.candidates(R) == [due[0][1]] and records.candidates(TOK) == [due[1][1]]
    assert records.due("h", KNOWN, 2, NOW + 1, 3) == []  # the same: not sent again
    assert records.recorded == {"h": {R, TOK}}


def test_a_record_holds_one_limit_however_many_subjects_share_its_table() -> None:
    """A per-sandbox budget's table has a field per sandbox: a record is one sandbox's
    limit, so what an admission writes does not grow with the sandboxes."""
    records = Records()
    for i in range(100):
        records.track(admission(subject=f"sb{i}"), NOW)
    known = {T: {f"{k}:sb{i}": 1 for i in range(100) for k in ("r", "t", "rt")}}
    due = records.due("h", known, 2, NOW, 1)
    assert len(due) == 200 and max(len(r.values) for _, r, _ in due) == 2


@pytest.mark.parametrize(("change", "sent"), [
    ({}, False),
    ({"known": {T: {"r:sb": 5, "t:sb": 100, "rt:sb": 50}}}, True),  # a value moved
    ({"processes": 3}, True),
    ({"now": NOW + ACTIVE - 1}, False),
    ({"admit": 5}, True),  # more admitted: the demand moved
])
def test_a_record_is_written_again_when_it_changed(change: dict[str, object],
                                                   sent: bool) -> None:
    records = kept("h", KNOWN, 40)
    if "admit" in change:
        records.track(admission(int(change["admit"])), NOW)  # type: ignore[call-overload]
    due = records.due("h", change.get("known", KNOWN), change.get("processes", 2),  # type: ignore[arg-type]
                      change.get("now", NOW), 2)  # type: ignore[arg-type]
    assert bool(due) == sent


def test_the_careful_reading_covers_every_record_the_store_may_keep() -> None:
    """Written 1 (answered), then 2 and 3 (no answer): any of them may be the one kept,
    so alone the process reads each field's highest value, the most processes and the
    least demand of the three."""
    records = Records()
    records.track(admission(40), NOW)
    written = []
    for serial, (known, processes, now) in enumerate([
            ({T: {"r:sb": 4, "t:sb": 100, "rt:sb": 50}}, 2, NOW),
            ({T: {"r:sb": 6, "t:sb": 90, "rt:sb": 50}}, 3, NOW + 1),
            ({T: {"r:sb": 5, "t:sb": 120, "rt:sb": 0}}, 2, NOW + 2)], start=1):
        if serial == 3:
            records.track(admission(30), now)
        due = records.due("h", known, processes, now, serial)
        records.sent("h", due)
        written.append(due)
    records.answered("h", written[0])
    assert [r.serial for r in records.candidates(TOK)] == [1, 2, 3]
    assert [records.known(T, f) for f in ("r:sb", "t:sb", "rt:sb")] == [6, 120, 50]
    assert records.processes(admission()) == 3
    assert records.cap(T, "t:sb") == 40  # (the demand before the third admission)
    assert records.held(admission())
    records.answered("h", written[2])  # 3 ran: 1 and 2 can no longer be kept
    assert [r.serial for r in records.candidates(TOK)] == [3]
    records.answered("h", written[1])  # (an answer arriving late changes nothing)
    assert [r.serial for r in records.candidates(TOK)] == [3]


def test_a_field_a_kept_record_may_lack_is_not_known() -> None:
    records = kept("h", {T: {"r:sb": 4}}, 1)
    assert records.known(T, "r:sb") == 4
    assert records.known(T, "t:sb") is None  # (the others hold nothing for it)
    assert records.known("b:other:daily:0", "r:sb") is None
    assert not records.held(Admission((Limit((("b:other:daily:0", "r:x"),), 1, 1),), ()))


def test_a_new_holder_starts_with_no_record_and_the_old_ones_are_deleted() -> None:
    records = kept("old", KNOWN, 1)
    due = records.due("new", KNOWN, 2, NOW, 2)
    assert records.holder == "new" and records.candidates(R) == []
    assert due  # (written again under the new holder)
    assert records.stale(NOW) == [("old", R), ("old", TOK)]
    records.forgotten([("old", R), ("old", TOK)])
    assert records.stale(NOW) == [] and "old" not in records.recorded
    records.sent("new", due)
    assert records.stale(NOW, closing=True) == [("new", R), ("new", TOK)]


def test_a_limit_unused_for_a_while_is_dropped_and_its_record_deleted() -> None:
    records = kept("h", KNOWN, 1)
    assert records.due("h", KNOWN, 2, NOW + ACTIVE + 1, 2) == []
    assert records.candidates(R) == [] and records.stale(NOW) == [("h", R), ("h", TOK)]
    assert records.of_field == {}


def test_demand_is_what_was_admitted_in_the_last_active_period() -> None:
    records = Records()
    records.track(admission(40), NOW)
    records.track(admission(30), NOW + ACTIVE - 20)
    due = dict((k, r) for k, r, _ in records.due("h", KNOWN, 2, NOW + ACTIVE + 15, 1))
    assert dict(due[TOK].demand) == {"t:sb": 30}  # (the first aged out)
    assert dict(due[R].demand) == {"r:sb": 1}
    assert len(records.limits[TOK].admitted) == 1  # (a bucket per 10 s, the old dropped)


def test_the_serve_refusal_names_the_periods_the_records_use() -> None:
    budget = Budget(name="daily", per="policy", window=86_400, window_text="24h",
                    tokens=100, source="p.yaml:3")
    reason = store_away(budget, share=True).reason
    assert f"last {ACTIVE / 60:g} minutes" in reason
    assert "state.unavailable: refuse" in store_away(budget).reason


def test_a_record_is_json_the_script_reads() -> None:
    record = Record(7, (("r:x", 3),), 2, (("r:x", 1),))
    assert json.loads(record.encode()) == {"s": 7, "n": 2, "v": {"r:x": 3},
                                           "d": {"r:x": 1}}
