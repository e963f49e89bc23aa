"""The memory guard's decisions (gateway/runtime/memory.py): when a worker gives memory
back, the ceiling that refuses new connections, and what `limits.memory` resolves to.
The real effect on a running gateway is measured in tests/reliability/test_memory_burst.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from gateway.runtime.memory import (
    BURST,
    GROWTH,
    READ_EVERY,
    MemoryGuard,
    ceiling_for,
    container_limit,
    malloc_trim,
    rss_bytes,
)

MIB = 1024 * 1024


class World:
    """A guard over a fake clock, RSS and connection count; records its releases."""

    def __init__(self, ceiling: int = 0, rss: int = 100 * MIB) -> None:
        self.now = 1000.0
        self.rss = rss
        self.open = 0
        self.trims = 0
        self.compacted = 0
        self.guard = MemoryGuard(ceiling, open_connections=lambda: self.open,
                                 compact=self._compact, rss=lambda: self.rss,
                                 trim=self._trim, clock=lambda: self.now)

    def _compact(self) -> None:
        self.compacted += 1

    def _trim(self) -> bool:
        self.trims += 1
        self.rss = 100 * MIB  # what a release gives back in this world
        return True

    def step(self, seconds: float = 1.0, *, open_: int | None = None,
             rss: int | None = None) -> str | None:
        self.now += seconds
        if open_ is not None:
            self.open = open_
        if rss is not None:
            self.rss = rss
        return self.guard.tick()


# (name, [(seconds, open connections, RSS MiB)...], the releases' reasons in order)
ROWS: list[tuple[str, list[tuple[float, int, int]], list[str | None]]] = [
    ("a burst opens and closes: one release once the closing is over",
     [(10, 2000, 300), (1, 2000, 300), (1, 900, 250), (1, 0, 220), (1, 0, 220)],
     [None, None, None, None, "burst"]),
    ("still closing: no release until the count stops falling",
     [(10, 2000, 300), (1, 1500, 280), (1, 1000, 260), (1, 500, 240), (1, 500, 240)],
     [None, None, None, None, "burst"]),
    ("fewer than BURST connections closed: no release",
     [(10, BURST - 1, 120), (1, 0, 120), (1, 0, 120)], [None, None, None]),
    ("a quarter of the peak must close: 1000 -> 800 is churn, not a burst's end",
     [(10, 1000, 150), (1, 800, 150), (1, 800, 150)], [None, None, None]),
    ("releases after bursts are at least 5 s apart",
     [(10, 400, 150), (1, 0, 150), (1, 0, 150), (1, 400, 150), (1, 0, 150), (1, 0, 150),
      (3, 0, 150)],
     [None, None, "burst", None, None, None, "burst"]),
    ("slow growth with connections closing: a release once a minute at most",
     [(1, 10, 100 + GROWTH // MIB), (1, 5, 100 + GROWTH // MIB), (1, 5, 100 + GROWTH // MIB),
      (30, 6, 200), (1, 5, 200), (1, 5, 200), (60, 5, 200)],
     [None, None, "growth", None, None, None, "growth"]),
    ("growth while connections only open: none (a release would free little)",
     [(61, 10, 300), (1, 20, 400), (1, 30, 500)], [None, None, None]),
]


@pytest.mark.parametrize(("name", "steps", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_when_a_worker_releases_memory(name: str, steps: list[tuple[float, int, int]],
                                       expected: list[str | None]) -> None:
    w = World()
    got = [w.step(seconds, open_=open_, rss=rss * MIB) for seconds, open_, rss in steps]
    assert got == expected, name
    assert w.trims == w.compacted == sum(1 for why in expected if why)


def test_above_the_ceiling_new_connections_are_refused_until_below(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "sandbox_gateway")
    w = World(ceiling=200 * MIB, rss=150 * MIB)
    assert w.guard.refusing is None
    w.rss = 250 * MIB
    assert w.guard.refusing is None  # (the reading is at most READ_EVERY old)
    w.now += READ_EVERY
    reason = w.guard.refusing
    assert reason is not None and "250 MiB" in reason and "limits.memory (200 MiB)" in reason
    w.guard._trim = lambda: True  # a release that frees nothing: still above
    assert w.step(open_=10) == "ceiling"
    assert w.guard.refusing is not None
    assert [r.message for r in caplog.records if "memory:" in r.message] == [
        "memory: 250 MiB is above limits.memory (200 MiB): new connections are refused "
        "503 at_capacity until it is below"]
    assert w.step(open_=10) is None  # (at most every 2 s while above)
    w.rss = 190 * MIB  # connections closed
    assert w.step(open_=5) is None
    assert w.guard.refusing is None
    assert caplog.records[-1].message == ("memory: 190 MiB, below limits.memory (200 MiB) "
                                          "again: new connections are accepted")


def test_a_release_can_end_the_refusing() -> None:
    w = World(ceiling=200 * MIB, rss=260 * MIB)
    w.now += READ_EVERY
    assert w.guard.refusing is not None
    assert w.step(open_=3) == "ceiling"  # the trim brought it to 100 MiB
    assert w.guard.refusing is None


def test_no_ceiling_never_refuses() -> None:
    w = World(ceiling=0, rss=10_000 * MIB)
    w.now += 1
    assert w.guard.refusing is None


# (size, percent, workers, the container's limit, ceiling, warns)
CEILINGS = [
    (512 * MIB, 0.0, 4, 1024 * MIB, 512 * MIB, False),  # bytes: each worker's, as given
    (0, 85.0, 1, 1000 * MIB, 850 * MIB, False),
    (0, 85.0, 2, 1000 * MIB, 425 * MIB, False),  # shared by the workers
    (0, 85.0, 1, None, 0, True),  # no container limit: none, and a warning
    (0, 0.0, 1, 1000 * MIB, 0, False),
]


@pytest.mark.parametrize(("size", "percent", "workers", "limit", "ceiling", "warns"), CEILINGS)
def test_limits_memory_resolves_per_worker(size: int, percent: float, workers: int,
                                           limit: int | None, ceiling: int,
                                           warns: bool) -> None:
    got, warning = ceiling_for(size, percent, workers, lambda: limit)
    assert got == ceiling
    assert (warning is not None) == warns


@pytest.mark.parametrize(("files", "limit"), [
    ({"memory.max": "1073741824\n"}, 1073741824),
    ({"memory.max": "max\n"}, None),
    ({"memory/memory.limit_in_bytes": "536870912\n"}, 536870912),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1's "none"
    ({}, None),
])
def test_the_container_limit_from_cgroup_files(tmp_path: Path, files: dict[str, str],
                                               limit: int | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert container_limit(tmp_path) == limit


def test_the_real_readings() -> None:
    rss = rss_bytes()
    assert 10 * MIB < rss < 4096 * MIB
    assert malloc_trim() is True  # glibc (the image and CI)
    assert rss_bytes(Path("/nonexistent/statm")) == 0
