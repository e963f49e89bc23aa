"""Each process's share of a budget, held in the shared store while it may decide alone.

While the store cannot answer a process's admission, the process decides on its share
of the room a budget had when it last read it (``counters.first_refused_alone``). The
processes the store still answers must leave that share alone - from before the first
one is cut off, since none can tell when another is: so every process writes, with its
ordinary writes, a **record** per limit of each budget it admitted on lately
(``ACTIVE``; ``key_of``: one sandbox's limit, not its whole table, so a record stays
small however many sandboxes share a table): the values of the limit's fields as it
last read them, the processes it divides the room by, and what it admitted on the limit
in that time (its demand: an idle process holds nothing). The store's admission adds
to what a limit used every *other* holder's share of its recorded room
(``held_for_others``, at most its demand), so a share is never spent by two (the
capacity leases of quota servers such as Doorman): a process cut off spends at most its
share, the others at most the rest. A record stays until its process deletes
it (the store answers it again and every count it made alone is written; it stopped
admitting on the budget; it stops), a process restarts in its slot, or the budget's
window ends: what a process spent alone while cut off reaches the store only when it
is back, so its share is held until then, even if it never comes back.

A record travels in a write that may run late (its answer lost): the store keeps the
record of the highest ``serial`` only, and the process decides alone on the most careful
of the records that may be the kept one (``known``: each field's highest value, the
most processes, the least demand): its last answered record and every unanswered one
sent after it. The cost: near a ceiling a call must fit in the room the others' shares
leave. Pure: the Redis store sends what ``due`` returns and reports what happened.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.services.state.counters import Admission, StoreAway, first_refused_alone

__all__ = ["ACTIVE", "SEP", "Record", "Records", "decide_alone", "held_for_others", "key_of"]

ACTIVE = 300.0  # seconds after its last admission a budget table's record is kept
_BUCKET = 10.0  # seconds: a process's demand is summed by such buckets (bounded memory)


@dataclass(frozen=True, slots=True)
class Record:
    """One budget table's record: ``values`` of the limit fields known, ``processes``,
    ``demand`` (by a limit's first field: the most its share may be), carried by the
    write numbered ``serial``."""

    serial: int
    values: tuple[tuple[str, int], ...]
    processes: int
    demand: tuple[tuple[str, int], ...] = ()

    def encode(self) -> str:
        """The JSON the store keeps (and its script reads)."""
        return json.dumps({"s": self.serial, "n": self.processes, "v": dict(self.values),
                           "d": dict(self.demand)}, separators=(",", ":"))


SEP = "\x1f"  # between a budget table and a limit's first field in a record's key


def key_of(table: str, first: str) -> str:
    """The key of the records of one limit (a budget table and its first field): a
    record is one limit's, so its size does not grow with the table's subjects."""
    return f"{table}{SEP}{first}"


@dataclass
class _Limit:
    table: str
    first: str
    fields: set[str] = field(default_factory=set)
    admitted: dict[int, int] = field(default_factory=dict)  # bucket -> what was added
    expires: float = 0.0
    used_at: float = 0.0
    answered: Record | None = None  # the last answered record
    unsure: list[Record] = field(default_factory=list)  # sent after it, no answer


class Records:
    """This process's records, by limit (``key_of``), under its current ``holder`` (see
    the module docstring)."""

    def __init__(self) -> None:
        self.holder: str | None = None
        self.limits: dict[str, _Limit] = {}
        self.of_field: dict[tuple[str, str], str] = {}  # (table, field) -> its limit's key
        self.recorded: dict[str, set[str]] = {}  # holder -> keys it may have records at

    def track(self, admission: Admission, now: float) -> None:
        """Note the limits of an admission: their records follow."""
        bucket = int(now // _BUCKET)
        expires = 0.0
        for _, _, _, at in admission.increments:
            expires = max(expires, at)
        for limit in admission.limits:
            if not limit.fields:
                continue
            table, first = limit.fields[0]  # (a limit's fields are one table's)
            key = key_of(table, first)
            entry = self.limits.get(key)
            if entry is None:
                entry = self.limits[key] = _Limit(table, first)
                for _, name in limit.fields:
                    self.of_field[(table, name)] = key
            entry.fields.update(name for _, name in limit.fields)
            entry.used_at = now
            entry.expires = max(entry.expires, expires)
            entry.admitted[bucket] = entry.admitted.get(bucket, 0) + limit.add

    def fields(self) -> dict[str, list[str]]:
        """The tracked fields by table: every write re-reads them (the next record)."""
        out: dict[str, set[str]] = {}
        for entry in self.limits.values():
            out.setdefault(entry.table, set()).update(entry.fields)
        return {table: sorted(names) for table, names in out.items()}

    def due(self, holder: str, known: dict[str, dict[str, int]], processes: int,
            now: float, serial: int) -> list[tuple[str, Record, float]]:
        """The records the write numbered ``serial`` carries under ``holder``: ``(key,
        record, table expiry)`` for each limit whose record changed or may not be the
        kept one. ``known``: the store's values as last read. A new holder starts with
        no record kept."""
        if holder != self.holder:
            self.holder = holder
            for entry in self.limits.values():
                entry.answered, entry.unsure = None, []
        self._prune(now)
        out = []
        for key, entry in self.limits.items():
            values = known.get(entry.table)
            if not values:
                continue
            record = Record(serial, tuple(sorted((f, values[f]) for f in entry.fields
                                                 if f in values)),
                            max(1, processes), _demand(entry, now))
            last = entry.answered
            if record.values and (entry.unsure or last is None or last.values != record.values
                                  or last.processes != record.processes
                                  or last.demand != record.demand):
                out.append((key, record, entry.expires))
        return out

    def sent(self, holder: str, records: Iterable[tuple[str, Record, float]]) -> None:
        """A write carrying ``records`` under ``holder`` is on its way."""
        for key, record, _ in records:
            self.limits[key].unsure.append(record)
            self.recorded.setdefault(holder, set()).add(key)

    def answered(self, holder: str, records: Iterable[tuple[str, Record, float]]) -> None:
        """The write carrying ``records`` ran: each is kept, unless a later one is."""
        for key, record, _ in records:
            entry = self.limits.get(key)
            if entry is None or holder != self.holder:
                continue
            if entry.answered is None or entry.answered.serial < record.serial:
                entry.answered = record
            kept = entry.answered.serial
            entry.unsure = [r for r in entry.unsure if r.serial > kept]

    def failed(self, records: Iterable[tuple[str, Record, float]]) -> None:
        """The write carrying ``records`` surely did not happen (a rolled back
        transaction): none of them can be kept."""
        for key, record, _ in records:
            entry = self.limits.get(key)
            if entry is not None:
                entry.unsure = [r for r in entry.unsure if r.serial != record.serial]

    def stale(self, now: float, closing: bool = False) -> list[tuple[str, str]]:
        """``(holder, key)`` records to delete: every one of a holder before the
        current, those of limits no longer tracked (all of them if ``closing``)."""
        self._prune(now)
        out = []
        for holder, keys in self.recorded.items():
            for key in sorted(keys):
                if closing or holder != self.holder or key not in self.limits:
                    out.append((holder, key))
        return out

    def forgotten(self, pairs: Iterable[tuple[str, str]]) -> None:
        """The store deleted these records."""
        for holder, key in pairs:
            keys = self.recorded.get(holder)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.recorded[holder]

    def candidates(self, key: str) -> list[Record]:
        """The records of a limit the store may keep for the current holder (none: it
        keeps none, or none it could be sure of)."""
        entry = self.limits.get(key)
        if entry is None or entry.answered is None:
            return []
        return [entry.answered, *entry.unsure]

    def known(self, table: str, name: str) -> int | None:
        """The value this process decides alone on: the highest a kept record may hold
        (None: one that may be kept has none, so the others hold nothing for it)."""
        highest: int | None = None
        for record in self.candidates(self.of_field.get((table, name), "")):
            value = dict(record.values).get(name)
            if value is None:
                return None
            highest = value if highest is None else max(highest, value)
        return highest

    def cap(self, table: str, first: str) -> int:
        """The most this process may admit alone on the limit whose first field is
        ``first``: the least demand a kept record may hold (0: one holds none)."""
        found = self.candidates(key_of(table, first))
        return min((dict(r.demand).get(first, 0) for r in found), default=0)

    def processes(self, admission: Admission) -> int:
        """The most processes a kept record of the admission's limits divides by."""
        return max([r.processes for key in _keys(admission)
                    for r in self.candidates(key)] or [1])

    def held(self, admission: Admission) -> bool:
        """A record the store surely keeps for every limit of the admission."""
        return all(self.candidates(key) for key in _keys(admission))

    def _prune(self, now: float) -> None:
        for key in [k for k, e in self.limits.items()
                    if e.expires <= now or e.used_at < now - ACTIVE]:
            entry = self.limits.pop(key)
            for name in entry.fields:
                self.of_field.pop((entry.table, name), None)


def held_for_others(records: Iterable[tuple[str, str]], me: str, names: Iterable[str],
                    ceiling: int) -> int:
    """What a limit over ``names`` counts as used for the other holders' shares:
    ``records`` the ``(holder, JSON)`` of its table; one that cannot be read holds the
    whole ceiling (it may be a share). (The Redis script does the same.)"""
    fields = list(names)
    return sum(_held(_read(text), fields, ceiling) for holder, text in records
               if holder != me)


def _read(text: str) -> dict[str, Any] | None:
    """A record's JSON, or None if it is not one."""
    try:
        found = json.loads(text)
    except ValueError:
        return None
    if (isinstance(found, dict) and isinstance(found.get("v"), dict)
            and isinstance(found.get("d"), dict) and _number(found.get("n")) is not None
            and not isinstance(found.get("n"), str)):
        return found
    return None


def _held(record: dict[str, Any] | None, fields: list[str], ceiling: int) -> int:
    """One holder's share of a limit over ``fields``: ``1 / processes`` of the room its
    record read (``counters.first_refused_alone``'s bound), at most its demand (None:
    unreadable, the ceiling)."""
    if record is None:
        return ceiling
    base = 0.0
    for name in fields:
        value = _number(record["v"].get(name))
        if value is None:
            return 0  # (it cannot decide alone on this limit)
        base += value
    cap = _number(record["d"].get(fields[0])) if fields else None
    if cap is None or ceiling <= base:
        return 0
    return int(min(cap, math.floor((ceiling - base) / max(1.0, float(record["n"])))))


def _number(value: object) -> float | None:
    """A number as Lua's ``tonumber`` reads it (a number, or a string of one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def decide_alone(admission: Admission, records: Records, holder: str | None,
                 seen: Callable[[str, str], int | None], mine: Callable[[str, str], int],
                 away: str) -> int | None:
    """The first limit this process's share refuses, or None: deciding alone on the
    most careful reading of its records the store may keep (and of ``seen``, its own
    last reading, which holds what it wrote since), at most its demand on each limit.
    ``StoreAway`` (``away``: why) if it holds no share of a table: ``holder`` None
    (none, or it is stopping), another holder's records, or none the store surely keeps."""
    if holder is None or holder != records.holder or not records.held(admission):
        raise StoreAway(f"{away}, and no share of this budget is held for this gateway "
                        "process in the store (it holds one for the budgets it admitted "
                        "calls on lately, once the store answered)")

    def known(table: str, name: str) -> int | None:
        recorded = records.known(table, name)
        return None if recorded is None else max(recorded, seen(table, name) or 0)

    refused = first_refused_alone(admission, known, mine, records.processes(admission))
    for index, limit in enumerate(admission.limits[:refused]):
        table, first = limit.fields[0]
        if sum(mine(t, f) for t, f in limit.fields) + limit.add > records.cap(table, first):
            return index
    return refused


def _demand(entry: _Limit, now: float) -> tuple[tuple[str, int], ...]:
    """What this process admitted on a limit in the last ``ACTIVE`` seconds: the most
    it holds a share for (an idle process holds none)."""
    oldest = int((now - ACTIVE) // _BUCKET)
    for bucket in [b for b in entry.admitted if b < oldest]:
        del entry.admitted[bucket]
    return ((entry.first, sum(entry.admitted.values())),) if entry.admitted else ()


def _keys(admission: Admission) -> set[str]:
    return {key_of(*limit.fields[0]) for limit in admission.limits if limit.fields}
