"""The real azure-keyvault-secrets SDK and WorkloadIdentityCredential against a local fake over TLS.

The vault URLs look real (``https://kv<random>.vault.azure.net``) so the SDK's
challenge-resource verification runs as in production; `LoopbackResolver`
sends those names, and ``login.microsoftonline.com``, to the fake on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from fakes.keyvault import FakeKeyVault, StaticCredential, sdk_transport
from helpers.clock import Clock, run

from gateway.observability import metrics
from gateway.services.secrets import (
    AzureKeyVaultStore,
    SecretCache,
    SecretNotFound,
    SecretStoreError,
    SecretUnavailable,
)

NAME = "openai-api-key"
VALUE = "sk-kv-value-5e4d3c2b1a"



@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKeyVault]:
    kv = FakeKeyVault(tmp_path)
    # What the AKS workload identity webhook injects into the pod.
    monkeypatch.setenv("AZURE_TENANT_ID", kv.tenant_id)
    monkeypatch.setenv("AZURE_CLIENT_ID", kv.client_id)
    monkeypatch.setenv("AZURE_FEDERATED_TOKEN_FILE", str(kv.token_file))
    monkeypatch.setenv("AZURE_AUTHORITY_HOST", "https://login.microsoftonline.com")
    with kv:
        kv.set_secret(NAME, VALUE)
        yield kv


@asynccontextmanager
async def workload_store(fake: FakeKeyVault, **kwargs: Any) -> AsyncIterator[AzureKeyVaultStore]:
    """The store as production builds it: credential "workload", only the transport overridden."""
    async with sdk_transport(fake) as transport:
        store = AzureKeyVaultStore(
            fake.vault_url(), credential="workload", transport=transport, **kwargs
        )
        try:
            yield store
        finally:
            await store.close()


@asynccontextmanager
async def static_store(fake: FakeKeyVault, **kwargs: Any) -> AsyncIterator[AzureKeyVaultStore]:
    async with sdk_transport(fake) as transport:
        store = AzureKeyVaultStore(
            fake.vault_url(),
            transport=transport,
            credential_obj=StaticCredential(fake.issue_static_token()),
            **kwargs,
        )
        try:
            yield store
        finally:
            await store.close()


def test_fetch_with_real_workload_identity_credential(fake: FakeKeyVault) -> None:
    async def main() -> None:
        async with workload_store(fake) as store:
            value = await store.fetch(NAME)
            assert value.reveal() == VALUE
            assert repr(value) == "SecretValue('****')"
            fake.set_secret(NAME, VALUE + "-v2")  # latest version wins
            assert (await store.fetch(NAME)).reveal() == VALUE + "-v2"

    run(main())
    # Challenge round trip (401 without token), then authorized GETs.
    assert [r.status for r in fake.requests] == [401, 200, 200]
    assert [r.authorized for r in fake.requests] == [False, True, True]
    assert all(r.path == f"/secrets/{NAME}/" for r in fake.requests)
    # One token request to Entra ID, for the scope the challenge named.
    assert len(fake.token_requests) == 1
    assert fake.token_requests[0]["scope"] == "https://vault.azure.net/.default"
    assert fake.token_requests[0]["client_id"] == fake.client_id


def test_wrong_federated_token_is_reported(fake: FakeKeyVault) -> None:
    fake.token_file.write_text("not-the-right-service-account-token")

    async def main() -> None:
        async with workload_store(fake) as store:
            with pytest.raises(SecretStoreError) as info:
                await store.fetch(NAME)
        msg = str(info.value)
        assert msg.startswith(f"could not get a token for Key Vault {store.vault_url}")
        assert "AADSTS700211" in msg
        assert not info.value.transient

    run(main())
    assert fake.count(NAME, authorized=True) == 0


def test_cached_and_single_flight_through_the_sdk(fake: FakeKeyVault) -> None:
    fake.latency[NAME] = 0.2

    async def main() -> None:
        async with workload_store(fake) as store:
            cache = SecretCache(store, clock=Clock())
            results = await asyncio.gather(*(cache.get(NAME) for _ in range(100)))
            assert {r.reveal() for r in results} == {VALUE}
            # 1 GET of the secret + the unauthenticated challenge round trip.
            assert fake.count(NAME, authorized=True) == 1
            assert fake.count(NAME) == 2
            # Cached: a second get makes no request.
            assert (await cache.get(NAME)).reveal() == VALUE
            assert fake.count(NAME) == 2
            await cache.close()

    run(main())


def test_outage_serves_stale_then_unavailable(fake: FakeKeyVault) -> None:
    async def main() -> None:
        async with static_store(fake) as store:
            clock = Clock()
            cache = SecretCache(store, ttl=300, refresh_ahead=60, stale_for=600, clock=clock)
            assert (await cache.get(NAME)).reveal() == VALUE
            for outage, reason in (
                ("503", "is unavailable (HTTP 503"),
                ("drop", f"could not reach Key Vault {store.vault_url}"),
            ):
                fake.outage = outage
                clock.now += 301  # expired
                seen = len(fake.requests)
                assert (await cache.get(NAME)).reveal() == VALUE  # stale
                # One attempt; aiohttp itself retries once when a pooled keep-alive
                # connection turns out dead, which the "drop" fault causes.
                assert 1 <= len(fake.requests) - seen <= 2
                assert reason in (cache._entries[NAME].last_error or "")
            clock.now += 1000  # past stale_for
            with pytest.raises(SecretUnavailable) as info:
                await cache.get(NAME)
            assert f"could not reach Key Vault {store.vault_url}" in info.value.reason
            fake.outage = None
            clock.now += 60  # after backoff: the vault is back
            assert (await cache.get(NAME)).reveal() == VALUE
            await cache.close()

    run(main())


def test_429_backoff_honours_retry_after(fake: FakeKeyVault) -> None:
    fake.throttle, fake.retry_after = 1, 7

    async def main() -> None:
        async with static_store(fake) as store:
            clock = Clock()
            cache = SecretCache(store, clock=clock, backoff_base=0.5)
            throttled = (
                metrics.REGISTRY.get_sample_value(
                    "sandbox_gateway_secret_fetches_total",
                    {"store": "azure-keyvault", "result": "throttled"},
                )
                or 0.0
            )
            with pytest.raises(SecretUnavailable, match=r"is throttling requests \(HTTP 429"):
                await cache.get(NAME)
            assert cache._entries[NAME].retry_at - clock.now == pytest.approx(7.0)
            assert (
                metrics.REGISTRY.get_sample_value(
                    "sandbox_gateway_secret_fetches_total",
                    {"store": "azure-keyvault", "result": "throttled"},
                )
                == throttled + 1
            )
            authorized = fake.count(NAME, authorized=True)
            clock.now += 3  # past the exponential backoff, not past Retry-After
            with pytest.raises(SecretUnavailable, match=r"next attempt in 4\.0s"):
                await cache.get(NAME)
            assert fake.count(NAME, authorized=True) == authorized  # fail fast, no request
            clock.now += 4.5
            assert (await cache.get(NAME)).reveal() == VALUE
            assert fake.count(NAME, authorized=True) == authorized + 1
            await cache.close()

    run(main())


def test_retry_after_parsed_from_sdk_error(fake: FakeKeyVault) -> None:
    fake.throttle, fake.retry_after = 1, 2.5

    async def main() -> None:
        async with static_store(fake) as store:
            with pytest.raises(SecretStoreError) as info:
                await store.fetch(NAME)
        assert info.value.status == 429
        assert info.value.retry_after == 2.5
        assert info.value.transient

    run(main())


def test_not_found(fake: FakeKeyVault) -> None:
    async def main() -> None:
        async with static_store(fake) as store:
            with pytest.raises(SecretNotFound) as info:
                await store.fetch("missing-secret")
            assert info.value.secret_name == "missing-secret"
            assert f'secret "missing-secret" is not in Key Vault {store.vault_url}' in str(
                info.value
            )
            cache = SecretCache(store, clock=Clock())
            with pytest.raises(SecretUnavailable, match="is not in Key Vault"):
                await cache.get("missing-secret")
            await cache.close()

    run(main())


def test_forbidden_explains_rbac(fake: FakeKeyVault) -> None:
    fake.forbidden.add(NAME)

    async def main() -> None:
        async with workload_store(fake, client_id=fake.client_id) as store:
            with pytest.raises(SecretStoreError) as info:
                await store.fetch(NAME)
        msg = str(info.value)
        assert f"Key Vault {store.vault_url} returned 403 (Forbidden)" in msg
        assert '"Key Vault Secrets User"' in msg and fake.client_id in msg
        assert info.value.status == 403 and not info.value.transient

    run(main())


def test_challenge_resource_mismatch_is_refused(fake: FakeKeyVault) -> None:
    fake.challenge_resource = "https://vault.attacker.example"

    async def main() -> None:
        async with workload_store(fake) as store:
            with pytest.raises(SecretStoreError, match="challenge for another resource"):
                await store.fetch(NAME)

    run(main())
    assert fake.token_requests == []  # no token was even requested for that resource
    assert fake.count(NAME, authorized=True) == 0


def test_challenge_verification_can_be_disabled(fake: FakeKeyVault) -> None:
    fake.challenge_resource = "https://vault.private.example"

    async def main() -> None:
        async with static_store(fake, verify_challenge_resource=False) as store:
            assert (await store.fetch(NAME)).reveal() == VALUE

    run(main())


def test_invalid_key_vault_name_is_refused_locally(fake: FakeKeyVault) -> None:
    async def main() -> None:
        async with static_store(fake) as store:
            with pytest.raises(SecretStoreError, match="allows only letters, digits and '-'"):
                await store.fetch("openai_api_key")

    run(main())
    assert fake.requests == []


def test_no_secret_value_in_sdk_error_paths(
    fake: FakeKeyVault, caplog: pytest.LogCaptureFixture
) -> None:
    """Drive the SDK through failures after a success and grep errors and logs."""
    errors: list[BaseException] = []

    async def main() -> None:
        async with workload_store(fake) as store:
            clock = Clock()
            cache = SecretCache(store, clock=clock)
            await cache.get(NAME)
            for fault in ("503", "drop", "forbid", "throttle", "missing"):
                fake.outage = fault if fault in ("503", "drop") else None
                if fault == "forbid":
                    fake.forbidden.add(NAME)
                if fault == "throttle":
                    fake.forbidden.clear()
                    fake.throttle = 1
                if fault == "missing":
                    fake.delete_secret(NAME)
                clock.now += 10_000
                try:
                    await store.fetch(NAME)
                except Exception as exc:
                    errors.append(exc)
                try:
                    await cache.get(NAME)
                except Exception as exc:
                    errors.append(exc)
            await cache.close()

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert len(errors) >= 5
    blob = "\n".join("".join(traceback.format_exception(e)) + repr(e) for e in errors) + caplog.text
    assert VALUE not in blob
