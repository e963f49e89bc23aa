"""Reservations under a holder's lease (`gateway/services/state/leases.py`), on every
store: the memory store, a real SQLite file and a real redis-server.

A "process" here is a store opened with its own lease (SQLite: its own connection to
the file; Redis: its own clients; memory: the one store, a lease at a time); "killed"
is what SIGKILL leaves behind: nothing of the process's pending batch is written and
its lease is not given back (tests/integration/test_budget_durability.py kills real
gateway processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.disk import tiny_tmpfs
from helpers.redis_server import running_redis

from gateway.core.metering.pricing import Price, Pricing
from gateway.core.policy.compiled import Policy
from gateway.net.resolver import new_event_loop
from gateway.services.metering.budgets import BudgetBook, Hold, Reservation
from gateway.services.policy import load_policy_text
from gateway.services.state.base import MemoryState, StateStore
from gateway.services.state.lease_keeper import Lease
from gateway.services.state.leases import ORPHANS, Charged, held_field, parse_held
from gateway.services.state.memory_counters import MemoryCounters
from gateway.services.state.redis import RedisState
from gateway.services.state.sqlite import SqliteState

POLICY = """\
version: v1
name: agent
egress:
  - {host: api.openai.com, credential: openai}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 100000, cost_usd: 10}
credentials:
  openai: {preset: openai, secret: k1}
"""
PRICING = Pricing({"*": Price(1.0, 2.0, 0.5)})
RESERVE = Reservation(500, 3_000_000)  # the call's worst case: 500 tokens, $0.003
USED = (120, 1_000_000)  # what it used
LONG = 3600.0  # a beat that never comes by itself (the tests beat)


def agent() -> Policy:
    return load_policy_text("p.yaml", POLICY).policies["agent"]


def run(scenario: Callable[[], Any]) -> None:
    asyncio.run(scenario(), loop_factory=new_event_loop)  # type: ignore[arg-type]


@dataclass
class Backend:
    """Opens stores of one backend as processes would."""

    kind: str
    factory: Callable[[], StateStore]
    memory: MemoryState | None = None

    async def open(self, slot: str, ttl: float = 30.0) -> StateStore:
        """A process starting in `slot`: its store, started, with its lease."""
        if self.memory is not None:
            store: StateStore = self.memory
        else:
            store = self.factory()
            await store.start()
        await store.take_lease(slot, ttl=ttl, beat=LONG)
        return store

    async def kill(self, store: StateStore) -> None:
        """SIGKILL: the pending batch and settlements gone, the lease not given back."""
        counters = counters_of(store)
        counters.view.pending.clear()
        counters.view.settling.clear()
        lease = counters.lease
        assert lease is not None and lease._task is not None
        lease._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lease._task
        counters.lease = None
        if self.memory is None:
            await store.close()

    async def flush(self, store: StateStore) -> None:
        if isinstance(store, SqliteState):
            store.flush()
        elif isinstance(store, RedisState):
            await store.flush_counters()

    async def close(self, store: StateStore) -> None:
        if self.memory is None or counters_of(store).lease is not None:
            await store.close()


def counters_of(store: StateStore) -> Any:
    return store if isinstance(store, SqliteState) else store._counters  # type: ignore[attr-defined]


def lease_of(store: StateStore) -> Lease:
    lease = counters_of(store).lease
    assert isinstance(lease, Lease)
    return lease


@pytest.fixture(params=["memory", "sqlite", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "memory":
        yield Backend("memory", MemoryState, MemoryState())
    elif request.param == "sqlite":
        yield Backend("sqlite", lambda: SqliteState(tmp_path / "state" / "gateway.db"))
    else:
        for server in running_redis(tmp_path / "redis"):
            yield Backend("redis", functools.partial(
                RedisState, server.url, prefix="c", resync_interval=300,
                counter_interval=0.05))


async def budget(store: StateStore) -> tuple[dict[str, float], dict[str, float]]:
    """(used, reserved) of the daily budget for sandbox sb, as the admin API reads it."""
    found = await BudgetBook(store, PRICING).status(agent(), "sb", time.time())
    return ({k: found[0]["used"][k] for k in ("tokens", "cost_usd")},
            found[0]["reserved"])


def admit(store: StateStore) -> Hold:
    hold = BudgetBook(store, PRICING).admit("sb", agent(), "openai", time.time(), RESERVE)
    assert isinstance(hold, Hold) and hold.holder == store.holder is not None
    return hold


CHARGED = ({"tokens": 500, "cost_usd": 0.003}, {"tokens": 0, "cost_usd": 0.0})
SETTLED = ({"tokens": 120, "cost_usd": 0.001}, {"tokens": 0, "cost_usd": 0.0})


@pytest.mark.parametrize(("case", "after"), [
    ("running", CHARGED),  # killed while the call ran
    ("settled, not written", CHARGED),  # killed after its end, before the batch went out
    ("settled and written", SETTLED),
    ("running, stopped gracefully", CHARGED),  # (the drain ran out: given back, charged)
])
def test_what_a_process_leaves_is_charged_once(backend: Backend, case: str,
                                               after: tuple[dict[str, float],
                                                            dict[str, float]]) -> None:
    """A process admits a call (its reservation is in the store before the call would be
    forwarded), then ends as `case` says; the next process in its slot charges what
    was left, once: further processes and beats charge nothing more."""
    if backend.memory is not None and case.startswith("settled"):
        after = SETTLED  # (one process: nothing waits in a batch)

    async def scenario() -> None:
        first = await backend.open("host|proxy|0")
        hold = admit(first)
        if backend.kind != "memory":  # in the store already: another process reads it
            second = await backend.open("host|proxy|1")
            assert await budget(second) == ({"tokens": 0, "cost_usd": 0.0},
                                            {"tokens": 500, "cost_usd": 0.003})
            await backend.close(second)
        if case != "running" and not case.startswith("running,"):
            BudgetBook(first, PRICING).settle(hold, *USED)
        if case == "settled and written":
            await backend.flush(first)
        if case.endswith("gracefully"):
            await first.close()
        else:
            await backend.kill(first)
        restarted = await backend.open("host|proxy|0")  # the same slot: takes it over
        assert await budget(restarted) == after
        await lease_of(restarted).renew()
        again = await backend.open("host|proxy|0")  # (a restart of the restarted: no more)
        await lease_of(again).renew()
        assert await budget(again) == after
        await backend.close(again)
        if backend.memory is None:
            await backend.close(restarted)

    run(scenario)


def test_an_expired_lease_is_charged_by_a_live_process_and_its_late_settlement_dropped(
        backend: Backend) -> None:
    """A process that stops renewing (stalled, cut off from the store) for longer than
    its lease: another one charges its running call's reservation; when it comes back,
    the call's settlement is not counted on top, it takes a new lease, and what it
    admits then settles as usual."""
    async def scenario() -> None:
        stalled = await backend.open("host|proxy|a", ttl=0.3)
        hold = admit(stalled)
        old_holder = stalled.holder
        if backend.memory is not None:  # (one store: the other process is a lease on it)
            other = Lease(counters_of(stalled), "host|proxy|b", beat=LONG)
            assert await other.start()
        else:
            other_store = await backend.open("host|proxy|b")
            other = lease_of(other_store)
        await other.renew()
        assert (await budget(stalled))[1]["tokens"] == 500  # (not expired yet: kept)
        await asyncio.sleep(0.5)
        await other.renew()
        assert await budget(stalled) == CHARGED
        BudgetBook(stalled, PRICING).settle(hold, *USED)  # it comes back and settles
        await backend.flush(stalled)
        assert await budget(stalled) == CHARGED
        await lease_of(stalled).renew()  # its lease is gone: a new one
        assert stalled.holder not in (None, old_holder)
        later = admit(stalled)
        BudgetBook(stalled, PRICING).settle(later, *USED)
        await backend.flush(stalled)
        await other.renew()
        assert await budget(stalled) == ({"tokens": 620, "cost_usd": 0.004},
                                         {"tokens": 0, "cost_usd": 0.0})
        if backend.memory is not None:
            await other.stop()
        else:
            await backend.close(other_store)
        await backend.close(stalled)

    run(scenario)


def test_two_live_processes_charge_a_dead_one_once(backend: Backend) -> None:
    """Both notice the dead holder at the same beat: one transaction / script charges
    it, the other finds nothing left."""
    if backend.kind == "memory":
        pytest.skip("the memory store is one process's")

    async def scenario() -> None:
        dead = await backend.open("host|proxy|0", ttl=0.2)
        for _ in range(3):
            admit(dead)
        await backend.kill(dead)
        one, two = await backend.open("host|proxy|1"), await backend.open("host|proxy|2")
        await asyncio.sleep(0.4)
        await asyncio.gather(*(lease_of(s).renew() for _ in range(3) for s in (one, two)))
        assert await budget(one) == ({"tokens": 1500, "cost_usd": 0.009},
                                     {"tokens": 0, "cost_usd": 0.0})
        await backend.close(one)
        await backend.close(two)

    run(scenario)


FAR = time.time() + 86400
LIVE, DEAD = "host|p|live#1", "host|p|dead#2"


@pytest.mark.parametrize(("record", "charged", "kept"), [
    # (holder, reserved field, amount) -> charged to the settled field? record kept?
    ((LIVE, "rt:sb", 300), False, True),  # a running call of a live process
    ((LIVE, "rt:sb", 0), False, False),  # settled: the empty record goes
    ((DEAD, "rt:sb", 300), True, False),  # tokens of a dead one: charged as used
    ((DEAD, "rc:sb", 7000), True, False),  # and cost
    ((DEAD, "rt:sb", 0), False, False),
    ((DEAD, "rt:sb", -5), False, False),  # (never charged less than nothing)
    (("host|p|never#3", "rt:sb", 40), True, False),  # a holder with no lease at all
    ((DEAD, "rt:gone", 300), False, False),  # its window is over: nothing to charge
])
def test_what_a_beat_charges(backend: Backend, record: tuple[str, str, int], charged: bool,
                             kept: bool) -> None:
    async def scenario() -> None:
        store = await backend.open("host|p|me")
        counters = counters_of(store)
        assert await counters.lease_claim(LIVE, "host|p|live", 30.0, False)
        assert await counters.lease_claim(DEAD, "host|p|dead", -1.0, False)  # (expired)
        holder, field, amount = record
        window = time.time() + (-10 if field == "rt:gone" else 3600)
        store.count([("b", field, amount, window), ("b", "r:sb", 1, window),
                     (ORPHANS, held_field(holder, "b", field), amount, FAR)])
        await backend.flush(store)
        if backend.kind == "redis":
            await asyncio.sleep(0.2)  # (Redis expires the dead lease by its own clock)
        got = await counters.lease_reap(None)
        settled = "t:" + field[3:] if field.startswith("rt:") else "c:" + field[3:]
        table = (await store.counter_tables(["b"])).get("b", {})
        if charged:
            assert got == [Charged(holder, "b", field, amount)]
            assert (table.get(settled), table.get(field)) == (amount, 0)
        else:
            assert got == []
            assert table.get(settled) is None and table.get(field, 0) == (
                amount if field != "rt:gone" else 0)
        records = (await store.counter_tables([ORPHANS])).get(ORPHANS, {})
        assert {parse_held(k) for k in records} == (
            {(holder, "b", field)} if kept else set())
        if isinstance(counters, MemoryCounters):
            assert set(counters.leases) >= {LIVE} and DEAD not in counters.leases
        await backend.close(store)

    run(scenario)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    yield from tiny_tmpfs(tmp_path / "disk", "2m")


def test_an_outage_longer_than_the_lease_finds_no_live_process_dead(tiny_disk: Path) -> None:
    """The state file cannot be written (a full disk) for longer than the leases last:
    nobody could renew. When it can be again, each live process renews at its next beat
    and looks for dead holders only at the one after, so none of them is taken for
    dead: the running call settles to its use, not its reservation."""
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        one, two = SqliteState(path), SqliteState(path)
        for store in (one, two):
            await store.start()
            await store.take_lease(f"host|proxy|{store is two:d}", ttl=0.5, beat=LONG)
        hold = admit(one)
        filler = tiny_disk / "filler"
        with open(filler, "wb") as out, contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        one.count([("usage", f"f{i}", 1, FAR) for i in range(4000)])  # (the WAL's room)
        one.flush()
        assert one.problem is not None
        await asyncio.sleep(0.7)  # both leases expired in the file meanwhile
        await lease_of(two).renew()
        await lease_of(one).renew()
        filler.unlink()
        await lease_of(two).renew()  # renewed; not looking for the dead yet
        await lease_of(one).renew()
        await lease_of(two).renew()  # now: everyone had their beat
        BudgetBook(one, PRICING).settle(hold, *USED)
        one.flush()
        assert await budget(two) == SETTLED
        await one.close()
        await two.close()

    run(scenario)


def test_a_process_started_on_a_full_disk_serves_and_takes_its_lease_later(
        tiny_disk: Path) -> None:
    """A worker (re)started while the state file cannot be written starts all the same
    (revocations and the rest hold without the store: issue 46); it has no lease, so its
    reservations are counted but not recorded under one, and it claims the lease at the
    first beat after the disk has room, charging its slot's dead predecessor then."""
    path = tiny_disk / "state" / "gateway.db"

    async def scenario() -> None:
        before = SqliteState(path)
        await before.start()
        await before.take_lease("host|proxy|0", ttl=30, beat=LONG)
        admit(before)  # a call of the process that then dies in slot 0
        before.flush()
        filler = tiny_disk / "filler"
        with open(filler, "wb") as out, contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        after = SqliteState(path)
        await after.start()
        await after.take_lease("host|proxy|0", ttl=30, beat=LONG)  # does not raise
        assert after.holder is None
        filler.unlink()
        await lease_of(after).renew()  # claimed now, the predecessor's call charged
        assert after.holder is not None
        assert await budget(after) == CHARGED  # (the dead call's reservation, as used)
        await after.close()

    run(scenario)
