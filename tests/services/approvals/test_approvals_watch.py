"""The record watcher (services/approvals/watch.py) on a real SQLite state file: a record
another process writes is followed within a few hundredths of a second (inotify, not a
50 ms poll), an idle watcher looks at the file about twice a second instead of twenty
times, and where inotify is not available it polls every 50 ms as before. (Every worker
of `run --workers 2` following a grant: tests/integration/test_approvals.py.)"""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.services.approvals import watch
from gateway.services.approvals.watch import QUIET, RecordWatcher
from gateway.services.state import sqlite_records
from gateway.services.state.sqlite import SqliteState

WRITES = 5
WRITER = textwrap.dedent("""\
    import asyncio, sys, time
    from pathlib import Path
    from gateway.services.state.sqlite import SqliteState

    async def main() -> None:
        store = SqliteState(Path(sys.argv[1]))
        await store.start()
        print("ready", flush=True)
        n = 0
        while sys.stdin.readline().strip() == "write":
            n += 1
            await store.record_put("grant", f"g{n}", {"n": n}, time.time() + 60, None)
            print(time.monotonic(), flush=True)
        await store.close()

    asyncio.run(main())
""")


async def _watching(path: Path, *, idle: float) -> tuple[int, list[float]]:
    """Watch `path` for `idle` seconds, then have another process write a grant, five
    times at random moments: how many looks the idle watcher took, and how long after
    each write it was followed."""
    store = SqliteState(path)
    await store.start()
    followed: list[float] = []
    watcher = RecordWatcher(store, {"grant": lambda: followed.append(time.monotonic())})
    looks = 0
    check = watcher.check

    async def counting() -> bool:
        nonlocal looks
        looks += 1
        return await check()

    watcher.check = counting  # type: ignore[method-assign]
    with subprocess.Popen([sys.executable, "-c", WRITER, str(path)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as writer:
        try:
            return await _write_and_follow(writer, watcher, followed, idle, lambda: looks)
        finally:
            writer.kill()
            await watcher.stop()
            await store.close()


async def _write_and_follow(writer: subprocess.Popen[str], watcher: RecordWatcher,
                            followed: list[float], idle: float,
                            looks: Callable[[], int]) -> tuple[int, list[float]]:
    assert writer.stdout is not None and writer.stdin is not None
    assert writer.stdout.readline() == "ready\n"
    watcher.start()
    await asyncio.sleep(idle)
    idle_looks = looks()
    took = []
    for n in range(WRITES):
        await asyncio.sleep(random.uniform(0.05, QUIET))  # (anywhere in a quiet look's cycle)
        writer.stdin.write("write\n")
        writer.stdin.flush()
        written = float(writer.stdout.readline())
        for _ in range(400):
            if len(followed) > n:
                break
            await asyncio.sleep(0.005)
        took.append(followed[n] - written if len(followed) > n else math.inf)
    writer.stdin.write("end\n")
    writer.stdin.flush()
    assert writer.wait(10) == 0
    return idle_looks, took


def test_another_processs_writes_are_followed_at_once_and_idle_costs_two_looks_a_second(
        tmp_path: Path) -> None:
    looks, took = asyncio.run(_watching(tmp_path / "state.db", idle=1.5))
    assert max(took) < 0.1, took  # (each heard, not found by the next quiet look)
    assert looks <= 1.5 / QUIET + 2, looks  # (a 50 ms poll: 30)


def test_without_inotify_the_watcher_polls_every_50_ms(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_records.FileChanges, "open", classmethod(lambda cls, path: None))
    looks, took = asyncio.run(_watching(tmp_path / "state.db", idle=1.0))
    assert max(took) < 0.2, took
    assert looks >= 1.0 / watch.WATCH / 2, looks
