"""One contract, every state store: each operation of `StateStore` (revocations,
registered sandboxes, provider-minted secrets, counters, budget admission) run against
the memory store, a real SQLite file and a real redis-server; and what only a shared
store can do (a second process or replica sees it; a restart keeps it) against the two
shared ones."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.redis_server import running_redis

from gateway.core.secret_value import MintedValue, SecretValue
from gateway.net.resolver import new_event_loop
from gateway.services.minting.shared import SharedMinter
from gateway.services.secrets.ephemeral import EphemeralKey
from gateway.services.state.base import MemoryState, SandboxAddress, SharedMint, StateStore
from gateway.services.state.counters import Admission, Limit
from gateway.services.state.log import LogEntry, LogQuery
from gateway.services.state.redis import RedisState
from gateway.services.state.sqlite import SqliteState

FAR = time.time() + 3600
Factory = Callable[[], StateStore]


@pytest.fixture(params=["memory", "sqlite", "redis"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Factory]]:
    """(kind, a factory of stores on one backend: two of them are two processes)."""
    if request.param == "memory":
        yield "memory", MemoryState
    elif request.param == "sqlite":
        yield "sqlite", lambda: SqliteState(tmp_path / "state" / "gateway.db")
    else:
        for server in running_redis(tmp_path / "redis"):
            yield "redis", functools.partial(RedisState, server.url, prefix="c",
                                             resync_interval=300, counter_interval=0.05)


@asynccontextmanager
async def opened(factory: Factory) -> AsyncIterator[Any]:
    store = factory()
    await store.start()
    try:
        yield store
    finally:
        await store.close()


def run(scenario: Callable[[], Any]) -> None:
    asyncio.run(scenario(), loop_factory=new_event_loop)  # type: ignore[arg-type]


async def eventually(check: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within the store's propagation time"
        await asyncio.sleep(0.02)


def test_revocations(stores: tuple[str, Factory]) -> None:
    async def scenario() -> None:
        async with opened(stores[1]) as store:
            assert not store.is_revoked("j1")
            await store.revoke("j1", time.time() + 60)
            await store.revoke("old", time.time() + 0.05)
            assert store.is_revoked("j1") and not store.is_revoked("j2")
            # Forgotten once the token has expired anyway (Redis: at the next whole second).
            await eventually(lambda: not store.is_revoked("old"))

    run(scenario)


def test_sandboxes(stores: tuple[str, Factory]) -> None:
    async def scenario() -> None:
        async with opened(stores[1]) as store:
            entry = SandboxAddress(sandbox="s1", ip="10.0.0.5", policy="agent")
            await store.register_sandbox(entry)
            assert store.sandbox_for("10.0.0.5") == entry
            assert store.sandboxes() == [entry]
            moved = SandboxAddress(sandbox="s2", ip="10.0.0.5", policy="other")
            await store.register_sandbox(moved)
            assert store.sandbox_for("10.0.0.5") == moved
            assert await store.unregister_sandbox("10.0.0.5") is True
            assert await store.unregister_sandbox("10.0.0.5") is False
            assert store.sandbox_for("10.0.0.5") is None

    run(scenario)


def test_counters_and_admission(stores: tuple[str, Factory]) -> None:
    async def scenario() -> None:
        async with opened(stores[1]) as store:
            store.count([("t", "x", 3, FAR), ("t", "y", 1, FAR)])
            store.count([("t", "x", 2, FAR)])
            assert store.counter("t", "x") == 5
            assert await store.counter_tables(["t", "none"]) == {"t": {"x": 5, "y": 1}}
            admission = Admission((Limit((("b", "r"),), 3, 1),), (("b", "r", 1, FAR),))
            results = [store.admit(admission) for _ in range(5)]
            assert results == [None, None, None, 0, 0]
            assert store.counter("b", "r") == 3
            assert not store.counters_degraded

    run(scenario)


def test_provider_minted_secrets(stores: tuple[str, Factory]) -> None:
    async def scenario() -> None:
        async with opened(stores[1]) as store:
            key = EphemeralKey("openai", "sb", SecretValue("ek_contract_0123456789"), FAR,
                               SecretValue("ek_alias_contract_0123"))
            store.ephemeral.add(key)
            found = store.ephemeral.by_alias("ek_alias_contract_0123")
            assert found is not None and found.sandbox == "sb"
            assert found.value.equals("ek_contract_0123456789")
            assert store.ephemeral.by_alias("ek_contract_0123456789") is None

    run(scenario)


def test_a_second_process_sees_every_change(stores: tuple[str, Factory]) -> None:
    kind, factory = stores
    if kind == "memory":
        pytest.skip("the memory store is one process's")

    async def scenario() -> None:
        async with opened(factory) as one, opened(factory) as two:
            await one.revoke("j1", time.time() + 60)
            entry = SandboxAddress(sandbox="s1", ip="10.0.0.9", policy="agent")
            await one.register_sandbox(entry)
            one.ephemeral.add(EphemeralKey("openai", "sb", SecretValue("ek_shared_0123456789"),
                                           FAR, SecretValue("ek_alias_shared_0123")))
            one.count([("t", "x", 7, FAR)])
            if kind == "sqlite":  # a change is everywhere before its call returns
                assert two.is_revoked("j1") and two.sandbox_for("10.0.0.9") == entry
            await eventually(lambda: two.is_revoked("j1"))
            await eventually(lambda: two.sandbox_for("10.0.0.9") == entry)
            await eventually(lambda: two.ephemeral.by_alias("ek_alias_shared_0123") is not None)
            await eventually(lambda: two.counter("t", "x") == 7)

    run(scenario)


def test_a_restart_keeps_everything(stores: tuple[str, Factory]) -> None:
    """Revocations, registrations, counters (budgets, usage) and minted secrets still
    there when the store is opened again (a gateway restart; Redis: the server kept
    running)."""
    kind, factory = stores
    if kind == "memory":
        pytest.skip("the memory store is lost on restart by design")

    async def scenario() -> None:
        async with opened(factory) as before:
            await before.revoke("j1", time.time() + 60)
            await before.register_sandbox(SandboxAddress("s1", "10.0.0.7", "agent"))
            before.count([("b", "t:sb", 9000, FAR)])
            before.ephemeral.add(EphemeralKey("openai", "sb",
                                              SecretValue("ek_restart_0123456789"), FAR,
                                              SecretValue("ek_alias_restart_0123")))
            await asyncio.sleep(0.2)  # (Redis: the counter batch and the secret's write)
        async with opened(factory) as after:
            assert after.is_revoked("j1")
            assert after.sandbox_for("10.0.0.7") is not None
            tables = await after.counter_tables(["b"])
            assert tables["b"]["t:sb"] == 9000
            await eventually(
                lambda: after.ephemeral.by_alias("ek_alias_restart_0123") is not None)

    run(scenario)


def test_admission_is_exact_across_processes_in_a_burst(stores: tuple[str, Factory]) -> None:
    """Two processes' stores (SQLite: two connections; Redis: two replicas) admitting
    in one burst against a 4-request limit, with counts pending on both: exactly four
    admitted (one transaction / one script each). (Across processes for real:
    tests/services/state/test_counters.py.)"""
    kind, factory = stores
    if kind == "memory":
        pytest.skip("the memory store is one process's")

    async def scenario() -> None:
        async with opened(factory) as one, opened(factory) as two:
            one.count([("b", "other", 5, FAR)])  # (pending: sent with the admission)
            admission = Admission((Limit((("b", "r"),), 4, 1),), (("b", "r", 1, FAR),))
            results = [store.admit(admission) for _ in range(5) for store in (one, two)]
            assert results.count(None) == 4
            assert one.counter("b", "r") == two.counter("b", "r") == 4
            assert (await two.counter_tables(["b"]))["b"] == {"r": 4, "other": 5}

    run(scenario)



def test_minted_credentials_and_their_lease(stores: tuple[str, Factory]) -> None:
    """The mint share: one holder of a credential's lease at a time (extended by the
    holder, free once it lapses or is given back), a value written and read back
    whole, a rotated refresh token kept."""
    async def scenario() -> None:
        async with opened(stores[1]) as store:
            assert await store.read_mint("minted:gh:abc") is None
            now = time.time()
            assert await store.lease_mint("minted:gh:abc", "p1", now + 5)
            assert not await store.lease_mint("minted:gh:abc", "p2", now + 5)
            assert await store.lease_mint("minted:gh:abc", "p1", now + 6)  # (extended)
            mint = SharedMint("ghs_contract_value", ("AKIA1", "secret/2"), now, now + 3600,
                              now + 3000)
            await store.write_mint("minted:gh:abc", mint, "p1")
            assert await store.read_mint("minted:gh:abc") == mint
            assert await store.lease_mint("minted:gh:abc", "p2", now + 5)  # (given back)
            await store.release_mint("minted:gh:abc", "p1")  # (not p1's: kept)
            assert not await store.lease_mint("minted:gh:abc", "p3", now + 5)
            await store.release_mint("minted:gh:abc", "p2")
            assert await store.lease_mint("minted:gh:abc", "p3", time.time() + 0.2)
            await asyncio.sleep(0.3)
            assert await store.lease_mint("minted:gh:abc", "p4", time.time() + 5)  # (lapsed)
            unknown = SharedMint("tok", (), now, None, now + 60)
            await store.write_mint("minted:x:1", unknown, "nobody")
            assert await store.read_mint("minted:x:1") == unknown
            assert await store.read_refresh("k") is None
            await store.write_refresh("k", "origin1", "rt-rotated-1")
            await store.write_refresh("k", "origin1", "rt-rotated-2")
            assert await store.read_refresh("k") == ("origin1", "rt-rotated-2")

    run(scenario)


def test_one_mint_for_two_processes(stores: tuple[str, Factory]) -> None:
    """Two processes' minters asking at once: one mint, the other takes its value; a
    value due for refresh is minted again (once); a rejected one is never taken."""
    kind, factory = stores
    if kind == "memory":
        pytest.skip("the memory store is one process's")

    async def scenario() -> None:
        async with opened(factory) as one, opened(factory) as two:
            mints: list[str] = []

            async def mint() -> MintedValue:
                mints.append("m")
                await asyncio.sleep(0.2)  # (a token endpoint's round trip)
                return MintedValue(f"tok-{len(mints)}-0123456789", lifetime=3600)

            due = {"after": 3000.0}
            a = SharedMinter(one, lambda lifetime: due["after"])
            b = SharedMinter(two, lambda lifetime: due["after"])
            got = await asyncio.gather(a.mint("minted:c:1", mint), b.mint("minted:c:1", mint),
                                       a.mint("minted:c:1", mint))
            assert len(mints) == 1 and len({v.reveal() for v in got}) == 1
            assert all(v.lifetime is not None and 3590 < v.lifetime <= 3600 for v in got)
            # Rejected upstream: b mints anew; a, rejecting the same value, takes b's.
            fresh = await b.mint("minted:c:1", mint, rejected=got[0])
            again = await a.mint("minted:c:1", mint, rejected=got[0])
            assert len(mints) == 2 and fresh == again and fresh != got[0]
            # A value past its due time (the cache that minted it refreshes it then) is
            # minted again by the next asker.
            due["after"] = 0.0
            await a.mint("minted:c:2", mint)
            await b.mint("minted:c:2", mint)
            assert len(mints) == 4

    run(scenario)


def test_records_are_shared_and_written_by_compare_and_set(
        stores: tuple[str, Factory]) -> None:
    """Ask mode's approvals and grants: a record another process sees, written once when
    new (the first of two racers wins), then only at the revision read; an expired record
    is gone (and may be written anew)."""
    kind, factory = stores

    async def scenario() -> None:
        async with opened(factory) as one, opened(factory) as two:
            now = time.time()
            assert await one.record_put("ask", "k", {"id": "a", "n": [1]}, now + 60, None)
            assert not await two.record_put("ask", "k", {"id": "b"}, now + 60, None)
            got = await two.record_get("ask", "k")
            assert got == ({"id": "a", "n": [1]}, 1)
            assert await two.record_put("ask", "k", {"id": "a", "state": "x"}, now + 60, 1)
            assert not await one.record_put("ask", "k", {"id": "a", "state": "y"}, now + 60, 1)
            assert await one.record_get("ask", "k") == ({"id": "a", "state": "x"}, 2)
            assert not await one.record_put("ask", "nothing", {}, now + 60, 1)
            assert await one.record_put("ask", "short", {"id": "s"}, now + 0.3, None)
            assert sorted(d["id"] for d in await two.record_list("ask")) == ["a", "s"]
            await asyncio.sleep(0.5)
            assert await two.record_get("ask", "short") is None
            assert [d["id"] for d in await one.record_list("ask")] == ["a"]
            assert await two.record_put("ask", "short", {"id": "s2"}, now + 60, None)
            assert await one.record_list("other") == []

    if kind == "memory":  # (one process: the same store twice)
        store = factory()
        factory = lambda: store  # noqa: E731
    run(scenario)


def test_a_record_written_anywhere_changes_its_kinds_version(
        stores: tuple[str, Factory]) -> None:
    """What the approvals' watcher asks every 50 ms: a write of a record of one kind, by
    this process or another, changes that kind's version (seen by the other within a
    tenth of a second), and no other kind's; a write refused by compare-and-set changes
    nothing."""
    kind, factory = stores

    async def scenario() -> None:
        async with opened(factory) as one, opened(factory) as two:
            now = time.time()
            grants, others = two.record_version("grant"), two.record_version("other")
            mine = one.record_version("grant")
            started = time.monotonic()
            assert await one.record_put("grant", "g", {"id": "g"}, now + 60, None)
            assert one.record_version("grant") != mine
            await eventually(lambda: two.record_version("grant") != grants, timeout=0.1)
            took = time.monotonic() - started
            assert took < 0.1, took
            assert two.record_version("other") == others
            seen = (one.record_version("grant"), two.record_version("grant"))
            assert not await two.record_put("grant", "g", {"id": "x"}, now + 60, None)
            await asyncio.sleep(0.05)
            assert (one.record_version("grant"), two.record_version("grant")) == seen
            assert await two.record_put("grant", "g", {"id": "y"}, now + 60, 1)
            await eventually(lambda: one.record_version("grant") != seen[0], timeout=0.1)

    if kind == "memory":  # (one process: the same store twice)
        store = factory()
        factory = lambda: store  # noqa: E731
    run(scenario)


def _entry(n: int, **fields: Any) -> LogEntry:
    values: dict[str, Any] = {"sandbox": f"sbx-{n % 3}", "policy": "agent",
                              "host": "api.openai.com" if n % 2 else "pypi.org",
                              "decision": "deny" if n % 5 == 0 else "allow",
                              "error": "policy_denied" if n % 5 == 0 else None,
                              "engine": "h1", **fields}
    values["n"] = n
    return LogEntry.of(values, 1_000_000.0 + n, json.dumps(values))


def test_request_log_is_shared_filtered_paged_and_bounded(
        stores: tuple[str, Factory]) -> None:
    """Every process's lines in one log, newest first, filtered by each field, paged by
    cursor, followed live (`after`), and bounded to `log_retain` lines."""
    kind, factory = stores

    async def scenario() -> None:
        async with opened(factory) as one, opened(factory) as two:
            if kind == "memory":
                two = one  # (one process: nothing to share)
            one.log_retain = two.log_retain = 40
            assert await one.log_last() == "0"
            await one.log_append([_entry(n) for n in range(1, 21)])
            await two.log_append([_entry(n) for n in range(21, 31)])
            newest = await one.log_read(LogQuery(), 5)
            assert [json.loads(e.line)["n"] for _, e in newest] == [30, 29, 28, 27, 26]
            assert await one.log_last() == newest[0][0]
            older = await two.log_read(LogQuery(), 3, before=newest[-1][0])
            assert [json.loads(e.line)["n"] for _, e in older] == [25, 24, 23]
            for query, wanted in [
                (LogQuery(decision="deny"), [30, 25, 20, 15, 10, 5]),
                (LogQuery(sandbox="sbx-1", decision="deny"), [25, 10]),
                (LogQuery(host="OPENAI"), [n for n in range(30, 0, -1) if n % 2]),
                (LogQuery(code="policy_denied", host="pypi"), [30, 20, 10]),
                (LogQuery(engine="mitmproxy"), []),
                (LogQuery(since=1_000_028.0), [30, 29, 28]),
                (LogQuery(until=1_000_002.0), [2, 1]),
            ]:
                found = await two.log_read(query, 100)
                assert [json.loads(e.line)["n"] for _, e in found] == wanted, query
            mark = await two.log_last()
            await one.log_append([_entry(31), _entry(35)])
            live = await two.log_read(LogQuery(), 10, after=mark)
            assert [json.loads(e.line)["n"] for _, e in live] == [31, 35]
            got = await two.log_get(live[0][0])
            assert got is not None and json.loads(got.line)["n"] == 31
            assert await two.log_get("999999") is None and await two.log_get("x") is None
            await one.log_append([_entry(n) for n in range(100, 160)])
            everything = await two.log_read(LogQuery(), 1000)
            assert json.loads(everything[0][1].line)["n"] == 159
            # Bounded: exactly for memory and SQLite; Redis trims near the bound.
            assert 40 <= len(everything) <= (40 if kind != "redis" else 160)

    run(scenario)


def test_request_log_bounded_in_bytes(stores: tuple[str, Factory]) -> None:
    """`console.retain: 50KiB`-like: a bound in bytes and none in lines keeps the newest
    lines that fit (SQLite by its pages, Redis by the entries' mean size, near)."""
    kind, factory = stores

    async def scenario() -> None:
        async with opened(factory) as store:
            store.log_retain, store.log_retain_bytes = 0, 50 * 1024
            for start in range(0, 400, 50):
                await store.log_append([_entry(n, path="/" + "x" * 900)
                                        for n in range(start, start + 50)])
            kept = await store.log_read(LogQuery(), 1000)
            assert json.loads(kept[0][1].line)["n"] == 399
            numbers = [json.loads(e.line)["n"] for _, e in kept]
            assert numbers == list(range(399, 399 - len(numbers), -1))
            assert 10 <= len(kept) <= (60 if kind != "redis" else 200), len(kept)

    run(scenario)
