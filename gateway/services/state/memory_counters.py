"""The one-process counters (the ``memory`` state store's): a ``CounterView`` without a
shared store behind it, with the leases of one process (see ``leases``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from gateway.services.state.counters import (
    Admission,
    CounterView,
    Increment,
    Table,
    first_refused,
)
from gateway.services.state.lease_keeper import Lease, LeaseHolding
from gateway.services.state.leases import ORPHANS, Charged, charge_of, parse_held

__all__ = ["MemoryCounters"]


class MemoryCounters(LeaseHolding):
    """Counters of one process (the ``memory`` state store), with its leases (the
    holders of one process: what a restart of it loses anyway, kept for the contract
    the shared stores meet)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.view = CounterView(clock)
        self._last_prune = 0.0
        self.leases: dict[str, tuple[str, float]] = {}  # holder -> (slot, expires at)
        self.lease: Lease | None = None

    def count(self, increments: Iterable[Increment]) -> None:
        self.view.add_shared(increments)
        now = self.view.clock()
        if now - self._last_prune > 60:
            self._last_prune = now
            self.view.prune()

    def counter(self, table: str, field: str) -> int:
        return self.view.value(table, field) if self.view.live(table) else 0

    def admit(self, admission: Admission, *, share: bool = True) -> int | None:
        refused = first_refused(admission, self.counter)
        if refused is None:
            self.count(admission.increments)
        return refused

    def settle(self, holder: str, increments: Iterable[Increment]) -> None:
        if holder in self.leases:
            self.count(increments)

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        return {t: self.view.table(t) for t in tables if self.view.live(t)}

    @property
    def counters_degraded(self) -> bool:
        return False

    # -- leases (``leases.LeaseStore``; ``holder``, ``take_lease``: ``LeaseHolding``) ----

    async def close(self) -> None:
        """Give the lease back (the calls it holds that never settled are charged)."""
        if self.lease is not None:
            await self.lease.stop()
            self.lease = None

    async def lease_claim(self, holder: str, slot: str, ttl: float, takeover: bool) -> bool:
        if takeover:
            for other, (where, _) in list(self.leases.items()):
                if where == slot:
                    self.leases[other] = (where, 0.0)
        self.leases[holder] = (slot, self.view.clock() + ttl)
        return True

    async def lease_renew(self, holder: str, ttl: float) -> bool | None:
        if holder not in self.leases:
            return False
        self.leases[holder] = (self.leases[holder][0], self.view.clock() + ttl)
        return True

    async def lease_reap(self, release: str | None) -> list[Charged] | None:
        now = self.view.clock()
        self.leases.pop(release or "", None)
        for holder in [h for h, (_, until) in self.leases.items() if until <= now]:
            del self.leases[holder]
        records = self.view.shared.get(ORPHANS, {})
        charged: list[Charged] = []
        increments: list[Increment] = []
        for name, amount in list(records.items()):
            held = parse_held(name)
            if held is not None and held[0] in self.leases:
                if amount == 0:
                    del records[name]
                continue
            del records[name]
            target = charge_of(held[2]) if held is not None else None
            if held is None or target is None or amount <= 0 or not self.view.live(held[1]):
                continue
            holder, table, field = held
            expires = self.view.expires.get(table, 0.0)
            increments += [(table, target, amount, expires), (table, field, -amount, expires)]
            charged.append(Charged(holder, table, field, amount))
        self.count(increments)
        return charged
