"""The in-process state store and the `state` config section (every store's contract:
tests/services/state/test_state_contract.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.services.state.base import MemoryState, SandboxAddress
from gateway.services.state.factory import build_state
from gateway.services.state.redis import RedisState, redact_url


def test_memory_state_revocations_and_sandboxes() -> None:
    async def scenario() -> None:
        state = build_state({"store": "memory"})
        assert isinstance(state, MemoryState)
        await state.start()
        assert not state.is_revoked("j1")
        await state.revoke("j1", time.time() + 60)
        assert state.is_revoked("j1")
        assert not state.is_revoked("j2")

        entry = SandboxAddress(sandbox="s1", ip="10.0.0.5", policy="agent")
        await state.register_sandbox(entry)
        assert state.sandbox_for("10.0.0.5") == entry
        assert state.sandboxes() == [entry]
        assert await state.unregister_sandbox("10.0.0.5") is True
        assert await state.unregister_sandbox("10.0.0.5") is False
        assert state.sandbox_for("10.0.0.5") is None
        await state.close()

    asyncio.run(scenario())


def test_memory_state_forgets_expired_revocations() -> None:
    async def scenario() -> None:
        state = MemoryState()
        await state.revoke("old", time.time() - 1)
        await state.revoke("new", time.time() + 60)  # a later revoke prunes the old one
        assert not state.is_revoked("old")
        assert state.is_revoked("new")

    asyncio.run(scenario())


def test_build_state_sqlite_is_the_default(tmp_path: Path) -> None:
    from gateway.services.state.sqlite import SqliteState

    state = build_state({}, base=tmp_path)
    assert isinstance(state, SqliteState)
    assert state.path == tmp_path / "state" / "gateway.db"
    other = build_state({"store": "sqlite", "path": "/var/lib/x.db"})
    assert isinstance(other, SqliteState) and other.path == Path("/var/lib/x.db")
    assert state.volume_check == other.volume_check == 10.0
    quick = build_state({"store": "sqlite", "volume_check": "1s"}, base=tmp_path)
    assert isinstance(quick, SqliteState) and quick.volume_check == 1.0


def test_build_state_redis() -> None:
    state = build_state({"store": "redis", "url": "redis://127.0.0.1:1/0", "prefix": "gw1"})
    assert isinstance(state, RedisState)
    assert state.prefix == "gw1"
    assert state.channel == "gw1:events"
    assert build_state({"store": "memory"}).__class__ is MemoryState


@pytest.mark.parametrize(("config", "message"), [
    ({"store": "etcd"}, "state.store: 'etcd' is not a store; use sqlite, redis or memory"),
    ({"store": "sqlite", "path": ""}, "state.path: the SQLite file's path"),
    ({"store": "sqlite", "url": "x"}, "state.url: unknown key for store sqlite (known: path, "
                                      "store, unavailable, volume_check)"),
    ({"store": "sqlite", "volume_check": "500ms"}, "state.volume_check: from 1s to 1h, got "
                                                   "'500ms'"),
    ({"store": "sqlite", "volume_check": "2h"}, "state.volume_check: from 1s to 1h"),
    ({"store": "sqlite", "volume_check": "often"}, "state.volume_check: 'often' is not a "
                                                   "duration"),
    ({"store": "redis", "url": "redis://r", "volume_check": "1s"},
     "state.volume_check: unknown key for store redis"),
    ({"store": "redis"}, "state.url: required for store redis"),
    ({"store": "redis", "url": ""}, "state.url: required for store redis"),
    ({"store": "redis", "url": 6379}, "state.url: required for store redis"),
    ({"store": "memory", "urll": "x"}, "state.urll: unknown key for store memory (known: "
                                        "store, unavailable)"),
    ({"store": "sqlite", "unavailable": "open"}, "state.unavailable: 'open' is not serve"),
])
def test_build_state_errors(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_state(config)


def test_redact_url_hides_the_password() -> None:
    assert redact_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("rediss://user:s3cret@redis/1") == "rediss://user:***@redis/1"
    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
