"""Minted values behind the secret cache: kept until shortly before they expire,
refreshed ahead, never served past expiry, one mint for concurrent requests, a fresh
mint after a rejection, counted per type; composite values' parts are leak markers."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.clock import Clock, run

from gateway.core.leak_forms import canonical
from gateway.core.policy.minted import MintSpec
from gateway.core.secret_value import MintedValue
from gateway.observability import metrics
from gateway.pipeline.markers import _markers_of
from gateway.services.minting import Credentials, MintContext, MintFailed, MintingStore
from gateway.services.minting.aws import key_set
from gateway.services.policy import load_policy_text
from gateway.services.secrets import SecretCache, SecretUnavailable, SecretValue

POLICY = """
version: v1
name: agent
egress:
  - host: api.example
    credential: internal
credentials:
  internal:
    type: oauth2-client-credentials
    token_url: https://login.example/token
    client_id: {client}
    client_secret: cs
    hosts: [api.example]
"""


class ScriptedMinter:
    """Mints `tok-1`, `tok-2`, …; fails while `error` is set."""

    def __init__(self, lifetime: float | None) -> None:
        self.lifetime = lifetime
        self.calls: list[bool] = []
        self.error: Exception | None = None
        self.closed = False

    async def mint(self, fresh: bool) -> MintedValue:
        self.calls.append(fresh)
        await asyncio.sleep(0.01)
        if self.error is not None:
            raise self.error
        return MintedValue(f"tok-{len(self.calls)}", lifetime=self.lifetime)

    async def close(self) -> None:
        self.closed = True


class Setup:
    def __init__(self, lifetime: float | None = 100.0, client: str = "c1") -> None:
        self.clock = Clock()
        self.policies = load_policy_text("p.yaml", POLICY.format(client=client))
        self.minters: list[ScriptedMinter] = []
        self.lifetime = lifetime

        def factory(spec: MintSpec, context: MintContext) -> ScriptedMinter:
            minter = ScriptedMinter(self.lifetime)
            self.minters.append(minter)
            return minter

        self.store = MintingStore(lambda: self.policies, MintContext(http=None,  # type: ignore[arg-type]
                                                                     secrets=None),  # type: ignore[arg-type]
                                  factory=factory)
        self.cache = SecretCache(self.store, ttl=300, refresh_ahead=60, stale_for=3600,
                                 clock=self.clock)
        stored = SecretCache(_Empty(), clock=self.clock)
        self.port = Credentials(stored, self.cache, self.store)

    @property
    def name(self) -> str:
        return self.policies.credentials["internal"].secret


class _Empty:
    name = "empty"

    async def fetch(self, secret_name: str) -> SecretValue:
        return SecretValue("stored-" + secret_name)

    async def close(self) -> None:
        return None


def _count(result: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "sandbox_gateway_credential_mints_total",
        {"type": "oauth2-client-credentials", "result": result})
    return value or 0.0


def test_kept_until_shortly_before_expiry_and_refreshed_ahead() -> None:
    s = Setup(lifetime=100.0)  # margin 10 s: used until 90, refreshed from 45

    async def go() -> None:
        assert (await s.port.get(s.name)).reveal() == "tok-1"
        s.clock.now += 44
        assert (await s.port.get(s.name)).reveal() == "tok-1"
        assert len(s.minters[0].calls) == 1
        s.clock.now += 2  # past the refresh point: served at once, refreshed behind
        assert (await s.port.get(s.name)).reveal() == "tok-1"
        await asyncio.sleep(0.05)
        assert len(s.minters[0].calls) == 2
        assert (await s.port.get(s.name)).reveal() == "tok-2"

    run(go())


def test_a_minted_value_is_never_served_past_its_expiry() -> None:
    s = Setup(lifetime=100.0)

    async def go() -> None:
        await s.port.get(s.name)
        s.minters[0].error = MintFailed("the token endpoint is down", transient=True)
        s.clock.now += 91  # expired for use: a refetch, which fails: still valid, stale
        assert (await s.port.get(s.name)).reveal() == "tok-1"
        s.clock.now += 5  # 96 s: inside the margin, the token itself may expire now
        with pytest.raises(SecretUnavailable) as info:
            await s.port.get(s.name)
        assert "the token endpoint is down" in info.value.reason

    run(go())


def test_a_value_without_expiry_uses_the_cache_ttl() -> None:
    s = Setup(lifetime=None)

    async def go() -> None:
        await s.port.get(s.name)
        s.clock.now += 299
        await s.port.get(s.name)
        await asyncio.sleep(0.05)  # refreshed ahead (from 240 s on)
        assert len(s.minters[0].calls) == 2

    run(go())


def test_one_mint_for_100_concurrent_gets() -> None:
    s = Setup()

    async def go() -> list[str]:
        values = await asyncio.gather(*(s.port.get(s.name) for _ in range(100)))
        return [v.reveal() for v in values]

    before = _count("ok")
    assert run(go()) == ["tok-1"] * 100
    assert len(s.minters) == 1 and s.minters[0].calls == [False]
    assert _count("ok") == before + 1


def test_a_rejected_value_is_minted_fresh_once() -> None:
    s = Setup()

    async def go() -> None:
        first = await s.port.get(s.name)
        s.port.invalidate(s.name, rejected=SecretValue("some-older-token"))
        assert (await s.port.get(s.name)).reveal() == "tok-1"  # not the cached one: ignored
        s.port.invalidate(s.name, rejected=first)
        assert (await s.port.get(s.name)).reveal() == "tok-2"
        assert s.minters[0].calls == [False, True]  # the re-mint bypassed library caches

    run(go())


def test_failures_are_counted_and_unexpected_errors_say_nothing_more() -> None:
    s = Setup()
    before = _count("error")

    async def go() -> str:
        s.cache.backoff_base = s.cache.backoff_max = 0.001
        s.minters.clear()
        s.lifetime = 100.0
        await s.port.get(s.name)  # builds the minter
        s.minters[0].error = RuntimeError("secret-looking detail sk-123")
        s.port.invalidate(s.name)
        s.clock.now += 1000
        with pytest.raises(SecretUnavailable) as info:
            await s.port.get(s.name)
        return info.value.reason

    reason = run(go())
    assert "RuntimeError" in reason and "sk-123" not in reason
    assert _count("error") == before + 1


def test_a_changed_policy_mints_anew_and_closes_the_old_minter() -> None:
    s = Setup()

    async def go() -> None:
        old = s.name
        assert (await s.port.get(old)).reveal() == "tok-1"
        s.policies = load_policy_text("p.yaml", POLICY.format(client="c2"))
        assert s.name != old
        assert (await s.port.get(s.name)).reveal() == "tok-1"  # a new minter's first
        assert len(s.minters) == 2 and s.minters[0].closed
        s.clock.now += 1000
        with pytest.raises(SecretUnavailable):  # the old spec is gone: never minted again
            await s.port.get(old)

    run(go())


def test_known_items_hold_both_caches() -> None:
    s = Setup()

    async def go() -> list[str]:
        await s.port.get(s.name)
        await s.port.get("plain-secret")
        return [n for n, _ in s.port.known_items()]

    assert sorted(run(go())) == sorted(["plain-secret", s.name])


def test_composite_values_mark_each_part() -> None:
    value = key_set("ASIAEXAMPLEKEYID0001", "secret/key+with=chars-000111",
                    "session-token-value-1234567890", 100.0)
    markers = _markers_of(value)
    for part in ("ASIAEXAMPLEKEYID0001", "secret/key+with=chars-000111",
                 "session-token-value-1234567890"):
        assert canonical(part.encode()) in markers
    assert canonical(value.reveal().encode()) not in markers
    assert json.loads(value.reveal())["session_token"] == "session-token-value-1234567890"
    redacted = {v for v in value.variants()}
    assert b"session-token-value-1234567890" in redacted and repr(value) == \
        "SecretValue('****')"
