"""MCP OAuth records in a real state store (memory and SQLite): secrets sealed at rest,
readable fields kept readable, a flow taken exactly once, listing without secrets."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from gateway.services.mcp_oauth.grants import FLOW, GRANT, Grants
from gateway.services.mcp_oauth.seal import Sealer, ensure_key
from gateway.services.state.base import MemoryState, Records, StateStore
from gateway.services.state.sqlite import SqliteState

Body = Callable[[Records], Awaitable[None]]


@pytest.fixture(params=["memory", "sqlite"])
def each(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[Body], None]:
    """Runs a test body over a started store of the kind, closed after."""
    def run(body: Body) -> None:
        async def go() -> None:
            store: StateStore = MemoryState() if request.param == "memory" else \
                SqliteState(tmp_path / "state.db")
            await store.start()
            try:
                await body(store)
            finally:
                await store.close()
        asyncio.run(go())
    return run


def test_a_grant_is_sealed_at_rest_and_read_back(each: Callable[[Body], None],
                                                  tmp_path: Path) -> None:
    async def run(store: Records) -> None:
        grants = Grants(store, Sealer(ensure_key(tmp_path / "key")))
        doc = {"id": "og_1", "owner": "sandbox:a", "scopes": ["mcp"]}
        assert await grants.put(GRANT, "sandbox:a|https://m/mcp", doc,
                                {"access": "AT-secret", "refresh": "RT-secret"},
                                time.time() + 60, None)
        raw = await store.record_list(GRANT)
        assert "AT-secret" not in json.dumps(raw) and "RT-secret" not in json.dumps(raw)
        found = await grants.get(GRANT, "sandbox:a|https://m/mcp")
        assert found is not None and found.doc == doc
        assert found.secret == {"access": "AT-secret", "refresh": "RT-secret"}
        assert await grants.grants() == [doc]
        # sealed for its own record: another key or record does not open it
        moved = await store.record_get(GRANT, "sandbox:a|https://m/mcp")
        assert moved is not None
        await store.record_put(GRANT, "sandbox:b|https://m/mcp", moved[0], time.time() + 60,
                               None)
        stolen = await grants.get(GRANT, "sandbox:b|https://m/mcp")
        assert stolen is not None and stolen.secret is None
        other = Grants(store, Sealer(ensure_key(tmp_path / "other")))
        found = await other.get(GRANT, "sandbox:a|https://m/mcp")
        assert found is not None and found.secret is None
    each(run)


def test_a_flow_is_taken_exactly_once(each: Callable[[Body], None], tmp_path: Path) -> None:
    async def run(store: Records) -> None:
        grants = Grants(store, Sealer(ensure_key(tmp_path / "key")))
        await grants.put(FLOW, "state-1", {"key": "k"}, {"verifier": "v"},
                         time.time() + 60, None)
        taken = await asyncio.gather(*(grants.take(FLOW, "state-1", time.time())
                                       for _ in range(8)))
        got = [t for t in taken if t is not None]
        assert len(got) == 1 and got[0].secret == {"verifier": "v"}
        assert await grants.get(FLOW, "state-1") is None
        assert await grants.take(FLOW, "never", time.time()) is None
        await grants.put(FLOW, "old", {"key": "k"}, {"verifier": "v"}, time.time() - 1, None)
        assert await grants.take(FLOW, "old", time.time()) is None  # (expired: gone)
    each(run)
