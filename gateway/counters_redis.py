"""Counters shared by replicas through Redis, sent in short batches (see ``counters``).

Layout: one hash per table, ``<prefix>:c:<table>``, field -> integer, expiring
(``EXPIREAT``) when the table does. Every ``interval`` seconds one ``MULTI``/``EXEC``
sends the pending batch (``HINCRBY`` per field, ``EXPIREAT`` per table) and re-reads the
fields this replica consulted lately (``HMGET``); the replies are the new shared values.
``HINCRBY`` is atomic, so replicas never lose each other's counts.

A request never waits for Redis: ``count`` and ``counter`` only touch the local view.
While Redis is unreachable the batch stays pending (counted locally, sent when Redis is
back: at-least-once, a reply lost after ``EXEC`` counts twice), ``counters_degraded`` is
True and the outage is logged once.

Budgets across replicas: a check reads this replica's pending counts plus the shared
values as of its last flush. Usage recorded on replica A is in Redis within one
interval and seen by replica B within two, so the overshoot past a limit is the
requests in flight when it is crossed, plus, on each replica, what other replicas
recorded in the last two intervals (0.5 s) and, for a sandbox it has not seen for
``forget_after`` seconds, its first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway import metrics
from gateway.counters import Admission, CounterView, Increment, Table, first_refused
from gateway.net.resolver import unguarded

__all__ = ["RedisCounters"]

log = logging.getLogger("sandbox_gateway.counters")


class RedisCounters:
    """``Counters`` in Redis (see the module docstring). ``start`` with a client."""

    def __init__(self, prefix: str, *, interval: float = 0.25,
                 clock: Callable[[], float] = time.time, forget_after: float = 900.0,
                 url_for_logs: str = "redis") -> None:
        self.prefix = f"{prefix}:c:"
        self.interval = interval
        self.view = CounterView(clock, forget_after=forget_after)
        self.url_for_logs = url_for_logs
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._degraded = False

    # -- Counters ------------------------------------------------------------------------

    def count(self, increments: Iterable[Increment]) -> None:
        self.view.add(increments)

    def counter(self, table: str, field: str) -> int:
        return self.view.value(table, field)

    def admit(self, admission: Admission) -> int | None:
        """This replica's reading of the shared counters decides (the counts reach the
        other replicas within ``interval``: see gateway.counters)."""
        refused = first_refused(admission, self.counter)
        if refused is None:
            self.count(admission.increments)
        return refused

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        """Whole tables from Redis plus what is pending here (the local view if Redis
        cannot be read)."""
        client = self._client
        fresh: list[Any] | None = None
        if client is not None and tables:
            try:
                with unguarded():
                    async with client.pipeline(transaction=False) as pipe:
                        for table in tables:
                            pipe.hgetall(self.prefix + table)
                        fresh = await pipe.execute()
            except (RedisError, OSError) as exc:
                self._down("read", exc)
                fresh = None
        out: dict[str, Table] = {}
        for i, table in enumerate(tables):
            base = None
            if fresh is not None:
                base = {str(k): int(v) for k, v in fresh[i].items()}
            merged = self.view.table(table, base)
            if merged:
                out[table] = merged
        return out

    @property
    def counters_degraded(self) -> bool:
        return self._degraded

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, client: aioredis.Redis) -> None:
        """Begin flushing through ``client`` every ``interval`` seconds."""
        self._client = client
        with unguarded():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="counters-redis")

    async def close(self, timeout: float = 2.0) -> None:
        """Stop flushing; send what is pending (best effort, within ``timeout``)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None and self.view.pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flush(), timeout)
        self._client = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.flush()
            except Exception:  # a bug must not stop counting for good
                log.exception("counters: unexpected error while flushing to Redis")

    # -- one round trip ------------------------------------------------------------------

    async def flush(self) -> None:
        """Send the pending batch and refresh the watched values (one transaction)."""
        self.view.prune()
        client = self._client
        if client is None:
            return
        batch = self.view.take()
        watched = self.view.watched_fields()
        if not batch and not watched:
            if self._degraded:
                try:
                    with unguarded():
                        await client.ping()
                except (RedisError, OSError):
                    return
                self._up()
            return
        plan: list[tuple[str, str | None, list[str] | None]] = []
        try:
            with unguarded():
                async with client.pipeline(transaction=True) as pipe:
                    for table, fields in batch.items():
                        key = self.prefix + table
                        for field, amount in fields.items():
                            pipe.hincrby(key, field, amount)
                            plan.append((table, field, None))
                        expires = self.view.expires.get(table)
                        if expires is not None:
                            pipe.expireat(key, math.ceil(expires))
                            plan.append((table, None, None))
                    for table, wanted in watched.items():
                        pipe.hmget(self.prefix + table, wanted)
                        plan.append((table, None, wanted))
                    replies = await pipe.execute()
        except (RedisError, OSError) as exc:
            self.view.restore(batch)
            self._down("count", exc)
            return
        for (name, one, several), reply in zip(plan, replies, strict=True):
            if one is not None:
                self.view.set_shared(name, one, int(reply))
            elif several is not None:
                for field, value in zip(several, reply, strict=True):
                    self.view.set_shared(name, field, int(value) if value is not None else 0)
        self._up()

    def _up(self) -> None:
        if self._degraded:
            self._degraded = False
            log.info("counters: Redis at %s is back; local counts sent", self.url_for_logs)

    def _down(self, op: str, exc: BaseException) -> None:
        metrics.STATE_STORE_ERRORS.labels(op=op).inc()
        if not self._degraded:
            self._degraded = True
            log.warning("counters: Redis at %s unreachable (%s); counting locally, usage "
                        "and budgets are this replica's view until it is back",
                        self.url_for_logs, exc)
