"""Console sessions (gateway/api/console/session.py) on every state store — memory, a real
SQLite file and a real redis-server — with two store instances as two processes: a
session made on one is live on the other, ending it on one ends it on both (the same
cookie replayed is refused), "everywhere" ends them all, a new admin token (console key)
knows none of them, and the store never holds a cookie."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.redis_server import running_redis

from gateway.api.console.session import KIND, LIFETIME, Sessions
from gateway.net.resolver import new_event_loop
from gateway.services.state.base import MemoryState, StateStore
from gateway.services.state.redis import RedisState
from gateway.services.state.sqlite import SqliteState

ADMIN = "session-test-admin-token-0123456789"
Factory = Callable[[], StateStore]


@pytest.fixture(params=["memory", "sqlite", "redis"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Factory]]:
    if request.param == "memory":
        shared = MemoryState()  # (one process: both "processes" are this one)
        yield "memory", lambda: shared
    elif request.param == "sqlite":
        yield "sqlite", lambda: SqliteState(tmp_path / "state" / "gateway.db")
    else:
        for server in running_redis(tmp_path / "redis"):
            yield "redis", functools.partial(RedisState, server.url, prefix="s",
                                             resync_interval=300, counter_interval=0.05)


def _run(factory: Factory, scenario: Callable[[StateStore, StateStore], Any]) -> None:
    async def main() -> None:
        one, two = factory(), factory()
        await one.start()
        if two is not one:
            await two.start()
        try:
            await scenario(one, two)
        finally:
            await one.close()
            if two is not one:
                await two.close()

    asyncio.run(main(), loop_factory=new_event_loop)  # type: ignore[arg-type]


def test_a_session_lives_and_ends_in_the_store(stores: tuple[str, Factory]) -> None:
    async def scenario(one: StateStore, two: StateStore) -> None:
        here, there = Sessions(ADMIN, one), Sessions(ADMIN, two)
        first, second = await here.new(), await here.new()
        nonce = await there.check(first)
        assert nonce is not None and nonce == await here.check(first)
        assert there.csrf_ok(nonce, here.csrf(nonce))
        assert await there.end(first) is True
        assert await here.check(first) is None and await there.check(first) is None
        assert await here.end(first) is False  # (ended once)
        assert await here.check(second) is not None
        third = await there.new()
        assert await here.end_all() == 2
        assert await there.check(second) is None and await here.check(third) is None
        # a new admin token: another console key, which knows no session of the old one
        fourth = await here.new()
        assert await Sessions("a-rotated-admin-token-9876543210", two).check(fourth) is None
        assert await there.check(fourth) is not None
        # the store keeps a hash of each session's id, never the cookie or the id
        docs = await one.record_list(KIND)
        assert docs and all(c.split(".")[0] not in str(d)
                            for d in docs for c in (first, second, third, fourth))

    _run(stores[1], scenario)


def test_a_session_expires(stores: tuple[str, Factory]) -> None:
    class Clock:
        now = time.time()

        def __call__(self) -> float:
            return self.now

    async def scenario(one: StateStore, two: StateStore) -> None:
        clock = Clock()
        sessions = Sessions(ADMIN, one, clock)
        cookie = await sessions.new()
        assert await sessions.check(cookie) is not None
        clock.now += LIFETIME + 1
        assert await sessions.check(cookie) is None

    _run(stores[1], scenario)
