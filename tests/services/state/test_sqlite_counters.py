"""Counters in the SQLite state file (gateway/services/state/sqlite_counters.py): shared by
the processes of a host (real files, real concurrent processes), expiring with their
windows, and budget admission exact across processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers.clock import Clock, run

from gateway.services.state.counters import Admission, Increment, Limit
from gateway.services.state.sqlite import SqliteState

ROOT = Path(__file__).resolve().parents[3]


FAR = time.time() + 86400


def inc(table: str, field: str, amount: int = 1, expires: float = FAR) -> Increment:
    return (table, field, amount, expires)


def sqlite(path: Path) -> SqliteState:
    """A started store on `path` (outside a loop: its background task is not needed)."""
    async def start() -> SqliteState:
        state = SqliteState(path)
        await state.start()
        if state._task is not None:
            state._task.cancel()
        return state
    return asyncio.run(start())


def test_sqlite_shared_between_instances(tmp_path: Path) -> None:
    path = tmp_path / "state" / "gateway.db"
    a, b = sqlite(path), sqlite(path)
    a.count([inc("t", "x", 3), inc("t", "y", 1)])  # (no loop: written at once)
    assert b.counter("t", "x") == 3
    b.count([inc("t", "x", 2)])
    assert a.counter("t", "x") == 5
    assert run(a.counter_tables(["t", "none"])) == {"t": {"x": 5, "y": 1}}
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    c = sqlite(path)  # a process started later (a restart): the same counts
    assert c.counter("t", "x") == 5


def test_sqlite_counters_expire(tmp_path: Path) -> None:
    clock = Clock()
    clock.now = 1000.0
    state = SqliteState(tmp_path / "db", clock=clock)
    asyncio.run(state.start())
    state.count([inc("a", "x", 2, 1100), inc("b", "y", 1, 5000)])
    assert state.counter("a", "x") == 2
    clock.now = 1100
    assert state.counter("a", "x") == 0 and run(state.counter_tables(["a"])) == {}
    state._prune(clock.now)
    assert state.dump()["counters"] == 1


WORKER = textwrap.dedent("""\
    import asyncio, sys, time
    from pathlib import Path
    from gateway.services.state.counters import Admission, Limit
    from gateway.services.state.sqlite import SqliteState
    path, index, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    async def main():
        s = SqliteState(path)
        await s.start()
        time.sleep(max(0.0, float(sys.argv[4]) - time.time()))  # all start together
        admitted = 0
        for i in range(rounds):
            s.count([("t", "n", 1, time.time() + 600), ("t", f"w{index}", i, time.time() + 600)])
            s.flush()
            if s.admit(Admission((Limit((("b", "r"),), 100, 1),),
                                 (("b", "r", 1, time.time() + 600),))) is None:
                admitted += 1
            time.sleep(0.002)  # (requests arrive over time: the others get the lock too)
        await s.close()
        print(admitted)
    asyncio.run(main())
""")


def test_sqlite_concurrent_processes_lose_nothing_and_never_overshoot(tmp_path: Path) -> None:
    """Four worker processes count and admit at once: nothing lost or counted twice, and
    a 100-request limit admits exactly 100 across them (one transaction each)."""
    path = tmp_path / "gateway.db"
    sqlite(path)
    rounds = 150
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = str(time.time() + 2)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(path), str(i), str(rounds),
                               start], env=env, stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    admitted = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(admitted) == 100 and min(admitted) > 0  # every process took part
    reader = sqlite(path)
    table = run(reader.counter_tables(["t"]))["t"]
    assert table["n"] == 4 * rounds
    for i in range(4):
        assert table[f"w{i}"] == sum(range(rounds))
    assert reader.counter("b", "r") == 100


def test_sqlite_admission_checks_then_counts(tmp_path: Path) -> None:
    state = sqlite(tmp_path / "db")
    tokens = Limit((("b", "t"), ("b", "rt")), 1000, 400)
    admission = Admission((tokens,), (("b", "rt", 400, FAR),))
    assert state.admit(admission) is None and state.admit(admission) is None
    assert state.admit(admission) == 0  # 800 held + 400 > 1000
    assert state.counter("b", "rt") == 800
    state.count([("b", "rt", -400, FAR), ("b", "t", 50, FAR)])  # one settles: 450 used
    assert state.admit(admission) is None
