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

**Budget admission is exact across replicas.** `admit` (check every limit, count the
request and its reservation) is one Lua script run by Redis atomically: it first adds
this replica's pending batch, then reads the limits' fields, and counts the admission
only if every limit holds - so no two replicas admit on the same remaining allowance.
It is a synchronous call (the metering core is synchronous, like SQLite's admission
transaction) bounded by `admit_timeout` (0.25 s); the answer refreshes the local view of
every field it touched. While Redis is unreachable (or that call fails) admission
falls back to this replica's view (the outage is reported: `counters_degraded`, the
`state_store_up` gauge, one log line), the overshoot then being what other replicas
admitted meanwhile. Settlements (what a call used, counted after its response) still
travel in the batches, so a token or cost budget sees another replica's finished call
within one interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis as syncredis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.net.resolver import unguarded
from gateway.observability import metrics
from gateway.services.state.counters import Admission, CounterView, Increment, Table, first_refused

__all__ = ["RedisCounters"]

# ARGV: the pending batch (n, then key index, field, amount, expiry per entry), the
# limits (n, then per limit: n fields, key index and field per field, ceiling, add),
# the admission's increments (like the batch), the fields to report (n, key index and
# field each). Returns {refused limit (1-based) or 0, reported values...}. (Explicit
# locals: Lua leaves the order of evaluation of a call's arguments unspecified.)
_ADMIT = """
local at = 0
local function take() at = at + 1 return ARGV[at] end
local function apply(n)
  for _ = 1, n do
    local key = KEYS[tonumber(take())]
    local field = take()
    local amount = take()
    local expires = tonumber(take())
    redis.call('HINCRBY', key, field, amount)
    if expires > 0 then redis.call('EXPIREAT', key, expires) end
  end
end
apply(tonumber(take()))
local refused = 0
for i = 1, tonumber(take()) do
  local used = 0
  for _ = 1, tonumber(take()) do
    local key = KEYS[tonumber(take())]
    local field = take()
    used = used + (tonumber(redis.call('HGET', key, field)) or 0)
  end
  local ceiling = tonumber(take())
  local add = tonumber(take())
  if refused == 0 and not (used < ceiling and used + add <= ceiling) then refused = i end
end
local n = tonumber(take())
if refused == 0 then apply(n) else at = at + 4 * n end
local out = {refused}
for _ = 1, tonumber(take()) do
  local key = KEYS[tonumber(take())]
  local field = take()
  out[#out + 1] = tonumber(redis.call('HGET', key, field)) or 0
end
return out
"""

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
        self._sync: syncredis.Redis | None = None  # admission's own connection
        self._task: asyncio.Task[None] | None = None
        self._degraded = False

    # -- Counters ------------------------------------------------------------------------

    def count(self, increments: Iterable[Increment]) -> None:
        self.view.add(increments)

    def counter(self, table: str, field: str) -> int:
        return self.view.value(table, field)

    def admit(self, admission: Admission) -> int | None:
        """Check and count in Redis, atomically (see the module docstring); this
        replica's view decides while Redis cannot answer."""
        if self._sync is not None and not self._degraded:
            batch = self.view.take()
            try:
                return self._admit_in_redis(self._sync, admission, batch)
            except (RedisError, OSError) as exc:
                self.view.restore(batch)
                self._down("admit", exc)
        refused = first_refused(admission, self.counter)
        if refused is None:
            self.count(admission.increments)
        return refused

    def _admit_in_redis(self, client: syncredis.Redis, admission: Admission,
                        batch: dict[str, Table]) -> int | None:
        keys: dict[str, int] = {}

        def key(table: str) -> int:
            return keys.setdefault(self.prefix + table, len(keys) + 1)

        def entries(increments: Iterable[Increment]) -> list[Any]:
            out: list[Any] = []
            for table, field, amount, expires in increments:
                out += [key(table), field, amount, math.ceil(expires) if expires else 0]
            return out

        pending = [(t, f, a, self.view.expires.get(t, 0.0))
                   for t, fields in batch.items() for f, a in fields.items()]
        args: list[Any] = [len(pending), *entries(pending), len(admission.limits)]
        for limit in admission.limits:
            args.append(len(limit.fields))
            for table, field in limit.fields:
                args += [key(table), field]
            args += [limit.ceiling, limit.add]
        args += [len(admission.increments), *entries(admission.increments)]
        report = list(dict.fromkeys([*((t, f) for t, f, _, _ in pending),
                                     *(tf for limit in admission.limits for tf in limit.fields),
                                     *((t, f) for t, f, _, _ in admission.increments)]))
        args.append(len(report))
        for table, field in report:
            args += [key(table), field]
        with unguarded():
            reply = client.eval(_ADMIT, len(keys), *keys, *args)
        for (table, field), value in zip(report, reply[1:], strict=True):
            self.view.set_shared(table, field, int(value))
        for table, _, _, expires in admission.increments:
            if self.view.expires.get(table, 0.0) < expires:
                self.view.expires[table] = expires
        return None if int(reply[0]) == 0 else int(reply[0]) - 1

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

    def start(self, client: aioredis.Redis, admission: syncredis.Redis | None = None) -> None:
        """Begin flushing through ``client`` every ``interval`` seconds; admit through
        ``admission`` (a synchronous client with a short timeout; None: this replica's
        view decides)."""
        self._client = client
        self._sync = admission
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
        if self._sync is not None:
            with contextlib.suppress(RedisError, OSError):
                self._sync.close()
            self._sync = None

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
