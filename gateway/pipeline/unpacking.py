"""What each sandbox's compressed data may unpack to beyond what ordinary archives do
(`core/unpack_bounds.Excess`), across its requests: a bucket of bytes per sandbox,
`size` at most, refilled at `rate` a second (`limits.unpacked_excess` and
`limits.unpacked_excess_rate`). A body of bombs costs a worker's CPU many times what it
costs to send; past its bucket a sandbox's next such body is refused, the others'
traffic untouched. Bounded: the buckets of sandboxes full again are dropped once more
than `max_keys` exist.

The exchange in hand sets its sandbox's bucket for the core to charge while it reads the
request (`charged`): every engine calls the exchange's methods, and mitmproxy runs its
hooks in tasks of their own, so the bucket is set around each call, not once a
connection.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Protocol

from gateway.core.unpack_bounds import EXCESS, Excess

__all__ = ["UNPACKED_EXCESS", "UNPACKED_EXCESS_RATE", "UnpackBudgets", "charged", "charged_async"]

UNPACKED_EXCESS = 256 * 1024 * 1024  # bytes (`limits.unpacked_excess`)
UNPACKED_EXCESS_RATE = 16 * 1024 * 1024  # bytes a second (`limits.unpacked_excess_rate`)


class UnpackBudgets:
    """The `Excess` of each sandbox, refilled by the clock (`for_sandbox`)."""

    def __init__(self, size: int, rate: int, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 65536) -> None:
        self.size, self.rate, self.clock, self.max_keys = size, rate, clock, max_keys
        self._buckets: dict[str, tuple[Excess, float]] = {}

    def for_sandbox(self, sandbox: str) -> Excess:
        """`sandbox`'s bucket, refilled for the time since it was last asked."""
        now = self.clock()
        held = self._buckets.get(sandbox)
        if held is None:
            if len(self._buckets) >= self.max_keys:
                self._prune(now)
            excess = Excess(self.size, self.rate)
        else:
            excess, stamp = held
            excess.left = min(float(self.size), excess.left + (now - stamp) * self.rate)
        self._buckets[sandbox] = (excess, now)
        return excess

    def _prune(self, now: float) -> None:
        """Forget the buckets full again (idle sandboxes); if none is, the oldest half."""
        full = [k for k, (e, t) in self._buckets.items()
                if e.left + (now - t) * self.rate >= self.size]
        if not full:
            by_age = sorted(self._buckets, key=lambda k: self._buckets[k][1])
            full = by_age[:len(by_age) // 2 or 1]
        for key in full:
            del self._buckets[key]


class _Charged(Protocol):
    excess: Excess | None


def charged[S: _Charged, **P, R](method: Callable[Concatenate[S, P], R]
                                 ) -> Callable[Concatenate[S, P], R]:
    """`method` of an exchange, run with its sandbox's `Excess` set for the core."""
    @functools.wraps(method)
    def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        token = EXCESS.set(self.excess)
        try:
            return method(self, *args, **kwargs)
        finally:
            EXCESS.reset(token)
    return run


def charged_async[S: _Charged, **P, R](
        method: Callable[Concatenate[S, P], Coroutine[Any, Any, R]]
        ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, R]]:
    """`charged`, for a coroutine method."""
    @functools.wraps(method)
    async def run(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        token = EXCESS.set(self.excess)
        try:
            return await method(self, *args, **kwargs)
        finally:
            EXCESS.reset(token)
    return run
