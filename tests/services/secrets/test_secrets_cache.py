"""SecretCache: single-flight, refresh-ahead, stale-if-error, backoff, invalidate, metrics."""

from __future__ import annotations

import asyncio
import logging
import random
import traceback
from typing import Any

import pytest
from helpers.clock import Clock, run

from gateway.observability import metrics
from gateway.services.secrets import (
    SecretCache,
    SecretError,
    SecretNotFound,
    SecretStoreError,
    SecretUnavailable,
    SecretValue,
)

VALUE = "sk-cache-test-value-9d8c7b6a"



class FixedRandom(random.Random):
    """random() is always `x`: backoff = ceiling/2 + x*ceiling/2."""

    def __init__(self, x: float = 0.0) -> None:
        super().__init__(0)
        self.x = x

    def random(self) -> float:
        return self.x


class FakeStore:
    """A store whose answers tests script: a value, or an exception, per name."""

    name = "fake"

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.errors: dict[str, BaseException] = {}
        self.fetches: dict[str, int] = {}
        self.gate: asyncio.Event | None = None
        self.closed = False

    async def fetch(self, secret_name: str) -> SecretValue:
        self.fetches[secret_name] = self.fetches.get(secret_name, 0) + 1
        if self.gate is not None:
            await self.gate.wait()
        if secret_name in self.errors:
            raise self.errors[secret_name]
        if secret_name not in self.values:
            raise SecretNotFound(
                secret_name, f'secret "{secret_name}" is not in the fake store; add it'
            )
        return SecretValue(self.values[secret_name])

    async def close(self) -> None:
        self.closed = True


def make(**kwargs: Any) -> tuple[SecretCache, FakeStore, Clock]:
    store, clock = FakeStore(), Clock()
    kwargs.setdefault("rng", FixedRandom(0.0))
    cache = SecretCache(store, clock=clock, **kwargs)
    return cache, store, clock


def sample(name: str, labels: dict[str, str]) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def cache_count(outcome: str) -> float:
    return sample("sandbox_gateway_secret_cache_total", {"outcome": outcome})


def fetch_count(result: str, store: str = "fake") -> float:
    return sample("sandbox_gateway_secret_fetches_total", {"store": store, "result": result})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# --------------------------------------------------------------- basics
def test_hit_after_miss_and_metrics() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.values["k"] = VALUE
        before = {o: cache_count(o) for o in ("hit", "miss")}
        ok_before = fetch_count("ok")
        seconds_before = sample("sandbox_gateway_secret_fetch_seconds_count", {"store": "fake"})
        assert (await cache.get("k")).reveal() == VALUE
        assert (await cache.get("k")).reveal() == VALUE
        assert store.fetches == {"k": 1}
        assert cache_count("miss") - before["miss"] == 1
        assert cache_count("hit") - before["hit"] == 1
        assert fetch_count("ok") - ok_before == 1
        assert (
            sample("sandbox_gateway_secret_fetch_seconds_count", {"store": "fake"})
            == seconds_before + 1
        )
        assert [v.reveal() for v in cache.known_values()] == [VALUE]
        await cache.close()
        assert store.closed

    run(main())


def test_single_flight_100_concurrent_cold_gets_one_fetch() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.values["k"] = VALUE
        store.gate = asyncio.Event()
        tasks = [asyncio.create_task(cache.get("k")) for _ in range(100)]
        await settle()
        assert store.fetches == {"k": 1}
        store.gate.set()
        results = await asyncio.gather(*tasks)
        assert all(r.reveal() == VALUE for r in results)
        assert store.fetches == {"k": 1}
        await cache.close()

    run(main())


def test_single_flight_shares_failures_too() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.errors["k"] = SecretStoreError("vault down", status=503, transient=True)
        store.gate = asyncio.Event()
        tasks = [asyncio.create_task(cache.get("k")) for _ in range(50)]
        await settle()
        store.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, SecretUnavailable) and r.reason == "vault down" for r in results)
        assert store.fetches == {"k": 1}
        await cache.close()

    run(main())


def test_cancelled_caller_does_not_cancel_shared_fetch() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.values["k"] = VALUE
        store.gate = asyncio.Event()
        first = asyncio.create_task(cache.get("k"))
        second = asyncio.create_task(cache.get("k"))
        await settle()
        first.cancel()
        await settle()
        store.gate.set()
        assert (await second).reveal() == VALUE
        assert store.fetches == {"k": 1}
        await cache.close()

    run(main())


# --------------------------------------------------------------- refresh ahead
def test_refresh_ahead_serves_current_value_and_refreshes_once() -> None:
    async def main() -> None:
        cache, store, clock = make(ttl=300, refresh_ahead=60)
        store.values["k"] = "value-one"
        await cache.get("k")
        clock.now += 239  # not yet in the refresh window
        assert (await cache.get("k")).reveal() == "value-one"
        await settle()
        assert store.fetches["k"] == 1
        store.values["k"] = "value-two"
        store.gate = asyncio.Event()
        clock.now += 2  # 241s: inside the window, still fresh
        hits = cache_count("hit")
        for _ in range(20):
            assert (await cache.get("k")).reveal() == "value-one"  # immediately, no wait
        await settle()
        assert store.fetches["k"] == 2  # exactly one background refresh
        assert cache_count("hit") - hits == 20
        store.gate.set()
        await settle()
        assert (await cache.get("k")).reveal() == "value-two"
        assert store.fetches["k"] == 2
        clock.now += 250  # the refreshed value is fresh until 241+300
        assert (await cache.get("k")).reveal() == "value-two"
        assert store.fetches["k"] == 2
        await cache.close()

    run(main())


def test_expired_value_is_refetched_before_answering() -> None:
    async def main() -> None:
        cache, store, clock = make(ttl=300, refresh_ahead=60)
        store.values["k"] = "value-one"
        await cache.get("k")
        store.values["k"] = "value-two"
        clock.now += 301
        assert (await cache.get("k")).reveal() == "value-two"
        await cache.close()

    run(main())


def stale_seconds(name: str) -> float:
    return float(metrics.SECRET_STALE.labels(secret=name)._value.get())


# --------------------------------------------------------------- stale-if-error
def test_stale_if_error_then_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        cache, store, clock = make(ttl=300, refresh_ahead=60, stale_for=3600)
        store.values["k"] = VALUE
        await cache.get("k")
        store.errors["k"] = SecretStoreError(
            "Key Vault https://x.vault.azure.net is unavailable (HTTP 503)",
            status=503,
            transient=True,
        )
        # Refresh window: background refresh fails, fresh value still served.
        clock.now += 250
        assert (await cache.get("k")).reveal() == VALUE
        await settle()
        assert store.fetches["k"] == 2
        stale, errors = cache_count("stale"), fetch_count("error")
        clock.now += 100  # expired: refetch fails -> stale value
        assert (await cache.get("k")).reveal() == VALUE
        assert store.fetches["k"] == 3
        assert cache_count("stale") - stale == 1
        assert fetch_count("error") - errors == 1
        # Inside the backoff window: stale without touching the store.
        clock.now += 0.1
        assert (await cache.get("k")).reveal() == VALUE
        assert store.fetches["k"] == 3
        # Just before stale_for runs out: still served, and how stale is exported.
        clock.now = 1000 + 300 + 3600 - 1
        assert (await cache.get("k")).reveal() == VALUE
        assert stale_seconds("k") == pytest.approx(3600 - 1)
        # The outage was logged once, not once per failed fetch.
        assert sum("serving the cached value" in r.getMessage() for r in caplog.records) == 1
        # Past stale_for: unavailable, with the store's reason.
        clock.now = 1000 + 300 + 3600 + 1
        unavailable = cache_count("unavailable")
        with pytest.raises(SecretUnavailable) as info:
            await cache.get("k")
        assert "Key Vault https://x.vault.azure.net is unavailable (HTTP 503)" in info.value.reason
        assert info.value.secret_name == "k"
        assert cache_count("unavailable") - unavailable == 1
        assert cache.known_values() == []
        await cache.close()

    with caplog.at_level(logging.WARNING, logger="gateway.secrets"):
        run(main())
    assert "secret k: fetch from the fake store failed" in caplog.text
    assert "serving the cached value" in caplog.text
    assert VALUE not in caplog.text


def test_recovery_resets_backoff() -> None:
    async def main() -> None:
        cache, store, clock = make(ttl=300, refresh_ahead=60)
        store.values["k"] = "v-one"
        await cache.get("k")
        store.errors["k"] = SecretStoreError("down", transient=True)
        clock.now += 301
        assert (await cache.get("k")).reveal() == "v-one"  # stale
        del store.errors["k"]
        store.values["k"] = "v-two"
        clock.now += 1  # past the 0.25..0.5s first backoff
        assert (await cache.get("k")).reveal() == "v-two"
        assert store.fetches["k"] == 3
        await cache.close()

    run(main())


def test_not_found_is_authoritative() -> None:
    async def main() -> None:
        cache, store, clock = make(ttl=300, refresh_ahead=60)
        store.values["k"] = VALUE
        await cache.get("k")
        del store.values["k"]  # deleted from the store
        clock.now += 301
        not_found = fetch_count("not_found")
        with pytest.raises(SecretUnavailable, match='secret "k" is not in the fake store; add it'):
            await cache.get("k")
        assert fetch_count("not_found") - not_found == 1
        assert cache.known_values() == []
        await cache.close()

    run(main())


# --------------------------------------------------------------- backoff
def test_backoff_fails_fast_and_grows_exponentially() -> None:
    async def main() -> None:
        cache, store, clock = make(backoff_base=1.0, backoff_max=8.0)  # rng=0: delay=ceiling/2
        store.errors["k"] = SecretStoreError("store down", transient=True)
        expected_delays = [0.5, 1.0, 2.0, 4.0, 4.0]  # ceilings 1,2,4,8,8 halved
        for n, delay in enumerate(expected_delays, start=1):
            with pytest.raises(SecretUnavailable, match=r"^store down$"):
                await cache.get("k")
            assert store.fetches["k"] == n
            # During backoff: fail fast, the store is not asked.
            clock.now += delay - 0.01
            with pytest.raises(SecretUnavailable, match=r"store down \(next attempt in 0\.0s\)"):
                await cache.get("k")
            assert store.fetches["k"] == n
            clock.now += 0.02
        await cache.close()

    run(main())


def test_backoff_jitter_stays_within_bounds() -> None:
    cache = SecretCache(FakeStore(), backoff_base=0.5, backoff_max=30.0, rng=random.Random(7))
    for failures in range(1, 12):
        ceiling = min(30.0, 0.5 * 2 ** (failures - 1))
        for _ in range(50):
            assert ceiling / 2 <= cache._backoff(failures, None) <= ceiling


def test_retry_after_is_honoured_and_counted_as_throttled() -> None:
    async def main() -> None:
        cache, store, clock = make(backoff_base=0.5)
        store.errors["k"] = SecretStoreError(
            "Key Vault is throttling requests (HTTP 429); retrying",
            status=429,
            retry_after=7.0,
            transient=True,
        )
        throttled = fetch_count("throttled")
        with pytest.raises(SecretUnavailable, match="throttling"):
            await cache.get("k")
        assert fetch_count("throttled") - throttled == 1
        del store.errors["k"]
        store.values["k"] = VALUE
        clock.now += 3.0  # well past the 0.5s backoff, still before Retry-After
        with pytest.raises(SecretUnavailable, match=r"next attempt in 4\.0s"):
            await cache.get("k")
        assert store.fetches["k"] == 1
        clock.now += 4.01
        assert (await cache.get("k")).reveal() == VALUE
        assert store.fetches["k"] == 2
        await cache.close()

    run(main())


def test_backoff_is_per_name() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.errors["bad"] = SecretStoreError("bad", transient=True)
        store.values["good"] = VALUE
        with pytest.raises(SecretUnavailable):
            await cache.get("bad")
        assert (await cache.get("good")).reveal() == VALUE
        await cache.close()

    run(main())


# --------------------------------------------------------------- invalidate
def test_invalidate_refetches_once_with_single_flight() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.values["k"] = "old-key"
        old = await cache.get("k")
        store.values["k"] = "rotated-key"
        cache.invalidate("k")
        store.gate = asyncio.Event()
        tasks = [asyncio.create_task(cache.get("k")) for _ in range(100)]
        await settle()
        assert store.fetches["k"] == 2
        store.gate.set()
        assert {r.reveal() for r in await asyncio.gather(*tasks)} == {"rotated-key"}
        store.gate = None
        # A late 401 for the old value must not discard the rotated one.
        cache.invalidate("k", rejected=old)
        assert (await cache.get("k")).reveal() == "rotated-key"
        assert store.fetches["k"] == 2
        await cache.close()

    run(main())


def test_invalidate_same_value_is_fine_and_not_a_storm() -> None:
    async def main() -> None:
        cache, store, clock = make(reconfirm_interval=30.0)
        store.values["k"] = VALUE
        await cache.get("k")
        cache.invalidate("k")
        assert (await cache.get("k")).reveal() == VALUE
        assert store.fetches["k"] == 2
        # The store just confirmed this value: more 401s do not refetch...
        for _ in range(10):
            cache.invalidate("k")
            await cache.get("k")
        assert store.fetches["k"] == 2
        # ...until reconfirm_interval has passed.
        clock.now += 31
        cache.invalidate("k")
        await cache.get("k")
        assert store.fetches["k"] == 3
        await cache.close()

    run(main())


def test_invalidate_unknown_name_is_a_noop() -> None:
    cache, _, _ = make()
    cache.invalidate("never-fetched")


def test_invalidate_then_failure_serves_previous_value() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.values["k"] = VALUE
        await cache.get("k")
        store.errors["k"] = SecretStoreError("down", transient=True)
        cache.invalidate("k")
        stale = cache_count("stale")
        assert (await cache.get("k")).reveal() == VALUE
        assert cache_count("stale") - stale == 1
        await cache.close()

    run(main())


# --------------------------------------------------------------- robustness
def test_fetch_timeout() -> None:
    async def main() -> None:
        cache, store, _ = make(fetch_timeout=0.02)
        store.values["k"] = VALUE
        store.gate = asyncio.Event()  # never set
        with pytest.raises(SecretUnavailable, match=r"did not answer within 0\.02s"):
            await cache.get("k")
        await cache.close()

    run(main())


def test_unexpected_store_exception_reports_type_only() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.errors["k"] = RuntimeError(f"parser choked on {VALUE}")
        with pytest.raises(SecretUnavailable) as info:
            await cache.get("k")
        assert "failed unexpectedly (RuntimeError)" in info.value.reason
        assert VALUE not in "".join(traceback.format_exception(info.value))
        await cache.close()

    run(main())


def test_close_cancels_inflight_fetches() -> None:
    async def main() -> None:
        cache, store, _ = make()
        store.values["k"] = VALUE
        store.gate = asyncio.Event()
        waiter = asyncio.create_task(cache.get("k"))
        await settle()
        await cache.close()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert store.closed
        with pytest.raises(SecretUnavailable, match="closed"):
            await cache.get("k")

    run(main())


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="ttl"):
        SecretCache(FakeStore(), ttl=0)
    with pytest.raises(ValueError, match="refresh_ahead"):
        SecretCache(FakeStore(), ttl=10, refresh_ahead=10)


# --------------------------------------------------------------- no leaks
def test_no_value_in_errors_logs_or_metric_labels(caplog: pytest.LogCaptureFixture) -> None:
    """Exercise every path, then grep everything observable for the value."""
    seen: list[BaseException] = []

    async def main() -> None:
        cache, store, clock = make()
        store.values["k"] = VALUE
        await cache.get("k")
        for error in (
            SecretStoreError("down", status=503, transient=True),
            SecretStoreError("slow", status=429, retry_after=1.0, transient=True),
            SecretNotFound("k"),
            ValueError(VALUE),
        ):
            store.errors["k"] = error
            clock.now += 10_000
            try:
                await cache.get("k")
            except SecretError as exc:
                seen.append(exc)
        await cache.close()

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert seen
    texts = [str(e) + repr(e) + "".join(traceback.format_exception(e)) for e in seen]
    texts += [r.getMessage() for r in caplog.records] + [caplog.text]
    for metric in metrics.REGISTRY.collect():
        for s in metric.samples:
            texts.append(repr(s.labels))
    blob = "\n".join(texts)
    for variant in SecretValue(VALUE).variants():
        assert variant.decode("latin-1") not in blob


def test_refetch_under_an_eager_task_factory() -> None:
    """mitmproxy runs its loop with asyncio.eager_task_factory: a store that answers
    without suspending finishes inside create_task. The cache must not keep that
    finished task as 'in flight' (it would serve its old value forever)."""
    from gateway.services.secrets import SecretValue

    class Instant:
        name = "instant"

        def __init__(self) -> None:
            self.value = "first-secret-value-0123456789"
            self.calls = 0

        async def fetch(self, secret_name: str) -> SecretValue:
            self.calls += 1
            return SecretValue(self.value)

        async def close(self) -> None:
            return None

    async def scenario() -> None:
        asyncio.get_running_loop().set_task_factory(asyncio.eager_task_factory)
        store = Instant()
        cache = SecretCache(store)  # type: ignore[arg-type]
        first = await cache.get("k")
        store.value = "second-secret-value-0123456789"
        cache.invalidate("k", rejected=first)
        assert (await cache.get("k")).reveal() == "second-secret-value-0123456789"
        assert store.calls == 2
        await cache.close()

    asyncio.run(scenario())
