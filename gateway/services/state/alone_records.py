"""Each process's share of a budget, held in the shared store while it may decide alone.

While the store cannot answer a process's admission, the process decides on its share
of the room a budget had when it last read it (``counters.first_refused_alone``). The
processes the store still answers must leave that share alone - from before the first
one is cut off, since none can tell when another is: so every process writes, with its
ordinary writes, a **record** per budget table it admitted on lately (``ACTIVE``): the
values of the limit fields as it last read them, the processes it divides the room by,
and what it admitted on each limit in that time (its demand: an idle process holds
nothing). The store's admission adds to what a limit used every *other* holder's share
of its recorded room (``held_for_others``, at most its demand), so a share is never spent by two
(the capacity leases of quota servers such as Doorman): a process cut off spends at
most its share, the others at most the rest. A record stays until its process deletes
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

__all__ = ["ACTIVE", "Record", "Records", "decide_alone", "held_for_others"]

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


@dataclass
class _Table:
    fields: set[str] = field(default_factory=set)
    admitted: dict[str, dict[int, int]] = field(default_factory=dict)  # first -> bucket
    expires: float = 0.0
    used_at: float = 0.0
    answered: Record | None = None  # the last answered record
    unsure: list[Record] = field(default_factory=list)  # sent after it, no answer


class Records:
    """This process's records, by budget table, under its current ``holder`` (see the
    module docstring)."""

    def __init__(self) -> None:
        self.holder: str | None = None
        self.tables: dict[str, _Table] = {}
        self.recorded: dict[str, set[str]] = {}  # holder -> tables it may have records in

    def track(self, admission: Admission, now: float) -> None:
        """Note the limit fields of an admission: their table's record follows."""
        bucket = int(now // _BUCKET)
        for limit in admission.limits:
            if not limit.fields:
                continue
            table, first = limit.fields[0]  # (a limit's fields are one table's)
            entry = self.tables.get(table)
            if entry is None:
                entry = self.tables[table] = _Table()
            entry.fields.update(name for _, name in limit.fields)
            entry.used_at = now
            buckets = entry.admitted.setdefault(first, {})
            buckets[bucket] = buckets.get(bucket, 0) + limit.add
        for table, _, _, at in admission.increments:
            entry = self.tables.get(table)
            if entry is not None and entry.expires < at:
                entry.expires = at

    def fields(self) -> dict[str, list[str]]:
        """The tracked fields by table: every write re-reads them (the next record)."""
        return {table: sorted(entry.fields) for table, entry in self.tables.items()}

    def due(self, holder: str, known: dict[str, dict[str, int]], processes: int,
            now: float, serial: int) -> list[tuple[str, Record, float]]:
        """The records the write numbered ``serial`` carries under ``holder``: ``(table,
        record, table expiry)`` for each table whose record changed or may not be the
        kept one. ``known``: the store's values as last read. A new holder starts with
        no record kept."""
        if holder != self.holder:
            self.holder = holder
            for entry in self.tables.values():
                entry.answered, entry.unsure = None, []
        self._prune(now)
        out = []
        for table in (known.keys() & self.tables.keys()):  # (a table not read: no values)
            entry, values = self.tables[table], known[table]
            record = Record(serial, tuple(sorted((f, values[f]) for f in entry.fields
                                                 if f in values)),
                            max(1, processes), _demand(entry, now))
            last = entry.answered
            if record.values and (entry.unsure or last is None or last.values != record.values
                                  or last.processes != record.processes
                                  or last.demand != record.demand):
                out.append((table, record, entry.expires))
        return out

    def sent(self, holder: str, records: Iterable[tuple[str, Record, float]]) -> None:
        """A write carrying ``records`` under ``holder`` is on its way."""
        for table, record, _ in records:
            self.tables[table].unsure.append(record)
            self.recorded.setdefault(holder, set()).add(table)

    def answered(self, holder: str, records: Iterable[tuple[str, Record, float]]) -> None:
        """The write carrying ``records`` ran: each is kept, unless a later one is."""
        for table, record, _ in records:
            entry = self.tables.get(table)
            if entry is None or holder != self.holder:
                continue
            if entry.answered is None or entry.answered.serial < record.serial:
                entry.answered = record
            kept = entry.answered.serial
            entry.unsure = [r for r in entry.unsure if r.serial > kept]

    def failed(self, records: Iterable[tuple[str, Record, float]]) -> None:
        """The write carrying ``records`` surely did not happen (a rolled back
        transaction): none of them can be kept."""
        for table, record, _ in records:
            entry = self.tables.get(table)
            if entry is not None:
                entry.unsure = [r for r in entry.unsure if r.serial != record.serial]

    def stale(self, now: float, closing: bool = False) -> list[tuple[str, str]]:
        """``(holder, table)`` records to delete: every one of a holder before the
        current, those of tables no longer tracked (all of them if ``closing``)."""
        self._prune(now)
        out = []
        for holder, tables in self.recorded.items():
            for table in sorted(tables):
                if closing or holder != self.holder or table not in self.tables:
                    out.append((holder, table))
        return out

    def forgotten(self, pairs: Iterable[tuple[str, str]]) -> None:
        """The store deleted these records."""
        for holder, table in pairs:
            tables = self.recorded.get(holder)
            if tables is not None:
                tables.discard(table)
                if not tables:
                    del self.recorded[holder]

    def candidates(self, table: str) -> list[Record]:
        """The records of ``table`` the store may keep for the current holder (none:
        it keeps none, or none it could be sure of)."""
        entry = self.tables.get(table)
        if entry is None or entry.answered is None:
            return []
        return [entry.answered, *entry.unsure]

    def known(self, table: str, name: str) -> int | None:
        """The value this process decides alone on: the highest a kept record may hold
        (None: one that may be kept has none, so the others hold nothing for it)."""
        highest: int | None = None
        for record in self.candidates(table):
            value = dict(record.values).get(name)
            if value is None:
                return None
            highest = value if highest is None else max(highest, value)
        return highest

    def cap(self, table: str, first: str) -> int:
        """The most this process may admit alone on the limit whose first field is
        ``first``: the least demand a kept record may hold (0: one holds none)."""
        found = self.candidates(table)
        return min((dict(r.demand).get(first, 0) for r in found), default=0)

    def processes(self, admission: Admission) -> int:
        """The most processes a kept record of the admission's tables divides by."""
        return max([r.processes for table in _tables(admission)
                    for r in self.candidates(table)] or [1])

    def held(self, admission: Admission) -> bool:
        """A record the store surely keeps for every table of the admission."""
        return all(self.candidates(table) for table in _tables(admission))

    def _prune(self, now: float) -> None:
        for table in [t for t, e in self.tables.items()
                      if e.expires <= now or e.used_at < now - ACTIVE]:
            del self.tables[table]


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


def _demand(entry: _Table, now: float) -> tuple[tuple[str, int], ...]:
    """What this process admitted on each limit of a table in the last ``ACTIVE``
    seconds: the most it holds a share for (an idle process holds none)."""
    out = []
    oldest = int((now - ACTIVE) // _BUCKET)
    for first, buckets in sorted(entry.admitted.items()):
        for bucket in [b for b in buckets if b < oldest]:
            del buckets[bucket]
        if buckets:
            out.append((first, sum(buckets.values())))
    return tuple(out)


def _tables(admission: Admission) -> set[str]:
    return {table for limit in admission.limits for table, _ in limit.fields}
