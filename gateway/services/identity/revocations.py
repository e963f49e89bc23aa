"""Revoked tokens as this gateway holds them: never waiting for the state store.

A revocation holds at once in the process that takes it, reaches every other worker
process of the gateway through the supervisor's relay (`gateway/runtime/relay.py`, which
does not touch the store), and is written to the state store - at once when it can be,
else held and retried every second until the store is back. Other replicas learn it
from the store, as before.

`is_revoked` (every request, and the sweep of open connections) is this process's own
revocations, then the store's view: no I/O. The revocations this process owes the store
(`pending`) are written by the process that took them; one it took over from the
supervisor's snapshot at its start (its predecessor took it and exited before the store
was back) is written by it. Once written, the supervisor is told (`stored`) and forgets
it: a worker started later reads it from the store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from gateway.services.polling import Poller
from gateway.services.state.base import StateStore, StateUnavailable

__all__ = ["Relay", "Relayed", "Revocation", "Revocations"]

log = logging.getLogger("sandbox_gateway")

RETRY = 1.0  # seconds between attempts to write the revocations the store missed
_PRUNE = 60.0  # seconds between sweeps of expired local revocations


@dataclass(frozen=True, slots=True)
class Relayed:
    """What the supervisor answered: the worker indexes holding the revocation (the
    asking one included) and those that did not acknowledge in time; `reached` False
    when the supervisor could not be asked (it is gone: the workers stop too)."""

    held: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    reached: bool = True


class Relay(Protocol):
    """The worker's end of the supervisor's relay (`gateway/runtime/relay_link.py`)."""

    async def broadcast(self, jti: str, expires_at: float) -> Relayed: ...
    def stored(self, jti: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Revocation:
    """The outcome of one revocation: `workers` processes hold it (1 without workers),
    `missing` did not confirm (None: unknown, the supervisor could not be asked), and
    the state store has it (`stored`) or not yet (`pending`: why)."""

    jti: str
    workers: int
    missing: tuple[int, ...] | None
    stored: bool
    pending: str | None = None

    @property
    def everywhere(self) -> bool:
        """Every process that may serve the token refuses it from now on: each running
        worker confirmed it, or the store has it (every worker follows the store)."""
        return self.stored or self.missing == ()

    def incomplete(self) -> str:
        """Why it is not known to hold everywhere (`503 revocation_incomplete`)."""
        who = ("the supervisor could not be asked" if self.missing is None else
               f"worker(s) {', '.join(map(str, self.missing))} did not confirm it in time")
        return (f"token {self.jti} is revoked on {self.workers} worker process(es), but "
                f"{who} and the state store could not be written ({self.pending}); it is "
                "written when the store is back: send the revocation again")


class Revocations:
    """This process's revocations and the store's view (see the module docstring)."""

    def __init__(self, state: StateStore, clock: Callable[[], float] = time.time) -> None:
        self.state = state
        self.clock = clock
        self.relay: Relay | None = None  # set once the worker's link is open
        self._local: dict[str, float] = {}  # jti -> expiry: held here, whatever the store
        self._unstored: dict[str, float] = {}  # jti -> expiry: owed to the store
        self._retry = _Retry(self)
        self._last_prune = 0.0

    def is_revoked(self, jti: str) -> bool:
        """No I/O: this process's revocations, then the state store's view."""
        expires_at = self._local.get(jti)
        if expires_at is not None and expires_at > self.clock():
            return True
        return self.state.is_revoked(jti)

    @property
    def pending(self) -> int:
        """Revocations this process holds that the state store does not have yet."""
        return len(self._unstored)

    def learn(self, jti: str, expires_at: float) -> None:
        """Hold a revocation another worker took (relayed): refused here from now on."""
        self._local[jti] = max(expires_at, self._local.get(jti, 0.0))

    def adopt(self, revoked: Iterable[tuple[str, float]]) -> None:
        """At start: the revocations the supervisor holds that the store does not have
        yet (their worker exited before it could write them): held here, and written
        by this process."""
        for jti, expires_at in revoked:
            self.learn(jti, expires_at)
            self._unstored[jti] = max(expires_at, self._unstored.get(jti, 0.0))
        if self._unstored:
            log.warning("holding %d revocation(s) the state store does not have yet (taken "
                        "by a worker that exited); writing them when it can be written",
                        len(self._unstored))

    async def revoke(self, jti: str, expires_at: float) -> Revocation:
        """Revoke `jti` until `expires_at`: here at once, on every worker through the
        relay, in the store when it can be written (held and retried otherwise)."""
        self.learn(jti, expires_at)
        self._unstored[jti] = max(expires_at, self._unstored.get(jti, 0.0))
        relay = self.relay
        relayed = Relayed(held=(), missing=(), reached=True)
        if relay is not None:
            relayed = await relay.broadcast(jti, expires_at)
        why = await self._store(jti)
        workers: int
        missing: tuple[int, ...] | None
        if relay is None:
            workers, missing = 1, ()
        elif relayed.reached:
            workers, missing = len(relayed.held), relayed.missing
        else:
            workers, missing = 1, None
        if why is not None:
            log.warning("token %s is revoked on %d worker(s) and not yet in the state store "
                        "(%s): written when the store is back", jti, workers, why)
        return Revocation(jti, workers, missing, why is None, why)

    async def _store(self, jti: str) -> str | None:
        """Write one owed revocation; None when it is written, else why not."""
        expires_at = self._unstored.get(jti)
        if expires_at is None:
            return None
        try:
            await self.state.revoke(jti, expires_at)
        except StateUnavailable as exc:
            return str(exc)
        if self._unstored.get(jti) == expires_at:
            del self._unstored[jti]
        if self.relay is not None:
            self.relay.stored(jti)
        return None

    async def write_pending(self) -> int:
        """Write the owed revocations (in order, until the store refuses one); how many
        are still owed."""
        now = self.clock()
        before = len(self._unstored)
        for jti, expires_at in list(self._unstored.items()):
            if expires_at <= now:
                del self._unstored[jti]  # (its token is refused regardless)
            elif await self._store(jti) is not None:
                break
        if before and not self._unstored:
            log.warning("the %d revocation(s) held while the state store was away are "
                        "written to it", before)
        if now - self._last_prune > _PRUNE:
            self._last_prune = now
            self._local = {j: exp for j, exp in self._local.items() if exp > now}
        return len(self._unstored)

    def start(self) -> None:
        """Retry the owed writes every `RETRY` seconds until `stop`."""
        self._retry.start()

    async def stop(self) -> None:
        await self._retry.stop()
        if self._unstored:
            await self.write_pending()
        if self._unstored:
            log.error("%d revocation(s) were never written to the state store (it stayed "
                      "away): the other worker processes of this gateway keep them while it "
                      "runs; after a full restart re-revoke them (%s)", len(self._unstored),
                      ", ".join(sorted(self._unstored)[:20]))


class _Retry(Poller):
    interval = RETRY
    _poll_name = "revocation-writer"

    def __init__(self, revocations: Revocations) -> None:
        self.revocations = revocations

    async def check(self) -> bool:
        before = self.revocations.pending
        return await self.revocations.write_pending() < before

    def start(self) -> None:
        self._poll()
