"""This process's lease on the state store, renewed by a heartbeat (see ``leases``:
what a lease holds and why; this is the part that runs: asyncio, the log, metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Sequence

from gateway.observability import metrics
from gateway.services.state.leases import BEAT, LEASE_TTL, Charged, LeaseStore

__all__ = ["Lease", "LeaseHolding", "new_holder", "report", "slot_of"]

log = logging.getLogger("sandbox_gateway.state")


def slot_of(worker: int | None, proxy: str) -> str:
    """The slot of this process: host, proxy address and worker index. A process that
    starts in a slot takes it over (the one before it in that slot is dead)."""
    return f"{socket.gethostname()}|{proxy}|{'-' if worker is None else worker}"


def new_holder(slot: str) -> str:
    """A holder id: unique to one lease of one process."""
    return f"{slot}#{secrets.token_hex(6)}"


class Lease:
    """This process's lease on a store: claimed at ``start`` (taking over its slot),
    renewed every ``beat`` seconds, each time also charging dead holders' records;
    given back at ``stop``. ``holder`` is what admissions record their reservations
    under (a new one if the lease was found gone while this process ran on)."""

    def __init__(self, store: LeaseStore, slot: str, *, ttl: float = LEASE_TTL,
                 beat: float = BEAT) -> None:
        self.store = store
        self.slot = slot
        self.ttl = ttl
        self.beat = beat
        self.holder: str | None = None
        self._lost = False
        self._unclaimed = False  # not yet taken: the store could not be written at start
        self._unsure = False  # the last renewal could not reach the store
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> bool:
        """Claim the lease, charge the dead, beat. False: the store could not be
        written (a full disk): the process serves without a lease, its reservations
        not recorded under one (like every count while the store is away), and each
        beat claims it again until the store takes it."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lease")
        if await self._claim():
            return True
        log.warning("state store: this process's lease cannot be written yet; budget "
                    "reservations are counted but not recorded under a lease until it is "
                    "(a crash meanwhile loses them, as every count held in memory)")
        return False

    async def _claim(self) -> bool:
        holder = new_holder(self.slot)
        if not await self.store.lease_claim(holder, self.slot, self.ttl, True):
            self._unclaimed = True
            return False
        self.holder, self._unclaimed = holder, False
        await self._reap()
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.beat)
            try:
                await self.renew()
            except Exception:  # a bug must not stop the heartbeat for good
                log.exception("state store: renewing this process's lease failed")

    async def renew(self) -> None:
        """One beat: renew (or replace a lease found gone), then charge the dead."""
        holder = self.holder
        if holder is None:
            if self._unclaimed and await self._claim():
                log.info("state store: this process's lease is taken (the store is writable "
                         "again); budget reservations are recorded under it from now on")
            return
        if not self._lost:
            kept = await self.store.lease_renew(holder, self.ttl)
            if kept is None:
                self._unsure = True  # (the store reports its outage)
                return
            if not kept:
                self._lost = True
                log.warning(
                    "state store: this process's lease %s was found dead (not renewed for "
                    "%gs, or another process started in its slot): the reservations of its "
                    "running calls were charged in full and their settlements are dropped; "
                    "taking a new lease", holder, self.ttl)
        if self._lost:
            fresh = new_holder(self.slot)
            if not await self.store.lease_claim(fresh, self.slot, self.ttl, False):
                return
            self.holder, self._lost = fresh, False
        if self._unsure:  # after an outage the others may not have renewed yet either:
            self._unsure = False  # they get a beat to, before anyone is found dead
            return
        await self._reap()

    async def _reap(self, release: str | None = None) -> None:
        charged = await self.store.lease_reap(release)
        if charged:
            report(charged, release)

    async def stop(self) -> None:
        """Stop beating; give the lease back (the store flushed its settlements first):
        records of calls that never settled are charged."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        holder, self.holder = self.holder, None
        if holder is not None:
            await self._reap(holder)


class LeaseHolding(LeaseStore):
    """What every store that keeps counters does with this process's lease (the three
    ``LeaseStore`` primitives are each store's own): take it, name its holder, and log
    once per holder that settlements of a holder found dead were dropped."""

    lease: Lease | None
    # gateway processes holding a lease on the store when it last looked (this one
    # included; set by each store's `lease_reap`): while the store cannot decide an
    # admission, this process's share of a budget's room is 1 / processes
    processes: int = 1
    # of what the last refused admission's limit counted as used, the shares other
    # processes hold to spend alone (``alone_records``; 0: none, or a store without them)
    others_held: int = 0
    _dropped: set[str]  # holders whose dropped settlements were logged
    _dropped_log: tuple[logging.Logger, str]  # the logger, and the line (%s: the holder)

    @property
    def holder(self) -> str | None:
        return self.lease.holder if self.lease is not None else None

    async def take_lease(self, slot: str, *, ttl: float = LEASE_TTL,
                         beat: float = BEAT) -> None:
        self.lease = Lease(self, slot, ttl=ttl, beat=beat)
        await self.lease.start()  # (False: it serves; the lease is claimed once it can be)

    def _settlements_dropped(self, holder: str) -> None:
        if holder not in self._dropped:
            self._dropped.add(holder)
            logger, message = self._dropped_log
            logger.warning(message, holder)


def report(charged: Sequence[Charged], released: str | None = None) -> None:
    """Log and count what was charged."""
    if not charged:
        return
    metrics.RESERVATIONS_ORPHANED.inc(len(charged))
    holders = sorted({c.holder for c in charged})
    tokens = sum(c.amount for c in charged if c.field.startswith("rt:"))
    nano = sum(c.amount for c in charged if c.field.startswith("rc:"))
    why = ("this process stopped with calls not settled" if holders == [released]
           else "their gateway process ended without settling them")
    log.warning("budgets: charged %d reservation(s) in full as used (%d tokens, $%.6f over "
                "every budget window they counted in): %s; holder(s) %s", len(charged),
                tokens, nano / 1e9, why, ", ".join(holders)[:500])
