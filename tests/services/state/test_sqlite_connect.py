"""Opening the store's files (gateway/services/state/sqlite_connect.py): processes creating
the file together all start (WAL set-up retried within the busy timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers.clock import run

from gateway.services.state.sqlite import SqliteState

ROOT = Path(__file__).resolve().parents[3]


def started(path: Path) -> SqliteState:
    state = SqliteState(path)
    run(state.start())
    return state


OPENER = textwrap.dedent("""\
    import asyncio, sys, time
    from pathlib import Path
    from gateway.services.state.sqlite import SqliteState
    async def main():
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all at once
        s = SqliteState(Path(sys.argv[1]))
        await s.start()
        await s.revoke(sys.argv[3], time.time() + 600)
        await s.close()
    asyncio.run(main())
""")


def test_processes_creating_the_file_together_all_start(tmp_path: Path) -> None:
    """Workers started at once on a file that does not exist yet (WAL set-up takes an
    exclusive lock that SQLite does not wait for): every one starts, nothing lost."""
    path = tmp_path / "new" / "gateway.db"
    at = str(time.time() + 1.5)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(path), at, f"j{i}"],
                              env=env, stderr=subprocess.PIPE, text=True) for i in range(6)]
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, errors
    state = started(path)
    assert all(state.is_revoked(f"j{i}") for i in range(6))
    run(state.close())
