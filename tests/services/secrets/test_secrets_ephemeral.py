"""Provider-minted secrets (ephemeral keys) and their aliases: found by the alias (never
by the secret), forgotten at expiry, shared between the worker processes of one host (the
SQLite state file, also across a restart and from a file written before aliases) and
between replicas (a real redis-server); the secret a leak marker on every host its
credential is not bound to, the alias on every host."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.clock import Clock
from helpers.redis_server import RedisServer, running_redis

from gateway.core.secret_value import SecretValue
from gateway.net.resolver import new_event_loop
from gateway.pipeline.markers import Markers
from gateway.services.policy import load_policy_texts
from gateway.services.secrets.ephemeral import EphemeralKey, EphemeralKeys
from gateway.services.state.base import MemoryState
from gateway.services.state.redis import RedisState
from gateway.services.state.sqlite import SqliteState

VALUE = "ek_68a4b1c2d3e4f5a6b7c8d9e0"
ALIAS = "ek_0f1e2d3c4b5a69788796a5b4"


def key(value: str = VALUE, expires_at: float = 2e9, sandbox: str = "sb",
        alias: str | None = ALIAS) -> EphemeralKey:
    return EphemeralKey("openai", sandbox, SecretValue(value), expires_at,
                        SecretValue(alias) if alias is not None else None)


def test_found_by_alias_until_it_expires() -> None:
    clock = Clock()
    clock.now = 1000.0
    keys = EphemeralKeys(clock)
    shared: list[EphemeralKey] = []
    keys.share = shared.append
    keys.add(key(expires_at=1060.0))
    found = keys.by_alias(ALIAS)
    assert found is not None and found.value.equals(VALUE)
    assert keys.by_alias(VALUE) is None  # the secret itself finds nothing
    assert keys.by_alias("ek_other") is None and keys.by_alias(ALIAS[:-1]) is None
    assert [k.digest for k in shared] == [key().digest]  # shared once
    keys.add(key(expires_at=1060.0))
    assert len(shared) == 1 and len(keys.live()) == 1
    keys.add(key("ek_from_another_worker_00", 1060.0, alias="ek_another_alias_000"),
             shared=True)
    assert len(shared) == 1 and len(keys.live()) == 2  # (not shared back)
    version = keys.version
    clock.now = 1060.0
    assert keys.by_alias(ALIAS) is None and keys.live() == [] and keys.version > version
    keys.add(key(expires_at=1000.0))  # already expired: never kept
    assert keys.live() == []
    assert VALUE not in repr(key()) and ALIAS not in repr(key())  # neither value shows


def test_an_entry_without_alias_is_a_marker_only() -> None:
    """A secret written by a gateway from before aliases (relayed in clear then): kept
    until it expires (a leak marker), never found by anything the sandbox sends."""
    keys = EphemeralKeys()
    keys.add(key(alias=None))
    assert len(keys.live()) == 1
    assert keys.by_alias(VALUE) is None and keys.by_alias(ALIAS) is None


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
            while two.ephemeral.by_alias(ALIAS) is None:
                assert time.monotonic() < deadline, "not shared"
                await asyncio.sleep(0.02)
            found = two.ephemeral.by_alias(ALIAS)
            assert found is not None and (found.credential, found.sandbox) == ("openai", "sb")
            assert found.value.equals(VALUE)
        finally:
            await one.close()
            await two.close()
        assert (tmp_path / "j").stat().st_mode & 0o077 == 0  # it holds secrets: 0600
        later = SqliteState(tmp_path / "j")  # a worker started later (a restart) reads it
        await later.start()
        try:
            assert later.ephemeral.by_alias(ALIAS) is not None
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
            while two.ephemeral.by_alias(ALIAS) is None:  # pub/sub
                assert time.monotonic() < deadline, "not shared"
                await asyncio.sleep(0.02)
        finally:
            await one.close()
            await two.close()
        late = RedisState(redis_server.url, prefix="e")  # a replica started later: resync
        await late.start()
        try:
            assert late.ephemeral.by_alias(ALIAS) is not None
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


def test_a_minted_secret_is_a_leak_marker_off_its_hosts_and_its_alias_everywhere() -> None:
    """The secret off its credential's hosts (the sandbox never holds it); the alias on
    every host, its own included, like a token: its one place is the carrier, which the
    gateway empties before it scans. Encoded, split over fields, the same."""
    policies = load_policy_texts({"agent.yaml": POLICY})
    state = MemoryState()
    markers = Markers(lambda: policies, _Secrets(), state.ephemeral,  # type: ignore[arg-type]
                      lambda: "sandbox-gateway")
    secret = b'{"client_secret": "' + VALUE.encode() + b'"}'
    alias = b'{"client_secret": "' + ALIAS.encode() + b'"}'
    encoded = b'{"s": "' + base64.b64encode(ALIAS.encode()) + b'"}'
    assert markers.scan_for("other.test", None).find(secret) is None  # not known yet
    assert markers.scan_for("other.test", None).find(alias) is None
    state.ephemeral.add(key())
    for host in ("other.test", "api.openai.com"):
        assert markers.scan_for(host, None).find(alias) == "secret", host
        assert markers.scan_for(host, None).find(encoded) == "secret", host
    assert markers.scan_for("other.test", None).find(secret) == "secret"
    assert markers.scan_for("api.openai.com", None).find(secret) is None  # its own host
    split = [(b"x-a", ALIAS[:12].encode()), (b"x-b", ALIAS[12:].encode())]
    assert markers.scan_for("other.test", None).head("GET", "/", split) == "secret"
