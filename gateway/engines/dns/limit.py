"""Per-sandbox query rate limit for the DNS resolver: token buckets, plus a cap on the
audit lines the refused queries write.

A DNS tunnel needs many queries (each carries ~100-200 bytes of data in its name); a
sandbox doing real work needs a few per connection. A bucket per sandbox (refilled at
`rate` per second, holding at most `burst`) lets the work through and refuses a flood
without touching the other sandboxes. Refused queries are counted in the metric one by
one, but written to the audit log at most once a second per sandbox, each such line
saying how many refusals it stands for: a flood cannot flood the log as well.

Pure (the clock is injected) and bounded: buckets of idle keys are dropped once more
than `max_keys` exist.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RateLimiter"]

LINE_INTERVAL = 1.0  # seconds between two audit lines for one key's refused queries


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float
    refused: int = 0  # refused queries not yet written to the audit log
    last_line: float = float("-inf")


class RateLimiter:
    """Token buckets keyed by sandbox (unknown sources share one key)."""

    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 65536) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: dict[str, _Bucket] = {}

    def allow(self, key: str) -> bool:
        """Take one token from `key`'s bucket: False when it is empty (refuse the query)."""
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._prune(now)
            bucket = self._buckets[key] = _Bucket(float(self.burst), now)
        else:
            bucket.tokens = min(float(self.burst),
                                bucket.tokens + (now - bucket.stamp) * self.rate)
            bucket.stamp = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return True
        bucket.refused += 1
        return False

    def line_due(self, key: str) -> int | None:
        """After a refusal: the number of refusals the audit line written now should stand
        for (this one included), or None when no line is due yet (one per second)."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return None
        now = self.clock()
        if now - bucket.last_line < LINE_INTERVAL:
            return None
        count, bucket.refused, bucket.last_line = bucket.refused, 0, now
        return count

    def _prune(self, now: float) -> None:
        """Forget buckets that are full again (idle keys); if none is, the oldest half."""
        full = [k for k, b in self._buckets.items()
                if b.tokens + (now - b.stamp) * self.rate >= self.burst and b.refused == 0]
        if not full:
            by_age = sorted(self._buckets, key=lambda k: self._buckets[k].stamp)
            full = by_age[: len(by_age) // 2 or 1]
        for key in full:
            del self._buckets[key]
