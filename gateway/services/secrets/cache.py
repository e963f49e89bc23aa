"""`SecretCache`: the only way the gateway reads secrets on the request path.

What it adds on top of a `SecretStore`:

- **TTL cache**: a value is fresh for ``ttl`` seconds.
- **Single-flight**: concurrent gets of a name share one ``store.fetch``.
- **Refresh ahead**: a get within ``refresh_ahead`` of expiry returns the cached
  value at once and starts one background refresh, so hot names never expire.
- **Stale-if-error**: when a fetch fails, the last value keeps serving until
  ``stale_for`` after its expiry (Key Vault outages should not take inference
  down). "Not found" is authoritative: a deleted secret stops serving.
- **Backoff**: failed fetches of a name are spaced exponentially with jitter
  (never sooner than a Retry-After); meanwhile a get that has no value fails
  fast with `SecretUnavailable` instead of hammering the store.
- **Invalidate**: an upstream 401 calls `invalidate`; the next get refetches.
- **Minted values** (`MintedValue` with a ``lifetime``: access tokens the gateway
  mints) are kept until ``expiry_margin`` (at most a tenth of their lifetime) before
  they expire instead of ``ttl``, refreshed ahead of that, and never served, not even
  stale, past their own expiry.
- **on_change**: called when a fetch brings a value the cache did not hold (the log
  redaction, `gateway/observability/logs.py`, then rebuilds its markers from `known_values`).

Logs and metrics carry secret *names* and store kinds, never values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.secret_value import MintedValue, SecretValue
from gateway.observability import metrics
from gateway.services.secrets.base import SecretError, SecretNotFound, SecretStore, SecretStoreError

log = logging.getLogger(__name__)

# Never wait longer than this for a Retry-After, whatever the server says.
MAX_RETRY_AFTER = 600.0


class SecretUnavailable(SecretError):
    """No value can be served for a secret; ``reason`` tells an operator what to fix."""

    def __init__(self, secret_name: str, reason: str) -> None:
        self.secret_name = secret_name
        self.reason = reason
        super().__init__(reason)


_Outcome = SecretValue | SecretError


@dataclass(eq=False)
class _Entry:
    """Cache state of one secret name."""

    value: SecretValue | None = None
    expires_at: float = 0.0
    refresh_at: float = 0.0
    stale_until: float = 0.0
    invalidated: bool = False
    # When an invalidation's refetch returned the same value (see `invalidate`).
    confirmed_at: float | None = None
    inflight: asyncio.Task[_Outcome] | None = None
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None


class SecretCache:
    """Caching, single-flight, refresh-ahead, stale-if-error front of a `SecretStore`."""

    def __init__(
        self,
        store: SecretStore,
        ttl: float = 300.0,
        refresh_ahead: float = 60.0,
        stale_for: float = 3600.0,
        backoff_base: float = 0.5,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        fetch_timeout: float | None = 15.0,
        reconfirm_interval: float = 30.0,
        rng: random.Random | None = None,
        expiry_margin: float = 60.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if not 0 <= refresh_ahead < ttl:
            raise ValueError("refresh_ahead must be >= 0 and less than ttl")
        if stale_for < 0 or backoff_base <= 0 or backoff_max < backoff_base:
            raise ValueError("need stale_for >= 0 and 0 < backoff_base <= backoff_max")
        self.store = store
        self.ttl = ttl
        self.refresh_ahead = refresh_ahead
        self.stale_for = stale_for
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.fetch_timeout = fetch_timeout
        self.reconfirm_interval = reconfirm_interval
        self.expiry_margin = expiry_margin
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self._entries: dict[str, _Entry] = {}
        self._closed = False
        self.on_change = on_change

    async def get(self, name: str) -> SecretValue:
        """Return the value of ``name`` or raise `SecretUnavailable`."""
        if self._closed:
            raise SecretUnavailable(name, "the secret cache is closed (gateway shutting down)")
        now = self._clock()
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = _Entry()
        if entry.value is not None and now >= entry.stale_until:
            entry.value = None
        value = entry.value

        if value is not None and not entry.invalidated and now < entry.expires_at:
            if now >= entry.refresh_at and entry.inflight is None and now >= entry.retry_at:
                self._start_fetch(name, entry)
            self._count("hit")
            return value

        task = entry.inflight
        if task is None:
            if now < entry.retry_at:
                if value is not None:
                    self._stale(name, entry, now)
                    return value
                self._count("unavailable")
                wait = entry.retry_at - now
                raise SecretUnavailable(name, f"{entry.last_error} (next attempt in {wait:.1f}s)")
            task = self._start_fetch(name, entry)
        # shield: a caller that gives up must not cancel the fetch others share.
        outcome = await asyncio.shield(task)
        if isinstance(outcome, SecretValue):
            self._count("miss")
            return outcome
        if entry.value is not None:
            self._stale(name, entry, self._clock())
            return entry.value
        self._count("unavailable")
        raise SecretUnavailable(name, str(outcome))

    def _stale(self, name: str, entry: _Entry, now: float) -> None:
        """A stale value is served: counted, and its age exported (an outage of the
        store stays visible while the cache hides it from the sandboxes)."""
        self._count("stale")
        metrics.SECRET_STALE.labels(secret=name).set(max(0.0, now - entry.expires_at))

    def invalidate(self, name: str, rejected: SecretValue | None = None) -> None:
        """Mark ``name`` for refetch on the next get (an upstream rejected it).

        With ``rejected``, only if the cached value is still that one, so a 401
        for an old key cannot discard a freshly rotated one. If an earlier
        invalidation's refetch returned this same value less than
        ``reconfirm_interval`` ago, the call is ignored: the store already
        confirmed it, and refetching on every 401 would hammer the vault.
        """
        entry = self._entries.get(name)
        if entry is None or entry.value is None:
            return
        if rejected is not None and entry.value != rejected:
            return
        if (
            entry.confirmed_at is not None
            and self._clock() - entry.confirmed_at < self.reconfirm_interval
        ):
            return
        entry.invalidated = True

    def known_values(self) -> list[SecretValue]:
        """Every value currently cached (fresh or stale), for leak detection."""
        return [e.value for e in self._entries.values() if e.value is not None]

    def known_items(self) -> list[tuple[str, SecretValue]]:
        """(secret name, value) of every cached value, for leak detection by binding."""
        return [(n, e.value) for n, e in self._entries.items() if e.value is not None]

    async def close(self) -> None:
        """Cancel in-flight fetches and close the store."""
        self._closed = True
        tasks = [e.inflight for e in self._entries.values() if e.inflight is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._entries.clear()
        await self.store.close()

    def _count(self, outcome: str) -> None:
        metrics.child(metrics.SECRET_CACHE, outcome).inc()

    def _start_fetch(self, name: str, entry: _Entry) -> asyncio.Task[_Outcome]:
        task = asyncio.create_task(self._fetch(name, entry), name=f"secret-fetch:{name}")
        # Under an eager task factory (mitmproxy installs one) a fetch that never
        # suspends has already finished, and cleared `inflight`, by now.
        entry.inflight = None if task.done() else task
        return task

    async def _fetch(self, name: str, entry: _Entry) -> _Outcome:
        """Fetch once and update the entry. Never raises (except on cancel)."""
        store_kind = self.store.name
        started = time.perf_counter()
        outcome: _Outcome
        try:
            try:
                async with asyncio.timeout(self.fetch_timeout):
                    outcome = await self.store.fetch(name)
            except TimeoutError:
                outcome = SecretStoreError(
                    f"the {store_kind} secret store did not answer within {self.fetch_timeout:g}s",
                    transient=True,
                )
            except SecretError as exc:
                outcome = exc
            except Exception as exc:
                # A bug or an unexpected library error: its text might quote
                # data, so only the type is reported.
                outcome = SecretStoreError(
                    f"the {store_kind} secret store failed unexpectedly ({type(exc).__name__})"
                )
        finally:
            metrics.SECRET_FETCH_SECONDS.labels(store=store_kind).observe(
                time.perf_counter() - started
            )
            entry.inflight = None
        if isinstance(outcome, SecretValue):
            self._succeeded(name, entry, outcome)
        else:
            self._failed(name, entry, outcome)
        return outcome

    def _succeeded(self, name: str, entry: _Entry, value: SecretValue) -> None:
        now = self._clock()
        metrics.SECRET_FETCHES.labels(store=self.store.name, result="ok").inc()
        if entry.failures:
            metrics.SECRET_STALE.labels(secret=name).set(0)
            log.info(
                "secret %s: %s store answered again after %d failed fetches",
                name,
                self.store.name,
                entry.failures,
            )
        if entry.invalidated:
            entry.confirmed_at = now if entry.value is not None and entry.value == value else None
        new = entry.value is None or entry.value != value
        entry.value = value
        if new and self.on_change is not None:
            self.on_change()
        lifetime = value.lifetime if isinstance(value, MintedValue) else None
        kept, refresh, stale = self.schedule(lifetime)
        entry.expires_at, entry.refresh_at, entry.stale_until = now + kept, now + refresh, \
            now + stale
        entry.invalidated = False
        entry.failures = 0
        entry.retry_at = 0.0
        entry.last_error = None

    def schedule(self, lifetime: float | None) -> tuple[float, float, float]:
        """Seconds after a fetch at which a value of `lifetime` (None: a store secret, or
        a minted value of unknown expiry) stops being served fresh, is refreshed ahead,
        and stops being served even stale (the shared minter's due time is the second)."""
        if lifetime is None:
            return self.ttl, self.ttl - self.refresh_ahead, self.ttl + self.stale_for
        margin = min(self.expiry_margin, lifetime / 10)
        usable = max(1.0, lifetime - margin)  # (a skewed clock: no mint per request)
        return usable, usable - min(self.refresh_ahead, usable / 2), \
            max(0.0, lifetime - margin / 2)

    def refresh_after(self, lifetime: float | None) -> float:
        """Seconds after a fetch at which a value of `lifetime` is refreshed ahead."""
        return self.schedule(lifetime)[1]

    def _failed(self, name: str, entry: _Entry, error: SecretError) -> None:
        now = self._clock()
        reason = str(error)
        if isinstance(error, SecretNotFound):
            result = "not_found"
            entry.value = None  # authoritative: a deleted secret stops serving
        elif isinstance(error, SecretStoreError) and error.status == 429:
            result = "throttled"
        else:
            result = "error"
        metrics.SECRET_FETCHES.labels(store=self.store.name, result=result).inc()
        entry.failures += 1
        delay = self._backoff(entry.failures, getattr(error, "retry_after", None))
        entry.retry_at = now + delay
        entry.last_error = reason
        if entry.failures > 1:
            # Logged once per outage; the rest is in sandbox_gateway_secret_fetches_total
            # and sandbox_gateway_secret_stale_seconds.
            log.debug("secret %s: fetch failed again (%d failures): %s", name,
                      entry.failures, reason)
        elif entry.value is not None and now < entry.stale_until:
            log.warning(
                "secret %s: fetch from the %s store failed (%s); serving the cached value "
                "for up to %.0fs more (its age: sandbox_gateway_secret_stale_seconds); next "
                "attempt in %.1fs",
                name,
                self.store.name,
                reason,
                entry.stale_until - now,
                delay,
            )
        else:
            log.warning(
                "secret %s: fetch from the %s store failed (%s); next attempt in %.1fs",
                name,
                self.store.name,
                reason,
                delay,
            )

    def _backoff(self, failures: int, retry_after: float | None) -> float:
        """Exponential backoff with equal jitter, never below Retry-After."""
        ceiling = min(self.backoff_max, self.backoff_base * 2.0 ** min(failures - 1, 32))
        delay = ceiling / 2 + self._rng.random() * ceiling / 2
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER))
        return delay
