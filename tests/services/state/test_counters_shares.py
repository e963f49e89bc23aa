"""Each process's share of a budget held in Redis (`state.unavailable: serve`,
`gateway.services.state.alone_records`): when one replica's link to Redis stalls and
the other's does not, the stalled one decides on its share of the room it last read,
and the other, answered, leaves that share alone, since Redis held it from before the
link stalled (measured before, 2026-11-30: the answered one spent the room Redis
showed, 13 requests of a budget of 10). A share is at most what its process admitted
lately, and goes when its process stops, restarts in its slot or stops admitting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as syncredis
from helpers.pausable_relay import PausableRelay
from helpers.redis_server import RedisServer, running_redis
from helpers.sqlite_states import leased_states
from services.state.test_counters import (
    BUDGET,
    leased_replicas,
    run_loop,
    team_requests_once_back,
)

from gateway.core.metering.refusals import BudgetExceeded, MeteringRefusal
from gateway.services.metering.budgets import BudgetBook, Hold
from gateway.services.policy import load_policy_text
from gateway.services.state.alone_records import Record, held_for_others, key_of
from gateway.services.state.counters import Admission, Limit
from gateway.services.state.counters_redis_write import SCRIPT, Shares, Write, WriteCall
from gateway.services.state.redis import RedisState


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path / "redis")


@pytest.fixture
def relay(redis_server: RedisServer) -> Iterator[PausableRelay]:
    found = PausableRelay(("127.0.0.1", redis_server.port))
    yield found
    found.close()


def test_one_replica_stalled_the_other_answered_stay_within_the_budget(
        redis_server: RedisServer, relay: PausableRelay) -> None:
    """A policy-wide budget of 10 requests, 5 used (4 through A, 1 through B). A's link
    stalls: A admits its share of the room its records hold (3 of the 6 its last one
    left, its last reading 4); B, answered, admits what A's share leaves (2). Once A's
    link is back, Redis holds 10 of 10."""
    policy = load_policy_text("p.yaml", BUDGET).policies["agent"]
    urls = [f"redis://127.0.0.1:{relay.port}", redis_server.url]

    async def scenario() -> None:
        async with leased_replicas(urls) as stores:
            books = [BudgetBook(s) for s in stores]
            for i in (0, 0, 0, 0, 1):
                assert isinstance(books[i].admit(f"sb-{i}", policy, "openai",
                                                 time.time()), Hold)
            admitted = [0, 0]
            relay.pause()
            for _ in range(8):
                if isinstance(books[0].admit("sb-0", policy, "openai", time.time()), Hold):
                    admitted[0] += 1
            assert stores[0].counters_degraded
            refusals = []
            for _ in range(8):
                found = books[1].admit("sb-1", policy, "openai", time.time())
                if isinstance(found, Hold):
                    admitted[1] += 1
                else:
                    refusals.append(found)
            relay.resume()
            assert admitted == [3, 2]
            assert isinstance(refusals[0], BudgetExceeded) and refusals[0].others == 3
            assert ("7 requests used and 3 requests held as other gateway processes' "
                    "shares") in refusals[0].reason
            total = await team_requests_once_back(redis_server, stores)
            assert total <= 10, f"{total} requests of a budget of 10"

    run_loop(scenario)


def test_a_process_that_admitted_nothing_on_a_budget_holds_no_share_of_it(
        redis_server: RedisServer, relay: PausableRelay) -> None:
    """B spends the whole budget while A, live, admitted nothing on it; A, its link
    stalled, may not spend a share it never held: 503 state_unavailable, saying so."""
    policy = load_policy_text("p.yaml", BUDGET).policies["agent"]
    urls = [f"redis://127.0.0.1:{relay.port}", redis_server.url]

    async def scenario() -> None:
        async with leased_replicas(urls) as stores:
            books = [BudgetBook(s) for s in stores]
            found = [books[1].admit("sb-1", policy, "openai", time.time())
                     for _ in range(11)]
            assert [isinstance(f, Hold) for f in found] == [True] * 10 + [False]
            assert isinstance(found[-1], BudgetExceeded) and found[-1].others == 0
            relay.pause()
            away = books[0].admit("sb-0", policy, "openai", time.time())
            relay.resume()
            assert isinstance(away, MeteringRefusal) and away.status == 503
            assert "holds no share of the budget it may spend alone" in away.reason
            assert await team_requests_once_back(redis_server, stores) == 10

    run_loop(scenario)


@pytest.mark.parametrize("how", ["closed", "restarted in its slot"])
def test_a_share_goes_with_its_process(redis_server: RedisServer, how: str) -> None:
    """A admitted 4 of a budget of 10 lately: B may admit 3 (A's share, 3 of the 6 left,
    stays whole); once A stops, or a process starts in A's slot (A died), B may admit
    the 3 left."""
    policy = load_policy_text("p.yaml", BUDGET).policies["agent"]

    async def scenario() -> None:
        async with leased_replicas([redis_server.url] * 2) as stores:
            books = [BudgetBook(s) for s in stores]
            for _ in range(4):
                assert isinstance(books[0].admit("sb-0", policy, "openai", time.time()),
                                  Hold)
            await stores[0].flush_counters()  # (A's record of what it last read)
            found = [books[1].admit("sb-1", policy, "openai", time.time()) for _ in range(4)]
            assert [isinstance(f, Hold) for f in found] == [True] * 3 + [False]
            assert isinstance(found[-1], BudgetExceeded) and found[-1].others == 3
            after: RedisState | None = None
            if how == "closed":
                await stores[0].close()
            else:
                after = RedisState(redis_server.url, prefix="t", backoff=(0.05, 0.3),
                                   resync_interval=300, counter_interval=3600)
                await after.start()
                await after.take_lease("slot-0", beat=0.1)
            try:
                found = [books[1].admit("sb-1", policy, "openai", time.time())
                         for _ in range(4)]
                assert [isinstance(f, Hold) for f in found] == [True] * 3 + [False]
            finally:
                if after is not None:
                    await after.close()
            assert await team_requests_once_back(redis_server, stores[1:]) == 10

    run_loop(scenario)


TABLE = "b:agent:team:0"
RECORDS = "t:a:" + key_of(TABLE, "r:x")  # (the records of the limit over r:x)


def record(serial: int, values: dict[str, int], processes: int = 2,
           demand: dict[str, int] | None = None) -> Record:
    return Record(serial, tuple(sorted(values.items())), processes,
                  tuple(sorted((demand if demand is not None else {"r:x": 10}).items())))


def run_write(client: syncredis.Redis, serial: int, admission: Admission | None = None,
              records: tuple[tuple[str, Record, float], ...] = (),
              holder: str = "me#1") -> list[Any]:
    """One write of the counters' script, as a replica sends it."""
    call = WriteCall("t:c:", "t:lease:", Write(f"t:write:x:{serial}", (), (),
                                               admission.increments if admission else ()),
                     (), (), Shares("t:a:", holder, "t:a-of:slot", records))
    return list(client.eval(SCRIPT, *call.build(admission, {})))


def test_a_record_written_late_never_replaces_a_newer_one(redis_server: RedisServer) -> None:
    """The store keeps the record of the highest serial: a write whose answer was lost,
    run after a later one, does not bring back the older record."""
    client = syncredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        key = key_of(TABLE, "r:x")
        run_write(client, 5, records=((key, record(5, {"r:x": 7}), 0.0),))
        run_write(client, 3, records=((key, record(3, {"r:x": 2}), 0.0),))
        assert json.loads(client.hget(RECORDS, "me#1") or "")["v"] == {"r:x": 7}
        run_write(client, 6, records=((key, record(6, {"r:x": 1}), 0.0),))
        assert json.loads(client.hget(RECORDS, "me#1") or "")["v"] == {"r:x": 1}
        assert client.smembers("t:a-of:slot") == {"me#1\x1f" + RECORDS}
    finally:
        client.close()


# (the others' records, ceiling 10, 4 used, a call of 4: refused?, the shares counted)
@pytest.mark.parametrize(("others", "refused", "held"), [
    ({}, False, 0),
    ({"b#1": record(1, {"r:x": 4})}, True, 3),  # (10 - 4) / 2
    ({"b#1": record(1, {"r:x": 4}, demand={"r:x": 1})}, False, 0),  # its demand: 1
    ({"b#1": record(1, {"r:x": 4}, demand={})}, False, 0),  # admitted nothing lately
    ({"b#1": record(1, {"other": 4})}, False, 0),  # it cannot decide alone on r:x
    ({"me#1": record(1, {"r:x": 0}, processes=1)}, False, 0),  # the writer's own
    ({"b#1": record(1, {"r:x": 12})}, False, 0),  # its reading above the ceiling
    ({"b#1": record(1, {"r:x": 4}), "c#1": record(1, {"r:x": 4})}, True, 6),  # 3 + 3
    ({"b#1": record(1, {"r:x": 8}), "c#1": record(1, {"r:x": 8})}, False, 0),  # 1 + 1
    ({"b#1": record(1, {"r:x": 0}, processes=3)}, True, 3),  # 10 / 3
])
def test_an_admission_leaves_the_other_holders_shares(
        redis_server: RedisServer, others: dict[str, Record], refused: bool,
        held: int) -> None:
    client = syncredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        client.hset("t:c:" + TABLE, "r:x", 4)
        for holder, found in others.items():
            client.hset(RECORDS, holder, found.encode())
        admission = Admission((Limit(((TABLE, "r:x"),), 10, 4),),
                              ((TABLE, "r:x", 4, 0.0),))
        reply = run_write(client, 1, admission)
        assert (int(reply[0]) == 1, int(reply[1])) == (refused, held)
        assert int(client.hget("t:c:" + TABLE, "r:x") or 0) == (4 if refused else 8)
    finally:
        client.close()


@pytest.mark.parametrize(("text", "held"), [
    ('{"s":1,', 10),  # not JSON
    ("[]", 10),
    ('{"s":1,"n":"2","v":{},"d":{}}', 10),  # a count as a string
    ('{"s":1,"n":2,"v":{"r:x":"a"},"d":{"r:x":5}}', 0),  # a value not a number: no share
    ('{"s":1,"n":2,"v":{"r:x":"4"},"d":{"r:x":5}}', 3),  # (a number in a string is one)
])
def test_a_record_that_cannot_be_read_holds_the_ceiling(redis_server: RedisServer,
                                                        text: str, held: int) -> None:
    """Redis and SQLite read a record the same way; one neither can read (a bug, an
    edit by hand) may be a share: the limit counts its whole ceiling as held."""
    client = syncredis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        client.hset(RECORDS, "b#1", text)
        admission = Admission((Limit(((TABLE, "r:x"),), 10, 8),), ((TABLE, "r:x", 8, 0.0),))
        reply = run_write(client, 1, admission)
        assert held_for_others([("b#1", text)], "me#1", ["r:x"], 10) == held
        assert (int(reply[0]), int(reply[1])) == ((1, held) if held > 2 else (0, 0))
    finally:
        client.close()


def test_a_replica_writes_its_record_again_right_after_an_admission(
        redis_server: RedisServer) -> None:
    """The record an admission carries holds what its process read before it; the
    answer's values follow in a write of their own right away (not within the batch
    interval, an hour here): the others hold no more of the room than it may spend."""
    policy = load_policy_text("p.yaml", BUDGET).policies["agent"]

    async def scenario() -> None:
        async with leased_replicas([redis_server.url] * 2) as stores:
            book = BudgetBook(stores[0])
            raw = syncredis.Redis.from_url(redis_server.url, decode_responses=True)
            try:
                for _ in range(3):
                    assert isinstance(book.admit("sb-0", policy, "openai", time.time()),
                                      Hold)
                deadline = time.monotonic() + 5
                while True:
                    found = [json.loads(v) for k in raw.keys("t:a:*")
                             for v in raw.hgetall(k).values()]
                    if found and found[0]["v"] == {"r:agent": 3}:
                        break
                    assert time.monotonic() < deadline, found
                    await asyncio.sleep(0.01)
                assert found[0]["d"] == {"r:agent": 3} and found[0]["n"] == 2
            finally:
                raw.close()

    run_loop(scenario)


def test_sqlite_one_process_cut_off_the_other_answered_stay_within_the_budget(
        tmp_path: Path) -> None:
    """Two processes on one state file; A's writes fail (its connection read-only, as
    a lock held past `busy_timeout`) while B's do not. A decides on its share (2: of the
    5 left as it reads, at most what it admitted lately), B on what A's share leaves (2):
    9 of a budget of 10. (Before: B spent the 5 the file showed, 12.)"""
    path = tmp_path / "state.db"
    limit = Admission((Limit((("b", "r"),), 10, 1),), (("b", "r", 1, time.time() + 3600),))

    async def scenario() -> None:
        async with leased_states(path) as states:
            assert [states[i].admit(limit) for i in (0, 0, 0, 0, 1)] == [None] * 5
            writable = states[0]._conn
            states[0]._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True,
                                              isolation_level=None)
            admitted = [sum(s.admit(limit) is None for _ in range(8)) for s in states]
            assert admitted == [2, 2]
            assert states[0].counters_degraded and not states[1].counters_degraded
            states[0]._conn.close()
            states[0]._conn = writable
            states[0].flush()
            assert not states[0].counters_degraded
            assert states[1].counter("b", "r") == 9

    asyncio.run(scenario())


def test_sqlite_a_record_follows_the_other_processes_writes(tmp_path: Path) -> None:
    """An idle process's record is written again when another process writes the file
    (inotify; every second without it): the others hold no more of the room than its
    share of what is left now (A admitted 1; after B's 2, A's record reads 3)."""
    path = tmp_path / "state.db"
    limit = Admission((Limit((("b", "r"),), 10, 1),), (("b", "r", 1, time.time() + 3600),))

    async def scenario() -> None:
        async with leased_states(path, beat=3600) as states:
            assert [states[i].admit(limit) for i in (0, 1, 1)] == [None] * 3
            deadline = time.monotonic() + 0.9  # (within the one-second fallback)
            while True:
                with contextlib.closing(sqlite3.connect(path)) as raw:
                    rows = dict(raw.execute("SELECT holder, record FROM shares WHERE tbl = ?",
                                            (key_of("b", "r"),)).fetchall())
                mine = json.loads(rows[states[0].holder or ""])
                if mine["v"] == {"r": 3}:
                    break
                assert time.monotonic() < deadline, rows
                await asyncio.sleep(0.01)
            assert mine["d"] == {"r": 1} and mine["n"] == 2
        with contextlib.closing(sqlite3.connect(path)) as raw:  # (stopped: their shares go)
            assert raw.execute("SELECT count(*) FROM shares").fetchone() == (0,)

    asyncio.run(scenario())


def test_a_share_outlives_the_lease_of_a_replica_cut_off_longer(
        redis_server: RedisServer, relay: PausableRelay) -> None:
    """A's link stalls longer than its lease lasts (1 s): its lease dies, and with it
    what it reserved is charged, but its share stays held while it decides alone; once
    back it takes a new lease, writes what it admitted alone and deletes the old
    holder's share in the same write. The budget holds throughout, and no share of the
    dead holder is left."""
    policy = load_policy_text("p.yaml", BUDGET).policies["agent"]
    urls = [f"redis://127.0.0.1:{relay.port}", redis_server.url]

    async def scenario() -> None:
        async with leased_replicas(urls, ttl=1.0, interval=0.25) as stores:
            books = [BudgetBook(s) for s in stores]
            for i in (0, 0, 0, 0, 1):
                assert isinstance(books[i].admit(f"sb-{i}", policy, "openai",
                                                 time.time()), Hold)
            await asyncio.sleep(0.6)  # (each wrote its record of what it last read)
            old = stores[0].holder
            relay.pause()
            admitted = [0, 0]
            for _ in range(8):
                if isinstance(books[0].admit("sb-0", policy, "openai", time.time()), Hold):
                    admitted[0] += 1
            await asyncio.sleep(2.0)  # (A's lease expires in Redis)
            for _ in range(8):
                if isinstance(books[1].admit("sb-1", policy, "openai", time.time()), Hold):
                    admitted[1] += 1
            relay.resume()
            deadline = time.monotonic() + 10
            while stores[0].holder == old or stores[0].counters_degraded:
                assert time.monotonic() < deadline, (stores[0].holder, old)
                await asyncio.sleep(0.05)
            assert admitted[0] > 0 and sum(admitted) <= 5, admitted
            assert await team_requests_once_back(redis_server, stores) <= 10
            raw = syncredis.Redis.from_url(redis_server.url, decode_responses=True)
            try:
                deadline = time.monotonic() + 5
                while any(old in raw.hkeys(k) for k in raw.keys("t:a:*")
                          if raw.type(k) == "hash"):
                    assert time.monotonic() < deadline, "the dead holder's share stayed"
                    await asyncio.sleep(0.05)
            finally:
                raw.close()

    run_loop(scenario)
