"""The SQLite state file itself: schema versions, modes, a corrupt file, a full disk (a
real tiny tmpfs), a process killed with SIGKILL in the middle of its transactions, and
the `state check` / `state backup` commands on a file a live process keeps writing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.clock import run
from helpers.disk import tiny_tmpfs

from gateway.services.state.base import SandboxAddress, StateUnavailable
from gateway.services.state.sqlite import SqliteState
from gateway.services.state.sqlite_tools import check_file

ROOT = Path(__file__).resolve().parents[3]
FAR = time.time() + 3600


def started(path: Path) -> SqliteState:
    state = SqliteState(path)
    run(state.start())
    return state


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    yield from tiny_tmpfs(tmp_path / "disk", "2m")


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 65536)
            out.flush()
    return filler


def test_a_registration_on_a_full_disk_is_refused_not_half_done(tiny_disk: Path) -> None:
    path = tiny_disk / "gateway.db"

    async def scenario() -> None:
        state = SqliteState(path)
        await state.start()
        try:
            filler = fill(tiny_disk)
            with pytest.raises(StateUnavailable, match="is not registered"):
                await state.register_sandbox(SandboxAddress("s1", "10.0.0.9", "agent"))
            assert state.sandbox_for("10.0.0.9") is None
            filler.unlink()
            await asyncio.sleep(1.3)  # a retry: nothing held for it
            assert state.sandbox_for("10.0.0.9") is None
        finally:
            await state.close()

    run(scenario())


KILLED = textwrap.dedent("""\
    import asyncio, sys, time
    from pathlib import Path
    from gateway.services.state.counters import Admission, Limit
    from gateway.services.state.sqlite import SqliteState
    async def main():
        s = SqliteState(Path(sys.argv[1]))
        await s.start()
        i = 0
        while True:
            i += 1
            s.admit(Admission((Limit((("b", "r"),), 10**9, 1),),
                              (("b", "r", 1, time.time() + 600),)))
            await s.revoke(f"j{i}", time.time() + 600)
            print(i, flush=True)  # (both committed)
    asyncio.run(main())
""")


def test_a_process_killed_mid_transaction_loses_nothing_committed(tmp_path: Path) -> None:
    path = tmp_path / "gateway.db"
    run(started(path).close())
    with subprocess.Popen([sys.executable, "-c", KILLED, str(path)], text=True,
                          stdout=subprocess.PIPE,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        assert proc.stdout is not None
        acknowledged = 0
        while acknowledged < 40:
            acknowledged = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        rest = proc.stdout.read().split()
    acknowledged = int(rest[-1]) if rest else acknowledged
    assert check_file(path) == []
    state = started(path)
    try:
        count = state.counter("b", "r")
        assert acknowledged <= count <= acknowledged + 1  # (+ one committed, not yet said)
        assert all(state.is_revoked(f"j{i}") for i in range(1, acknowledged + 1))
    finally:
        run(state.close())


def test_one_look_at_the_file_answers_every_kind_a_watcher_follows(tmp_path: Path) -> None:
    """A watcher asks for each kind it follows in turn, every 50 ms in every worker of
    an idle gateway: one `PRAGMA data_version` answers them all, and a change another
    process made is still seen within a few milliseconds."""
    async def scenario() -> None:
        one, two = SqliteState(tmp_path / "state.db"), SqliteState(tmp_path / "state.db")
        await one.start()
        await two.start()
        try:
            looks: list[str] = []
            assert two._conn is not None
            two._conn.set_trace_callback(looks.append)
            await asyncio.sleep(0.01)
            seen = [two.record_version(kind) for kind in ("grant", "approval", "pin")]
            assert sum("data_version" in sql for sql in looks) == 1
            assert await one.record_put("grant", "g", {"id": "g"}, time.time() + 60, None)
            started = time.monotonic()
            while two.record_version("grant") == seen[0]:
                assert time.monotonic() - started < 0.05
                await asyncio.sleep(0.001)
            assert [two.record_version(k) for k in ("approval", "pin")] == seen[1:]
        finally:
            await one.close()
            await two.close()

    run(scenario())
