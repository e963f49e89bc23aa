"""Shared counters in every state store: memory, the workers' journal (real files, real
concurrent processes), and a real redis-server shared by replicas."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from helpers.clock import Clock, run
from helpers.redis_server import RedisServer, running_redis

from gateway.counters import Increment, JournalCounters, MemoryCounters
from gateway.metering.budgets import BudgetBook
from gateway.metering.usage import Usage
from gateway.net.resolver import new_event_loop
from gateway.policy import load_policy_text
from gateway.state import JournalState, MemoryState
from gateway.state_redis import RedisState

ROOT = Path(__file__).resolve().parent.parent
FAR = time.time() + 86400


def inc(table: str, field: str, amount: int = 1, expires: float = FAR) -> Increment:
    return (table, field, amount, expires)


# --- memory -------------------------------------------------------------------------------


def test_memory_counters_expire() -> None:
    clock = Clock()
    counters = MemoryCounters(clock)
    counters.count([inc("a", "x", 2, 1100), inc("a", "x", 3, 1100), inc("b", "y", 1, 5000)])
    assert counters.counter("a", "x") == 5
    assert counters.counter("a", "missing") == 0
    assert run(counters.counter_tables(["a", "b", "c"])) == {"a": {"x": 5}, "b": {"y": 1}}
    clock.now = 1100
    assert counters.counter("a", "x") == 0  # the table's window is over
    assert run(counters.counter_tables(["a"])) == {}
    clock.now = 1200
    counters.count([inc("b", "y", 1, 5000)])  # prunes expired tables
    assert "a" not in counters.view.shared
    assert not counters.counters_degraded


def test_memory_state_counts() -> None:
    state = MemoryState()
    state.count([inc("t", "f", 7)])
    assert state.counter("t", "f") == 7
    assert not state.counters_degraded


# --- journal ------------------------------------------------------------------------------


def test_journal_shared_between_instances(tmp_path: Path) -> None:
    path = tmp_path / "state.journal.counters"
    a, b = JournalCounters(path), JournalCounters(path)
    a.start()
    b.start()
    a.count([inc("t", "x", 2)])
    assert a.counter("t", "x") == 2 and b.counter("t", "x") == 0  # pending, not shared yet
    a.sync()
    b.sync()
    assert a.counter("t", "x") == 2 and b.counter("t", "x") == 2
    b.count([inc("t", "x", 5), inc("t", "y", 1)])
    b.sync()
    a.sync()
    a.sync()  # reading again never re-applies anything
    for c in (a, b):
        assert (c.counter("t", "x"), c.counter("t", "y")) == (7, 1)
    # A third process starting later reads the whole history.
    c = JournalCounters(path)
    c.start()
    assert c.counter("t", "x") == 7
    assert run(c.counter_tables(["t"])) == {"t": {"x": 7, "y": 1}}
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_journal_compaction(tmp_path: Path) -> None:
    path = tmp_path / "c"
    clock = Clock()
    clock.now = time.time()
    a = JournalCounters(path, compact_bytes=2000, clock=clock)
    b = JournalCounters(path, compact_bytes=2000, clock=clock)
    a.start()
    b.start()
    b.count([inc("old", "x", 1, expires=clock.now + 10)])
    for i in range(200):
        writer = a if i % 2 else b
        writer.count([inc("t", f"f{i % 7}", i), inc("t", "all", 1)])
        writer.sync()
    a.sync()
    b.sync()
    assert path.stat().st_size < 4000  # compacted, repeatedly
    assert path.read_bytes().startswith(b'{"journal":')
    expected = {f"f{k}": sum(i for i in range(200) if i % 7 == k) for k in range(7)}
    expected["all"] = 200
    for c in (a, b):
        assert run(c.counter_tables(["t"])) == {"t": expected}
    # Expired tables are not carried into a compacted file.
    assert b'"old"' in path.read_bytes()
    clock.now += 20
    a.count([inc("t", "all", 1)])
    a.sync()
    a.count([inc(f"pad{i}", "x", 1) for i in range(60)])
    a.sync()
    assert b'"old"' not in path.read_bytes()
    d = JournalCounters(path)
    d.start()
    assert d.counter("t", "all") == 201


def test_journal_write_failure_keeps_counting_locally(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "c"
    a, b = JournalCounters(path), JournalCounters(path)
    a.start()
    b.start()
    path.unlink()
    path.mkdir()  # opening it for appending now fails
    a.count([inc("t", "x", 4)])
    a.sync()
    a.count([inc("t", "x", 1)])
    a.sync()
    assert a.counters_degraded and a.counter("t", "x") == 5
    assert sum("not writable" in r.message for r in caplog.records) == 1  # logged once
    path.rmdir()
    path.touch()
    a.sync()
    assert not a.counters_degraded
    b.sync()
    assert b.counter("t", "x") == 5 and a.counter("t", "x") == 5


WORKER = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from gateway.counters import JournalCounters
    path, index, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    c = JournalCounters(path, compact_bytes=3000)
    c.start()
    for i in range(rounds):
        c.count([("t", "n", 1, time.time() + 600),
                 ("t", f"w{index}", i, time.time() + 600)])
        c.sync()
""")


def test_journal_concurrent_processes(tmp_path: Path) -> None:
    """Four worker processes append and compact concurrently under flock: nothing lost,
    nothing counted twice."""
    path = tmp_path / "state.journal.counters"
    JournalCounters(path).start()
    rounds = 150
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(path), str(i), str(rounds)],
                              env=env) for i in range(4)]
    for p in procs:
        assert p.wait(60) == 0
    reader = JournalCounters(path)
    reader.start()
    table = run(reader.counter_tables(["t"]))["t"]
    assert table["n"] == 4 * rounds
    for i in range(4):
        assert table[f"w{i}"] == sum(range(rounds))
    assert path.read_bytes().startswith(b'{"journal":')  # compaction happened


def test_journal_state_counts_across_workers(tmp_path: Path) -> None:
    async def scenario() -> None:
        a = JournalState(tmp_path / "state.journal", interval=0.02)
        b = JournalState(tmp_path / "state.journal", interval=0.02)
        await a.start()
        await b.start()
        try:
            a.count([inc("t", "x", 3)])
            deadline = time.monotonic() + 2
            while b.counter("t", "x") != 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await a.revoke("jti-1", time.time() + 60)  # the revocation journal is separate
        finally:
            await a.close()
            await b.close()
        assert (tmp_path / "state.journal.counters").exists()
        assert b"jti-1" not in (tmp_path / "state.journal.counters").read_bytes()

    run(scenario())


# --- redis --------------------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path / "redis")


def run_loop(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario(), loop_factory=new_event_loop)  # type: ignore[arg-type]


def replica(server: RedisServer, interval: float = 3600.0) -> RedisState:
    """A replica whose counters flush only when told to (interval) unless given one."""
    return RedisState(server.url, prefix="t", backoff=(0.05, 0.3), resync_interval=300,
                      counter_interval=interval)


def test_redis_counters_shared_between_replicas(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        a, b = replica(redis_server), replica(redis_server)
        await a.start()
        await b.start()
        raw = aioredis.from_url(redis_server.url, decode_responses=True)
        try:
            expires = int(time.time()) + 1000
            a.count([inc("b:agent:daily:0", "t:sb", 100, expires)])
            assert a.counter("b:agent:daily:0", "t:sb") == 100  # pending counts locally
            assert b.counter("b:agent:daily:0", "t:sb") == 0    # b now watches it
            await a.flush_counters()
            assert await raw.hget("t:c:b:agent:daily:0", "t:sb") == "100"
            assert abs(await raw.expiretime("t:c:b:agent:daily:0") - expires) <= 1
            assert a.counter("b:agent:daily:0", "t:sb") == 100  # shared now, not pending
            await b.flush_counters()  # refreshes what b reads
            assert b.counter("b:agent:daily:0", "t:sb") == 100
            b.count([inc("b:agent:daily:0", "t:sb", 5, expires)])
            await b.flush_counters()
            assert b.counter("b:agent:daily:0", "t:sb") == 105
            await a.flush_counters()
            assert a.counter("b:agent:daily:0", "t:sb") == 105
            # Whole tables for the admin API: Redis plus this replica's pending counts.
            a.count([inc("b:agent:daily:0", "r:sb", 2, expires)])
            assert await b.counter_tables(["b:agent:daily:0", "nothing"]) == {
                "b:agent:daily:0": {"t:sb": 105}}
            assert await a.counter_tables(["b:agent:daily:0"]) == {
                "b:agent:daily:0": {"t:sb": 105, "r:sb": 2}}
        finally:
            await a.close()  # sends what is pending
            await b.close()
            assert await raw.hget("t:c:b:agent:daily:0", "r:sb") == "2"
            await raw.aclose()

    run_loop(scenario)


def test_redis_outage_counts_locally_then_catches_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()

    async def scenario() -> None:
        a = replica(server, interval=0.05)
        await a.start()
        try:
            a.count([inc("u:0", "f", 1)])
            await asyncio.sleep(0.2)
            server.stop()
            a.count([inc("u:0", "f", 10)])
            await asyncio.sleep(0.3)
            assert a.counters_degraded
            assert a.counter("u:0", "f") == 11  # served from the local view
            assert (await a.counter_tables(["u:0"]))["u:0"] == {"f": 11}
            server.start()
            deadline = time.monotonic() + 5
            while a.counters_degraded:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            raw = aioredis.from_url(server.url, decode_responses=True)
            try:
                # No persistence: Redis came back empty; what was pending was sent.
                assert await raw.hget("t:c:u:0", "f") == "10"
            finally:
                await raw.aclose()
        finally:
            await a.close()

    try:
        run_loop(scenario)
    finally:
        server.stop()
    messages = [r.message for r in caplog.records if "counters" in r.message]
    assert sum("unreachable" in m for m in messages) == 1  # logged once
    assert any("is back" in m for m in messages)


BUDGET = """\
version: v1
name: agent
egress:
  - {host: api.openai.com, credential: openai}
budgets:
  - {name: team, per: policy, window: 24h, requests: 10}
credentials:
  openai: {preset: openai, secret: k}
"""


def test_two_budget_books_share_one_budget(redis_server: RedisServer) -> None:
    """Two replicas (each a RedisState + BudgetBook) enforce one policy-wide budget: what
    one records, the other refuses on, within one in-flight request per replica."""
    policy = load_policy_text("p.yaml", BUDGET).policies["agent"]

    async def scenario() -> None:
        a, b = replica(redis_server, 0.05), replica(redis_server, 0.05)
        await a.start()
        await b.start()
        books = [BudgetBook(a), BudgetBook(b)]
        try:
            # Sequential: 6 on replica A, then B sees them and stops at exactly 10.
            for _ in range(6):
                assert books[0].check("sb-1", policy, "openai", time.time()) is None
                books[0].admitted("sb-1", policy, "openai", time.time())
                books[0].record("sb-1", policy, "openai", Usage("m", 1, 1), time.time())
            assert books[1].check("sb-2", policy, "openai", time.time()) is None
            await asyncio.sleep(0.2)  # two flush intervals
            admitted_b = 0
            while books[1].check("sb-2", policy, "openai", time.time()) is None:
                books[1].admitted("sb-2", policy, "openai", time.time())
                books[1].record("sb-2", policy, "openai", Usage("m", 1, 1), time.time())
                admitted_b += 1
                assert admitted_b <= 10
            assert admitted_b == 4
            await asyncio.sleep(0.2)
            refused = books[0].check("sb-1", policy, "openai", time.time())
            assert refused is not None and refused.used == 10
        finally:
            await a.close()
            await b.close()

    run_loop(scenario)


def test_two_replicas_concurrent_overshoot_is_bounded(redis_server: RedisServer) -> None:
    """Both replicas send requests concurrently, one in flight each (0.2 s; counted when
    admitted): the total admitted is at least the limit and at most the limit plus one
    per replica."""
    policy = load_policy_text("p.yaml", BUDGET).policies["agent"]

    async def scenario() -> None:
        stores = [replica(redis_server, 0.05) for _ in range(2)]
        for s in stores:
            await s.start()
        admitted = [0, 0]

        async def client(i: int) -> None:
            book = BudgetBook(stores[i])
            while book.check(f"sb-{i}", policy, "openai", time.time()) is None:
                admitted[i] += 1
                book.admitted(f"sb-{i}", policy, "openai", time.time())
                await asyncio.sleep(0.2)  # the request is in flight
                book.record(f"sb-{i}", policy, "openai", Usage("m", 1, 1), time.time())

        try:
            await asyncio.wait_for(asyncio.gather(client(0), client(1)), 30)
        finally:
            for s in stores:
                await s.close()
        assert 10 <= sum(admitted) <= 12, admitted
        assert min(admitted) >= 3  # both replicas served

        raw = aioredis.from_url(redis_server.url, decode_responses=True)
        try:
            keys = [k async for k in raw.scan_iter("t:c:b:agent:team:*")]
            assert len(keys) == 1
            assert int(await raw.hget(keys[0], "r:agent")) == sum(admitted)
        finally:
            await raw.aclose()

    run_loop(scenario)


def test_journal_file_is_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "c"
    a = JournalCounters(path)
    a.start()
    a.count([inc("t", "x", 3, 2000000000)])
    a.sync()
    line = json.loads(path.read_text().splitlines()[0])
    assert line == {"by": a.id, "t": {"t": [2000000000, {"x": 3}]}}
