"""What each sandbox's compressed data may unpack to beyond what ordinary archives do
(`core/unpack_bounds.Excess`), across its requests: a bucket of bytes per sandbox,
`size` at most, refilled at `rate` a second (`limits.unpacked_excess` and
`limits.unpacked_excess_rate`). A body of bombs costs a worker's CPU many times what it
costs to send; past its bucket a sandbox's next such body is refused, the others'
traffic untouched. Bounded: the buckets of sandboxes full again are dropped once more
than `max_keys` exist.

The exchange in hand says its sandbox's bucket is the one to charge at each of its calls
that read the request or the answer (`unpack_bounds.charge_to`; an answer's runs are read
under `dlp: {answers: report}`), and that none is when it ends: every engine calls the
exchange's methods. (Before the twenty-second session the answer's calls said nothing: an
answer read while another exchange's request was in hand was charged to that sandbox.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.core.unpack_bounds import Excess

__all__ = ["UNPACKED_EXCESS", "UNPACKED_EXCESS_RATE", "UnpackBudgets"]

UNPACKED_EXCESS = 256 * 1024 * 1024  # bytes (`limits.unpacked_excess`)
UNPACKED_EXCESS_RATE = 16 * 1024 * 1024  # bytes a second (`limits.unpacked_excess_rate`)


class UnpackBudgets:
    """The `Excess` of each sandbox, refilled by the clock (`for_sandbox`)."""

    def __init__(self, size: int, rate: int, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 65536) -> None:
        self.size, self.rate, self.clock, self.max_keys = size, rate, clock, max_keys
        self._buckets: dict[str, tuple[Excess, float | None]] = {}  # (None: full)

    def for_sandbox(self, sandbox: str) -> Excess:
        """`sandbox`'s bucket, refilled for the time since it was last asked."""
        held = self._buckets.get(sandbox)
        if held is not None and held[0].left >= self.size:
            # (full, as most requests find it: no clock read; spent by this request,
            # it is refilled from the next one's time, never for the time it was full)
            return held[0] if held[1] is None else self._stamp(sandbox, held[0], None)
        now = self.clock()
        if held is None:
            if len(self._buckets) >= self.max_keys:
                self._prune(now)
            excess = Excess(self.size, self.rate)
        else:
            excess, stamp = held
            if stamp is not None:
                excess.left = min(float(self.size), excess.left + (now - stamp) * self.rate)
        return self._stamp(sandbox, excess, now)

    def _stamp(self, sandbox: str, excess: Excess, now: float | None) -> Excess:
        self._buckets[sandbox] = (excess, now)
        return excess

    def _prune(self, now: float) -> None:
        """Forget the buckets full again (idle sandboxes); if none is, the oldest half."""
        full = [k for k, (e, t) in self._buckets.items()
                if t is None or e.left + (now - t) * self.rate >= self.size]
        if not full:
            by_age = sorted(self._buckets, key=lambda k: self._buckets[k][1] or 0.0)
            full = by_age[:len(by_age) // 2 or 1]
        for key in full:
            del self._buckets[key]
