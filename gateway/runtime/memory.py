"""A worker's memory: giving back what a burst of connections left, and the ceiling
(`limits.memory`) past which it refuses new connections.

**Where a burst's memory stayed.** Measured on a real gateway (5,000 intercepted tunnels
open at once, then closed; docs/operations.md): 69 MiB idle, 410 MiB kept after they
closed. First, the closed connections themselves: each sat in reference cycles (its TLS
sessions pointed back at it) and waited for a full garbage collection, which a burst may
not trigger for minutes; those cycles are broken where the connections end
(`engines/h1/side.py`, `net/tls.py`, `net/resolver.py`). Then glibc's heap: OpenSSL's
per-connection buffers and the larger Python buffers are `malloc`ed, and freed chunks
between chunks still in use are not returned by themselves; `malloc_trim(0)` returns
those pages to the kernel (`MADV_DONTNEED`). What stayed then was pymalloc's, CPython's
small-object allocator: a 1 MiB arena is returned only when every object in it is gone,
and after 5,000 tunnels 34-43 of the burst's ~45 arenas stayed (measured:
`sys._debugmallocstats`, objects' addresses and tracemalloc tracebacks 5-60 s after the
burst), each pinned by a few of ~500 long-lived small objects the burst happened to
allocate there - no one owner: a metric's value, a counter, the timer and future of a
periodic loop, SQLite's list of weak references to its cursors, asyncio's free list of
future iterators, the upstream pool's idle connections. Taking out the largest groups
gave back 0-3 arenas: 1.65-1.72x idle after 5,000 tunnels, 1.3x after 2,000. So `run`
now starts its processes on jemalloc where it is installed (the image installs it;
`allocator.py`): every object from jemalloc, whose slabs are pages, not megabytes, and
which returns free pages itself within a second (`dirty_decay_ms`) and at once when
asked (`allocator.purge`, called here instead of `malloc_trim`): 5,000 tunnels leave
1.16-1.22x, with no difference in CPU per request from pymalloc that paired runs on a
busy 2-vCPU machine could resolve (docs/performance.md).
`PYTHONMALLOC=pymalloc` keeps CPython's allocator (docs/operations.md).

So this module, on the worker's event loop:

- every second reads the RSS (`/proc/self/statm`) and the open connections; once a
  burst has closed (the open connections fell by `BURST` and a quarter from their peak,
  and stopped falling), or the RSS grew `GROWTH` past what the last release left (at
  most once a minute), or the RSS is above the ceiling, it **releases**: a full garbage
  collection (what other code still leaves in cycles), the core's and engines'
  bookkeeping drops the tables a burst grew (`compact`), then the allocator returns its
  free pages (jemalloc's purge, or glibc's `malloc_trim(0)`; a no-op elsewhere). One
  release after 5,000 tunnels takes 40-90 ms of the loop (logged at debug);
- **the ceiling**: while the RSS is above `limits.memory`, new connections are refused
  `503 at_capacity` (the core's `Capacity` port: read on every accepted connection, the
  RSS re-read at most every `READ_EVERY`), `/readyz` answers 503, one WARNING line when it
  begins and one when it ends. Connections already open carry on: refusing new ones is
  what keeps the container's memory limit (and the OOM killer, which would end them
  all) away. `limits.memory: 85%` is a share of the container's memory limit (cgroup)
  split between the workers.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from gateway.observability import metrics
from gateway.runtime import allocator

__all__ = ["BURST", "GROWTH", "READ_EVERY", "MemoryGuard", "ceiling_for",
           "container_limit", "malloc_trim", "rss_bytes"]

log = logging.getLogger("sandbox_gateway")

READ_EVERY = 0.1  # seconds: how old the RSS reading the accept path uses may be
BURST = 100  # connections closed since the peak (and a quarter of it) that end a burst
GROWTH = 64 * 1024 * 1024  # RSS growth since the last release that releases anyway
_BURST_GAP = 5.0  # seconds between releases after bursts
_CEILING_GAP = 2.0  # ... while above the ceiling
_GROWTH_GAP = 60.0  # ... for slow growth
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(statm: Path = Path("/proc/self/statm")) -> int:
    """The process's resident set size in bytes (0 where /proc cannot tell)."""
    try:
        return int(statm.read_bytes().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def container_limit(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit in bytes (cgroup v2 `memory.max`, or v1's
    `memory.limit_in_bytes`), or None when it has none."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit() or int(text) >= 1 << 60:
            return None
        return int(text)
    return None


def ceiling_for(size: int, percent: float, workers: int,
                limit: Callable[[], int | None] = container_limit) -> tuple[int, str | None]:
    """The ceiling (bytes; 0: none) of one of `workers` worker processes for
    `limits.memory` given as `size` bytes or `percent` of the container's memory limit
    (shared equally by the workers), and a warning when the percentage has nothing to
    apply to."""
    if size:
        return size, None
    if not percent:
        return 0, None
    total = limit()
    if total is None:
        return 0, (f"limits.memory: {percent:g}% of the container's memory limit, but this "
                   "process has no memory limit (cgroup memory.max): no ceiling; give "
                   "limits.memory in bytes (e.g. 512MiB)")
    return int(total * percent / 100 / max(1, workers)), None


@functools.cache
def _libc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] | None = getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None
    return trim


def malloc_trim() -> bool:
    """Return the C heap's free pages to the kernel: jemalloc's purge when it is the
    allocator (`allocator.py`), else glibc's `malloc_trim(0)` (every arena); False where
    the C library has neither (musl, macOS)."""
    if allocator.purge():
        return True
    trim = _libc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def _mib(value: int) -> str:
    return f"{value / (1024 * 1024):.0f} MiB"


class MemoryGuard:
    """See the module docstring. `ceiling` 0: no ceiling (releases still run);
    `open_connections`: the worker's open client connections; `compact`: what drops the
    tables a burst grew, run before each release."""

    def __init__(self, ceiling: int, *, open_connections: Callable[[], int],
                 compact: Callable[[], None] = lambda: None,
                 rss: Callable[[], int] = rss_bytes, trim: Callable[[], bool] = malloc_trim,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ceiling = ceiling
        self.open_connections = open_connections
        self.compact = compact
        self._rss = rss
        self._trim = trim
        self.clock = clock
        self.rss = rss()
        self._next_read = clock() + READ_EVERY
        self.peak_open = 0  # the most connections open since the last release
        self.last_open = 0  # open connections at the last tick
        self.after_release = self.rss  # RSS right after the last release (or at start)
        self.last_release = -math.inf  # monotonic time of the last release
        self.releases = 0
        self._over = False  # above the ceiling at the last read (for the log lines)
        metrics.MEMORY_CEILING.set(ceiling)

    def _read(self, now: float) -> int:
        """Read the RSS; log a crossing of the ceiling whichever reader saw it first (a
        refusal may see it between two ticks, and memory may fall before the next)."""
        self.rss = self._rss()
        self._next_read = now + READ_EVERY
        over = bool(self.ceiling) and self.rss > self.ceiling
        if over and not self._over:
            log.warning("memory: %s is above limits.memory (%s): new connections are "
                        "refused 503 at_capacity until it is below", _mib(self.rss),
                        _mib(self.ceiling))
        elif self._over and not over:
            log.warning("memory: %s, below limits.memory (%s) again: new connections are "
                        "accepted", _mib(self.rss), _mib(self.ceiling))
        self._over = over
        return self.rss

    @property
    def refusing(self) -> str | None:
        """Why a new connection must be refused now (the RSS above the ceiling), or None."""
        if not self.ceiling:
            return None
        now = self.clock()
        if now >= self._next_read:
            self._read(now)
        if self.rss <= self.ceiling:
            return None
        return (f"this worker holds {_mib(self.rss)} of memory, above its ceiling "
                f"limits.memory ({_mib(self.ceiling)}); connections already open go on")

    def tick(self) -> str | None:
        """Once a second: release if a burst ended, the RSS grew, or it is above the
        ceiling; the metric and the ceiling's log lines. Returns why it released."""
        now = self.clock()
        rss = self._read(now)
        open_now = self.open_connections()
        self.peak_open = max(self.peak_open, open_now)
        since = now - self.last_release
        closed = self.peak_open - open_now
        settled = open_now >= self.last_open  # (no longer closing: the burst is over)
        self.last_open = open_now
        why = None
        if self._over and since >= _CEILING_GAP:
            why = "ceiling"
        elif closed >= max(BURST, self.peak_open // 4) and settled and since >= _BURST_GAP:
            why = "burst"
        elif rss - self.after_release >= GROWTH and closed > 0 and settled \
                and since >= _GROWTH_GAP:
            why = "growth"
        if why is not None:
            self.release(why, now, open_now)
        metrics.MEMORY_RSS.set(self.rss)
        return why

    def release(self, why: str, now: float, open_now: int) -> None:
        """Free what closed connections left in reference cycles, drop the tables a
        burst grew, and return the C heap's free pages."""
        before = self.rss
        started = time.perf_counter()
        gc.collect()
        self.compact()
        trimmed = self._trim()
        took = time.perf_counter() - started
        after = self._read(now)
        self.after_release = after
        self.last_release = now
        self.peak_open = open_now
        self.releases += 1
        metrics.MEMORY_RELEASES.labels(reason=why).inc()
        metrics.MEMORY_RELEASED.inc(max(0, before - after))
        log.debug("memory: released after a %s: RSS %s -> %s (%s) in %.1f ms", why,
                  _mib(before), _mib(after), "malloc_trim" if trimmed else "no malloc_trim",
                  took * 1000)

    async def run(self, interval: float = 1.0) -> None:
        """`tick` every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.tick()
            except Exception:  # a bug must not stop the guard
                log.exception("memory: the memory guard's tick failed")
