"""Provider-minted secrets (ephemeral keys): found by value, forgotten at expiry, shared
between the worker processes of one host (the SQLite state file) and between replicas (a real
redis-server), and leak markers on every host their credential is not bound to."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.clock import Clock
from helpers.redis_server import RedisServer, running_redis

from gateway.core.markers import Markers
from gateway.core.secret_value import SecretValue
from gateway.net.resolver import new_event_loop
from gateway.services.policy import load_policy_texts
from gateway.services.secrets.ephemeral import EphemeralKey, EphemeralKeys
from gateway.services.state.base import MemoryState
from gateway.services.state.redis import RedisState
from gateway.services.state.sqlite import SqliteState

VALUE = "ek_68a4b1c2d3e4f5a6b7c8d9e0"


def key(value: str = VALUE, expires_at: float = 2e9, sandbox: str = "sb") -> EphemeralKey:
    return EphemeralKey("openai", sandbox, SecretValue(value), expires_at)


def test_found_by_value_until_it_expires() -> None:
    clock = Clock()
    clock.now = 1000.0
    keys = EphemeralKeys(clock)
    shared: list[EphemeralKey] = []
    keys.share = shared.append
    keys.add(key(expires_at=1060.0))
    assert keys.find(VALUE) is not None and keys.find("ek_other") is None
    assert [k.digest for k in shared] == [key().digest]  # shared once
    keys.add(key(expires_at=1060.0))
    assert len(shared) == 1 and len(keys.live()) == 1
    keys.add(key("ek_from_another_worker_00", 1060.0), shared=True)
    assert len(shared) == 1 and len(keys.live()) == 2  # (not shared back)
    version = keys.version
    clock.now = 1060.0
    assert keys.find(VALUE) is None and keys.live() == [] and keys.version > version
    keys.add(key(expires_at=1000.0))  # already expired: never kept
    assert keys.live() == []
    assert VALUE not in repr(key())  # the value never shows


def run(coro: object) -> None:
    asyncio.run(coro, loop_factory=new_event_loop)  # type: ignore[arg-type]


def test_workers_share_them_through_the_state_file(tmp_path: Path) -> None:
    async def scenario() -> None:
        one, two = SqliteState(tmp_path / "j"), SqliteState(tmp_path / "j")
        await one.start()
        await two.start()
        try:
            one.ephemeral.add(key())
            deadline = time.monotonic() + 3
            while two.ephemeral.find(VALUE) is None:
                assert time.monotonic() < deadline, "not shared"
                await asyncio.sleep(0.02)
            found = two.ephemeral.find(VALUE)
            assert found is not None and (found.credential, found.sandbox) == ("openai", "sb")
        finally:
            await one.close()
            await two.close()
        assert (tmp_path / "j").stat().st_mode & 0o077 == 0  # it holds secrets: 0600
        later = SqliteState(tmp_path / "j")  # a worker started later (a restart) reads it
        await later.start()
        try:
            assert later.ephemeral.find(VALUE) is not None
        finally:
            await later.close()

    run(scenario())


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path / "redis")


def test_replicas_share_them_through_redis(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        one = RedisState(redis_server.url, prefix="e", resync_interval=300.0)
        two = RedisState(redis_server.url, prefix="e", resync_interval=300.0)
        await one.start()
        await two.start()
        try:
            one.ephemeral.add(key())
            deadline = time.monotonic() + 3
            while two.ephemeral.find(VALUE) is None:  # pub/sub
                assert time.monotonic() < deadline, "not shared"
                await asyncio.sleep(0.02)
        finally:
            await one.close()
            await two.close()
        late = RedisState(redis_server.url, prefix="e")  # a replica started later: resync
        await late.start()
        try:
            assert late.ephemeral.find(VALUE) is not None
        finally:
            await late.close()

    run(scenario())


POLICY = """\
version: v1
name: agent
egress:
  - {host: api.openai.com, credential: openai, allow_minted_secrets: true}
  - {host: other.test}
credentials:
  openai: {preset: openai, secret: k}
"""


class _Secrets:
    def known_items(self) -> list[tuple[str, SecretValue]]:
        return []


def test_a_minted_secret_is_a_leak_marker_off_its_hosts() -> None:
    policies = load_policy_texts({"agent.yaml": POLICY})
    state = MemoryState()
    markers = Markers(lambda: policies, _Secrets(), state.ephemeral,  # type: ignore[arg-type]
                      lambda: "sandbox-gateway")
    body = b'{"client_secret": "' + VALUE.encode() + b'"}'
    assert markers.scan_for("other.test", None).find(body) is None  # not known yet
    state.ephemeral.add(key())
    assert markers.scan_for("other.test", None).find(body) == "secret"
    assert markers.scan_for("api.openai.com", None).find(body) is None  # its own host
