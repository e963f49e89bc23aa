"""Counters every gateway process adds to: usage totals and budget consumption.

A counter is ``table`` -> ``field`` -> integer, and a table expires at a given time (a
budget window's end, an hourly usage bucket's retention). The state stores implement
``Counters``:

* ``count`` and ``counter`` are synchronous: a request never waits on a network. ``count``
  adds to a pending batch the store writes at its own pace (SQLite: once per event-loop
  tick; Redis: every ``interval``); ``counter`` answers the store's value plus what is
  pending here.
* ``admit`` is budget admission: every ``Limit`` of an ``Admission`` is checked and, if
  all hold, its increments are counted, as one step written to the store before it
  returns (SQLite: one transaction across the host's processes; Redis: one script;
  memory: one process). While the store cannot be written, this process's view
  decides and the increments wait in the pending batch.
* ``settle`` counts a call's settlement like ``count``, in the same batch, but only
  while its ``holder``'s lease stands when the batch is written (``leases``: the
  reservation of a dead holder is charged in full instead, and its settlement dropped).
  ``holder`` is this process's lease once ``take_lease`` took one (None before).
* ``counter_tables`` (admin API) reads whole tables as fresh as the store allows.
* ``counters_degraded`` is True while the store cannot be written: counts go on
  locally and are written when it is back.
* While the store cannot decide an admission across processes, each process decides
  alone on **its share** (``first_refused_alone``): of the room a limit had when it
  last read it, ``1 / processes`` (the gateway processes holding a lease on the store;
  every worker of every replica takes one), a share the store holds for it from before
  (``alone_records``): the answered processes leave it alone, so the ceiling holds
  whether all processes are cut off or only some (2026-11-30, before: 13 requests of a
  budget of 10 in tests/services/state/test_counters_shares.py).
  ``admit(..., share=False)`` (``state.unavailable: refuse``) decides nothing alone:
  it raises ``StoreAway`` and counts nothing.

``CounterView`` is that local state; ``memory_counters.MemoryCounters`` is the one-process store;
``gateway.services.state.sqlite`` and ``gateway.services.state.counters_redis`` are the shared ones.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.core.refusal import StateUnavailable
from gateway.services.state.leases import BEAT, LEASE_TTL

__all__ = [
    "Admission",
    "CounterView",
    "Counters",
    "Increment",
    "Limit",
    "StoreAway",
    "first_refused",
    "first_refused_alone",
]

log = logging.getLogger("sandbox_gateway.counters")

Table = dict[str, int]


Increment = tuple[str, str, int, float]
"""``(table, field, amount, expires_at)``: add ``amount`` to ``table[field]``; the table
expires at ``expires_at`` (Unix). A plain tuple: every metered exchange makes several."""


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit of an admission: the sum of ``fields`` plus ``add`` must stay within
    ``ceiling``, and the sum alone below it (a limit already reached admits nothing)."""

    fields: tuple[tuple[str, str], ...]  # (table, field), summed
    ceiling: int
    add: int

    def holds(self, used: int) -> bool:
        return used < self.ceiling and used + self.add <= self.ceiling


@dataclass(frozen=True, slots=True)
class Admission:
    """Limits to check and the increments to count if every one holds (budget
    admission: one request, and a reservation)."""

    limits: tuple[Limit, ...]
    increments: tuple[Increment, ...]


def first_refused(admission: Admission, read: Callable[[str, str], int],
                  held: Callable[[Limit], int] | None = None) -> int | None:
    """The index of the first limit ``read``'s values refuse, or None; ``held``: what a
    limit counts as used besides its fields (the other processes' shares)."""
    for index, limit in enumerate(admission.limits):
        used = sum(read(table, field) for table, field in limit.fields)
        if not limit.holds(used + (held(limit) if held is not None else 0)):
            return index
    return None


def first_refused_alone(admission: Admission, known: Callable[[str, str], int | None],
                        mine: Callable[[str, str], int], processes: int) -> int | None:
    """The first limit this process's share refuses, or None (the module docstring):
    ``known`` the store's value as this process last read it (None: never read),
    ``mine`` what this process counted that the store does not have yet. Each of
    ``processes`` may add at most ``(ceiling - known) / processes``: this one's counts
    weigh ``processes`` times. One process decides as ``first_refused`` does."""
    n = max(1, processes)
    for index, limit in enumerate(admission.limits):
        base = 0
        for table, name in limit.fields:
            value = known(table, name)
            if value is None:
                return index
            base += value
        spent = n * sum(mine(table, name) for table, name in limit.fields)
        if not (base + spent < limit.ceiling
                and base + spent + n * limit.add <= limit.ceiling):
            return index
    return None


class StoreAway(StateUnavailable):
    """The store cannot decide an admission across processes now, and this process may
    not decide it alone (``admit(..., share=False)``): nothing was counted."""


class Counters(Protocol):
    """Shared counters (see the module docstring)."""

    def count(self, increments: Iterable[Increment]) -> None: ...
    def counter(self, table: str, field: str) -> int: ...
    def admit(self, admission: Admission, *, share: bool = True) -> int | None: ...
    def settle(self, holder: str, increments: Iterable[Increment]) -> None: ...
    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]: ...
    @property
    def counters_degraded(self) -> bool: ...
    @property
    def processes(self) -> int: ...
    @property
    def others_held(self) -> int: ...
    @property
    def holder(self) -> str | None: ...
    async def take_lease(self, slot: str, *, ttl: float = LEASE_TTL,
                         beat: float = BEAT) -> None: ...


class CountersOf:
    """The Counters port answered by a store's `_counters` (the state stores' mixin)."""

    _counters: Counters

    def count(self, increments: Iterable[Increment]) -> None:
        self._counters.count(increments)

    def counter(self, table: str, field: str) -> int:
        return self._counters.counter(table, field)

    def admit(self, admission: Admission, *, share: bool = True) -> int | None:
        return self._counters.admit(admission, share=share)

    def settle(self, holder: str, increments: Iterable[Increment]) -> None:
        self._counters.settle(holder, increments)

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        return await self._counters.counter_tables(tables)

    @property
    def counters_degraded(self) -> bool:
        return self._counters.counters_degraded

    @property
    def processes(self) -> int:
        return self._counters.processes

    @property
    def others_held(self) -> int:
        return self._counters.others_held

    @property
    def holder(self) -> str | None:
        return self._counters.holder

    async def take_lease(self, slot: str, *, ttl: float = LEASE_TTL,
                         beat: float = BEAT) -> None:
        await self._counters.take_lease(slot, ttl=ttl, beat=beat)


class CounterView:
    """The local picture: last known shared values plus the pending (unsent) batch,
    the pending settlements (``settling``, by holder: written only while the
    holder's lease stands) and what was sent without an answer (``unsure``: the store
    may have written it or not, it is counted here until the store says which).

    ``forget_after`` (seconds, None = never) drops shared values neither read nor
    written for that long, for stores that hold the real totals elsewhere (Redis); the
    values ``counter`` read in that time are the ``watched`` ones a flush refreshes.
    """

    def __init__(self, clock: Callable[[], float] = time.time,
                 forget_after: float | None = None) -> None:
        self.clock = clock
        self.forget_after = forget_after
        self.shared: dict[str, Table] = {}
        self.pending: dict[str, Table] = {}
        self.settling: dict[str, dict[str, Table]] = {}
        self.unsure: dict[str, Table] = {}
        self.expires: dict[str, float] = {}
        self.watched: dict[tuple[str, str], float] = {}
        self._touched: dict[tuple[str, str], float] = {}

    def add(self, increments: Iterable[Increment]) -> None:
        """Add to the pending batch."""
        self._merge(self.pending, increments)

    def add_settling(self, holder: str, increments: Iterable[Increment]) -> None:
        """Add to ``holder``'s pending settlements."""
        self._merge(self.settling.setdefault(holder, {}), increments)

    def set_unsure(self, increments: Iterable[Increment]) -> None:
        """What was sent without an answer, all of it (replaces the last)."""
        self.unsure = {}
        self._merge(self.unsure, increments)

    def add_shared(self, increments: Iterable[Increment]) -> None:
        """Add straight to the shared values (a store without a batch, or others' lines)."""
        self._merge(self.shared, increments)

    def _merge(self, into: dict[str, Table], increments: Iterable[Increment]) -> None:
        expires = self.expires
        for table, field, amount, expires_at in increments:
            fields = into.get(table)
            if fields is None:
                fields = into[table] = {}
            fields[field] = fields.get(field, 0) + amount
            if expires.get(table, 0.0) < expires_at:
                expires[table] = expires_at

    def value(self, table: str, field: str) -> int:
        """Shared + pending; remembers that this value is read (a flush refreshes it)."""
        if self.forget_after is not None:
            self.watched[(table, field)] = self.clock()
        shared = self.shared.get(table)
        return (shared.get(field, 0) if shared else 0) + self.unwritten(table, field)

    def known(self, table: str, field: str) -> int | None:
        """The store's value as last read here (None: never read, or forgotten)."""
        shared = self.shared.get(table)
        return shared.get(field) if shared else None

    def unwritten(self, table: str, field: str) -> int:
        """What is pending here for one field (the batch, the settlements, what is
        unsure)."""
        value = 0
        for tables in (self.pending, self.unsure, *self.settling.values()):
            fields = tables.get(table)
            if fields:
                value += fields.get(field, 0)
        return value

    def has_unwritten(self, table: str) -> bool:
        """True if anything of ``table`` is pending here."""
        return bool(self.pending.get(table)) or bool(self.unsure.get(table)) or any(
            tables.get(table) for tables in self.settling.values())

    def table(self, table: str, base: Table | None = None) -> Table:
        """A whole table: ``base`` (fresh from the store) or the shared values, plus
        the pending batch, settlements and what is unsure."""
        out = dict(self.shared.get(table, {}) if base is None else base)
        for fields in (self.pending.get(table, {}), self.unsure.get(table, {}),
                       *(tables.get(table, {}) for tables in self.settling.values())):
            for field, amount in fields.items():
                out[field] = out.get(field, 0) + amount
        return out

    def take(self) -> dict[str, Table]:
        """The pending batch, now being sent (``restore`` it if that fails)."""
        batch, self.pending = self.pending, {}
        return batch

    def restore(self, batch: dict[str, Table]) -> None:
        """Put a batch that could not be sent back in front of the pending one."""
        _add_tables(self.pending, batch)

    def take_settling(self) -> dict[str, dict[str, Table]]:
        """The pending settlements, by holder, now being sent (``restore_settling``)."""
        batch, self.settling = self.settling, {}
        return batch

    def restore_settling(self, batch: dict[str, dict[str, Table]]) -> None:
        """Put settlements that could not be sent back."""
        for holder, tables in batch.items():
            _add_tables(self.settling.setdefault(holder, {}), tables)

    @contextlib.contextmanager
    def sending(self) -> Iterator[tuple[dict[str, Table], dict[str, dict[str, Table]]]]:
        """The pending batch and settlements, taken to be written; put back in front of
        what is counted meanwhile if the block raises (the write failed: the next one
        takes them again). The stores' one way to write what they counted."""
        batch, settling = self.take(), self.take_settling()
        try:
            yield batch, settling
        except Exception:
            self.restore(batch)
            self.restore_settling(settling)
            raise

    def set_shared(self, table: str, field: str, value: int) -> None:
        """The store's current value of one field."""
        self.shared.setdefault(table, {})[field] = value
        if self.forget_after is not None:
            self._touched[(table, field)] = self.clock()

    def watched_fields(self) -> dict[str, list[str]]:
        """Fields read lately and not pending, by table: what a flush should re-read."""
        out: dict[str, list[str]] = {}
        for table, field in self.watched:
            if field not in self.pending.get(table, {}) and not any(
                    field in tables.get(table, ()) for tables in self.settling.values()):
                out.setdefault(table, []).append(field)
        return out

    def prune(self) -> None:
        """Drop expired tables and (with ``forget_after``) values unused for that long."""
        now = self.clock()
        for table in [t for t, exp in self.expires.items() if exp <= now]:
            del self.expires[table]
            self.shared.pop(table, None)
            self.pending.pop(table, None)
            self.unsure.pop(table, None)
            for tables in self.settling.values():
                tables.pop(table, None)
        if self.forget_after is None:
            return
        horizon = now - self.forget_after
        for key in [k for k, at in self.watched.items() if at < horizon]:
            del self.watched[key]
        for key in [k for k, at in self._touched.items() if at < horizon]:
            del self._touched[key]
        for table in list(self.shared):
            fields = self.shared[table]
            for field in [f for f in fields if (table, f) not in self.watched
                          and (table, f) not in self._touched]:
                del fields[field]
            if not fields:
                del self.shared[table]

    def live(self, table: str) -> bool:
        """False once ``table`` has expired."""
        return self.expires.get(table, 0.0) > self.clock()


def _add_tables(into: dict[str, Table], tables: dict[str, Table]) -> None:
    for table, fields in tables.items():
        target = into.setdefault(table, {})
        for field, amount in fields.items():
            target[field] = target.get(field, 0) + amount


class EmptyCounters:
    """Counters that stay at zero: what a decision without traffic (explain, `policy
    test`, replay) checks budgets against, however many it makes (nothing is used)."""

    def count(self, increments: Iterable[Increment]) -> None:
        pass

    def counter(self, table: str, field: str) -> int:
        return 0

    def admit(self, admission: Admission, *, share: bool = True) -> int | None:
        return first_refused(admission, self.counter)

    def settle(self, holder: str, increments: Iterable[Increment]) -> None:
        pass

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        return {}

    @property
    def counters_degraded(self) -> bool:
        return False

    @property
    def processes(self) -> int:
        return 1

    @property
    def others_held(self) -> int:
        return 0

    @property
    def holder(self) -> str | None:
        return None

    async def take_lease(self, slot: str, *, ttl: float = LEASE_TTL,
                         beat: float = BEAT) -> None:
        pass
