"""`RedisState`'s link to Redis: its two clients, the channel it follows, one call bounded.

A command client (one immediate retry: a pooled connection may be stale after a Redis
restart) and a subscription client (none: a reconnect re-syncs instead). `_open` connects,
subscribes and loads a full snapshot before following the channel; `_follow` applies each
event, re-syncs every `resync_interval` seconds and, when Redis goes away, marks the store
down (`sandbox_gateway_state_store_up{store="redis"}` 0, one log line), reconnects with
backoff and re-syncs. `_op` and `_transaction` are every other part's one way to Redis:
bounded, counted, and raising `StateUnavailable` with what the failure means. What the
mirror is and does (`resync`, `_apply_event`, `_prune`) is `redis.py`'s.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.net.resolver import unguarded
from gateway.observability import metrics
from gateway.services.state.base import StateUnavailable

__all__ = ["RedisLink", "redact_url"]

log = logging.getLogger("sandbox_gateway.state")

_STORE = "redis"


def redact_url(url: str) -> str:
    """`url` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class RedisLink(abc.ABC):
    """The connection a `RedisState` keeps to Redis (see the module docstring); what it
    applies is the mirror's, declared here and defined by `RedisState`."""

    url: str
    channel: str
    op_timeout: float
    start_timeout: float
    backoff: tuple[float, float]
    resync_interval: float
    clock: Callable[[], float]
    _redis: aioredis.Redis | None
    _sub_client: aioredis.Redis | None
    _pubsub: PubSub | None
    _task: asyncio.Task[None] | None
    _up: bool
    _next_resync: float
    _next_prune: float

    # -- what the mirror does (`RedisState`) ---------------------------------------------

    @abc.abstractmethod
    async def resync(self) -> None:
        """Replace the mirror with Redis's state (raises RedisError/OSError)."""

    @abc.abstractmethod
    def _apply_event(self, data: object) -> None:
        """Apply one change a replica published on the channel."""

    @abc.abstractmethod
    def _prune(self) -> None:
        """Drop what has expired from the mirror."""

    # -- health ---------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while connected to Redis and in sync (False = answering from the mirror)."""
        return self._up

    @property
    def warning(self) -> str | None:
        """(Redis's own memory and disk are watched by Redis's operators.)"""
        return None

    @property
    def problem(self) -> str | None:
        """Why this replica is not in sync with Redis (None: it is)."""
        if self._up:
            return None
        return (f"Redis at {redact_url(self.url)} is unreachable: enforcing from the last "
                "known revocations, sandboxes and this replica's counts")


    # -- one call -------------------------------------------------------------------------

    async def _transaction(self, op: str, build: Callable[[Any], None],
                           consequence: str) -> list[Any]:
        if self._redis is None:
            raise StateUnavailable(f"state store not started; {consequence}")
        try:
            with unguarded():
                async with self._redis.pipeline(transaction=True) as pipe:
                    build(pipe)
                    return list(await pipe.execute())
        except (RedisError, OSError) as exc:
            metrics.STATE_STORE_ERRORS.labels(op=op).inc()
            log.warning("state store: %s failed: %s", op, exc)
            raise StateUnavailable(
                f"shared state store (Redis at {redact_url(self.url)}) is unreachable: "
                f"{exc}; {consequence}; retry when Redis is back") from None


    async def _op(self, op: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """One Redis call for the mint share, bounded by `op_timeout`; StateUnavailable
        when Redis cannot answer (the caller then mints for itself)."""
        if self._redis is None:
            raise StateUnavailable("state store not started")
        try:
            with unguarded():
                return await asyncio.wait_for(call(self._redis), self.op_timeout)
        except (RedisError, OSError, TimeoutError) as exc:
            metrics.STATE_STORE_ERRORS.labels(op=op).inc()
            raise StateUnavailable(f"Redis at {redact_url(self.url)} did not answer: "
                                   f"{str(exc) or type(exc).__name__}") from None

    # -- connecting and following -------------------------------------------------------

    async def _open(self) -> None:
        """Connect, load the current state and follow changes; raise if Redis stays
        unreachable for `start_timeout` seconds (a gateway must not start blind)."""
        kwargs: dict[str, Any] = {
            "decode_responses": True,
            "socket_connect_timeout": self.op_timeout,
            "socket_timeout": self.op_timeout,
        }
        # One immediate retry for commands (a pooled connection may be stale after a
        # Redis restart); none for pub/sub, whose reconnects we handle with a re-sync.
        self._redis = aioredis.from_url(self.url, retry=Retry(NoBackoff(), 1), **kwargs)
        self._sub_client = aioredis.from_url(self.url, retry=Retry(NoBackoff(), 0), **kwargs)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        delay = self.backoff[0]
        while True:
            try:
                with unguarded():
                    await self._connect()
                break
            except (RedisError, OSError) as exc:
                metrics.STATE_STORE_ERRORS.labels(op="connect").inc()
                await self._drop_pubsub()
                if loop.time() + delay >= deadline:
                    await self._close_clients()
                    raise StateUnavailable(
                        f"cannot reach Redis at {redact_url(self.url)} (state.url): "
                        f"{exc}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff[1])
        with unguarded():
            self._task = loop.create_task(self._follow(), name="state-redis")

    async def _shut(self) -> None:
        """Stop following and close both clients."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._drop_pubsub()
        await self._close_clients()
        if self._up:
            self._up = False
            metrics.STATE_STORE_UP.labels(store=_STORE).set(0)

    async def _close_clients(self) -> None:
        for client in (self._redis, self._sub_client):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()
        self._redis = self._sub_client = None

    async def _drop_pubsub(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]
            self._pubsub = None

    async def _connect(self) -> None:
        """Subscribe, then load a full snapshot: events published meanwhile are queued
        on the subscription and replayed after it, so nothing falls in between."""
        assert self._sub_client is not None
        pubsub = self._sub_client.pubsub(ignore_subscribe_messages=True)
        self._pubsub = pubsub
        await pubsub.subscribe(self.channel)
        await self.resync()
        if not self._up:
            self._up = True
            metrics.STATE_STORE_UP.labels(store=_STORE).set(1)

    def _mark_down(self, op: str, exc: BaseException) -> None:
        metrics.STATE_STORE_ERRORS.labels(op=op).inc()
        if self._up:
            self._up = False
            metrics.STATE_STORE_UP.labels(store=_STORE).set(0)
            log.warning("state store: lost Redis at %s (%s); serving the last known "
                        "revocations and sandboxes, refusing changes until it is back",
                        redact_url(self.url), exc)

    async def _follow(self) -> None:
        """Apply events; re-sync periodically; reconnect and re-sync after an outage."""
        delay = self.backoff[0]
        while True:
            try:
                if self._pubsub is None:
                    await self._connect()
                    log.info("state store: reconnected to Redis at %s and re-synced",
                             redact_url(self.url))
                delay = self.backoff[0]
                await self._pump()
            except (RedisError, OSError) as exc:
                self._mark_down("listen", exc)
            except Exception as exc:  # a bug must not stop following changes for good
                log.exception("state store: unexpected error while following Redis")
                self._mark_down("listen", exc)
            # _pump only returns by raising: drop the subscription, wait, reconnect.
            await self._drop_pubsub()
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311
            delay = min(delay * 2, self.backoff[1])

    async def _pump(self) -> None:
        assert self._pubsub is not None
        loop = asyncio.get_running_loop()
        while True:
            message = await self._pubsub.get_message(ignore_subscribe_messages=True,
                                                     timeout=min(1.0, self.resync_interval))
            if message is not None and message.get("type") == "message":
                self._apply_event(message.get("data"))
            now = loop.time()
            if now >= self._next_resync:
                await self.resync()
            if now >= self._next_prune:
                self._prune()
                self._next_prune = now + 1.0

