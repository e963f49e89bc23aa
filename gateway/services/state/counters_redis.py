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

**Reservations outlive their replica** (``gateway.services.state.leases``): the
admission script also records the reservation under this process's lease
(``<prefix>:lease:<holder>``, a key Redis expires itself, ``PX``; listed in the hash
``<prefix>:leases``), in the hash ``<prefix>:c:o`` (no expiry: emptied as calls settle
and dead holders are charged). A settlement is sent in the batch's transaction by a
script that applies it only while the lease key exists (``_SETTLE``; the admission
script applies pending ones the same way first). ``lease_reap`` charges, in one script,
every record of a holder whose lease key is gone (expired, taken over by the process
that restarted in its slot, or given back) and deletes it: exactly once.
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
from gateway.services.state.lease_keeper import Lease, LeaseHolding
from gateway.services.state.leases import ORPHANS, Charged, charge_of, parse_held

__all__ = ["RedisCounters"]

# ARGV: the pending batch (n, then key index, field, amount, expiry per entry), the
# pending settlements (n holders, then per holder: its lease's key index and a batch,
# applied only if the lease key exists), the limits (n, then per limit: n fields, key
# index and field per field, ceiling, add), the admission's increments (like the
# batch), the fields to report (n, key index and field each). Returns {refused limit
# (1-based) or 0, settlements dropped (a bit per holder), reported values...}.
# (Explicit locals: Lua leaves the order of evaluation of a call's arguments unspecified.)
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
local dropped = 0
for g = 1, tonumber(take()) do
  local lease = KEYS[tonumber(take())]
  local n = tonumber(take())
  if redis.call('EXISTS', lease) == 1 then apply(n) else
    at = at + 4 * n
    dropped = dropped + 2 ^ (g - 1)
  end
end
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
local out = {refused, dropped}
for _ = 1, tonumber(take()) do
  local key = KEYS[tonumber(take())]
  local field = take()
  out[#out + 1] = tonumber(redis.call('HGET', key, field)) or 0
end
return out
"""

# One holder's settlements, applied only while its lease exists. KEYS[1]: the lease;
# ARGV: key index, field, amount, expiry per entry. Returns {1, new values...} or {0}.
_SETTLE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0} end
local out = {1}
for i = 1, #ARGV, 4 do
  local key = KEYS[tonumber(ARGV[i])]
  out[#out + 1] = redis.call('HINCRBY', key, ARGV[i + 1], ARGV[i + 2])
  local expires = tonumber(ARGV[i + 3])
  if expires > 0 then redis.call('EXPIREAT', key, expires) end
end
return out
"""

# Charge dead holders' records, once. KEYS[1]: the records hash, KEYS[2]: the leases
# index. ARGV: the lease key to give back (index, 0: none); the holders found dead (n,
# then lease key index and holder), each checked again here; the records (n, then
# field, holder number (0: not a record: deleted), table key index, charged field
# ('' : none), reserved field); the records to drop if still 0 (n, then fields).
# Returns {field, amount, ...} of what was charged.
_REAP = """
local at = 0
local function take() at = at + 1 return ARGV[at] end
local release = tonumber(take())
if release > 0 then redis.call('DEL', KEYS[release]) end
local dead = {}
for i = 1, tonumber(take()) do
  local lease = KEYS[tonumber(take())]
  local holder = take()
  dead[i] = redis.call('EXISTS', lease) == 0
  if dead[i] then redis.call('HDEL', KEYS[2], holder) end
end
local out = {}
for _ = 1, tonumber(take()) do
  local field = take()
  local who = tonumber(take())
  local key = KEYS[tonumber(take())]
  local target = take()
  local source = take()
  if who == 0 or dead[who] then
    local value = tonumber(redis.call('HGET', KEYS[1], field))
    if value then
      redis.call('HDEL', KEYS[1], field)
      if value > 0 and target ~= '' and redis.call('EXISTS', key) == 1 then
        redis.call('HINCRBY', key, target, value)
        redis.call('HINCRBY', key, source, -value)
        out[#out + 1] = field
        out[#out + 1] = value
      end
    end
  end
end
for _ = 1, tonumber(take()) do
  local field = take()
  if redis.call('HGET', KEYS[1], field) == '0' then redis.call('HDEL', KEYS[1], field) end
end
return out
"""

log = logging.getLogger("sandbox_gateway.counters")


class RedisCounters(LeaseHolding):
    """``Counters`` in Redis (see the module docstring). ``start`` with a client."""

    def __init__(self, prefix: str, *, interval: float = 0.25,
                 clock: Callable[[], float] = time.time, forget_after: float = 900.0,
                 url_for_logs: str = "redis") -> None:
        self.prefix = f"{prefix}:c:"
        self.lease_prefix = f"{prefix}:lease:"
        self.leases_key = f"{prefix}:leases"
        self.lease: Lease | None = None
        self._dropped: set[str] = set()
        self._dropped_log = (log, "counters: settlements of calls admitted under lease %s "
                             "were not sent: the lease was found dead and their reservations "
                             "charged in full")
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

    def settle(self, holder: str, increments: Iterable[Increment]) -> None:
        """Sent with the next batch, applied only while ``holder``'s lease exists."""
        self.view.add_settling(holder, increments)

    def counter(self, table: str, field: str) -> int:
        return self.view.value(table, field)

    def admit(self, admission: Admission) -> int | None:
        """Check and count in Redis, atomically (see the module docstring); this
        replica's view decides while Redis cannot answer."""
        if self._sync is not None and not self._degraded:
            try:
                with self.view.sending() as (batch, settling):
                    return self._admit_in_redis(self._sync, admission, batch, settling)
            except (RedisError, OSError) as exc:
                self._down("admit", exc)
        refused = first_refused(admission, self.counter)
        if refused is None:
            self.count(admission.increments)
        return refused

    def _admit_in_redis(self, client: syncredis.Redis, admission: Admission,
                        batch: dict[str, Table],
                        settling: dict[str, dict[str, Table]]) -> int | None:
        keys: dict[str, int] = {}

        def key(table: str) -> int:
            return keys.setdefault(self.prefix + table, len(keys) + 1)

        def entries(increments: Iterable[Increment]) -> list[Any]:
            out: list[Any] = []
            for table, field, amount, expires in increments:
                out += [key(table), field, amount, _expiry(table, expires)]
            return out

        pending = self._entries(batch)
        settled = {holder: self._entries(tables) for holder, tables in settling.items()}
        holders = list(settled)
        args: list[Any] = [len(pending), *entries(pending), len(holders)]
        for holder in holders:
            lease = keys.setdefault(self.lease_prefix + holder, len(keys) + 1)
            args += [lease, len(settled[holder]), *entries(settled[holder])]
        args.append(len(admission.limits))
        for limit in admission.limits:
            args.append(len(limit.fields))
            for table, field in limit.fields:
                args += [key(table), field]
            args += [limit.ceiling, limit.add]
        args += [len(admission.increments), *entries(admission.increments)]
        report = list(dict.fromkeys([
            *((t, f) for t, f, _, _ in pending),
            *((t, f) for entries_ in settled.values() for t, f, _, _ in entries_),
            *(tf for limit in admission.limits for tf in limit.fields),
            *((t, f) for t, f, _, _ in admission.increments)]))
        args.append(len(report))
        for table, field in report:
            args += [key(table), field]
        with unguarded():
            reply = client.eval(_ADMIT, len(keys), *keys, *args)
        for (table, field), value in zip(report, reply[2:], strict=True):
            self.view.set_shared(table, field, int(value))
        for i, holder in enumerate(holders):
            if int(reply[1]) >> i & 1:
                self._settlements_dropped(holder)
        for table, _, _, expires in admission.increments:
            if self.view.expires.get(table, 0.0) < expires:
                self.view.expires[table] = expires
        return None if int(reply[0]) == 0 else int(reply[0]) - 1

    def _entries(self, batch: dict[str, Table]) -> list[Increment]:
        return [(t, f, a, self.view.expires.get(t, 0.0))
                for t, fields in batch.items() for f, a in fields.items()]

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
        """Stop flushing; send what is pending (best effort, within ``timeout``); give
        the lease back (what never settled is charged)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is not None and (self.view.pending or self.view.settling):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flush(), timeout)
        if self.lease is not None and self._client is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lease.stop(), timeout)
        self.lease = None
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
        try:
            with self.view.sending() as (batch, settling):
                watched = self.view.watched_fields()
                if not batch and not watched and not settling:
                    if self._degraded:
                        try:
                            with unguarded():
                                await client.ping()
                        except (RedisError, OSError):
                            return
                        self._up()
                    return
                # What each reply is: ("add", table, field), ("expire", table, None),
                # ("settle", holder, its entries), ("read", table, fields).
                plan: list[tuple[str, str, Any]] = []
                with unguarded():
                    async with client.pipeline(transaction=True) as pipe:
                        for table, fields in batch.items():
                            key = self.prefix + table
                            for field, amount in fields.items():
                                pipe.hincrby(key, field, amount)
                                plan.append(("add", table, field))
                            expire_at = _expiry(table, self.view.expires.get(table, 0.0))
                            if expire_at:
                                pipe.expireat(key, expire_at)
                                plan.append(("expire", table, None))
                        for holder, tables in settling.items():
                            entries = self._entries(tables)
                            keys = list(dict.fromkeys(self.prefix + t for t, _, _, _ in entries))
                            args: list[Any] = []
                            for table, field, amount, expires in entries:
                                args += [keys.index(self.prefix + table) + 2, field, amount,
                                         _expiry(table, expires)]
                            pipe.eval(_SETTLE, len(keys) + 1, self.lease_prefix + holder, *keys,
                                      *args)
                            plan.append(("settle", holder, entries))
                        for table, wanted in watched.items():
                            pipe.hmget(self.prefix + table, wanted)
                            plan.append(("read", table, wanted))
                        replies = await pipe.execute()
        except (RedisError, OSError) as exc:
            self._down("count", exc)
            return
        for (what, name, detail), reply in zip(plan, replies, strict=True):
            if what == "add":
                self.view.set_shared(name, detail, int(reply))
            elif what == "read":
                for field, value in zip(detail, reply, strict=True):
                    self.view.set_shared(name, field, int(value) if value is not None else 0)
            elif what == "settle":
                if not int(reply[0]):
                    self._settlements_dropped(name)
                    continue
                for (table, field, _, _), value in zip(detail, reply[1:], strict=True):
                    self.view.set_shared(table, field, int(value))
        self._up()

    # -- leases (``leases.LeaseStore``; ``holder``, ``take_lease``: ``LeaseHolding``) --------

    async def lease_claim(self, holder: str, slot: str, ttl: float, takeover: bool) -> bool:
        client = self._client
        if client is None:
            return False
        try:
            with unguarded():
                index: dict[str, str] = {
                    str(k): str(v) for k, v in (
                        await client.hgetall(self.leases_key) if takeover else {}).items()}
                async with client.pipeline(transaction=True) as pipe:
                    for other, where in index.items():
                        if where == slot and other != holder:
                            pipe.delete(self.lease_prefix + other)
                    pipe.set(self.lease_prefix + holder, slot, px=_ms(ttl))
                    pipe.hset(self.leases_key, holder, slot)
                    await pipe.execute()
        except (RedisError, OSError) as exc:
            self._down("lease", exc)
            return False
        return True

    async def lease_renew(self, holder: str, ttl: float) -> bool | None:
        client = self._client
        if client is None:
            return None
        try:
            with unguarded():
                return bool(await client.pexpire(self.lease_prefix + holder, _ms(ttl)))
        except (RedisError, OSError) as exc:
            self._down("lease", exc)
            return None

    async def lease_reap(self, release: str | None) -> list[Charged] | None:
        """Find the dead holders, then charge their records in one script (which
        checks again that each is dead: exactly once)."""
        client = self._client
        if client is None:
            return None
        records_key = self.prefix + ORPHANS
        try:
            with unguarded():
                records = {str(k): str(v) for k, v in
                           (await client.hgetall(records_key)).items()}
                index = {str(k) for k in await client.hgetall(self.leases_key)}
                held = {name: parse_held(name) for name in records}
                holders = sorted({h[0] for h in held.values() if h is not None} | set(index))
                async with client.pipeline(transaction=False) as pipe:
                    for holder in holders:
                        pipe.exists(self.lease_prefix + holder)
                    alive = await pipe.execute()
                dead = [h for h, n in zip(holders, alive, strict=True)
                        if not n or h == release]
                if not dead and "0" not in records.values():
                    return []
                keys: dict[str, int] = {records_key: 1, self.leases_key: 2}

                def key(name: str) -> int:
                    return keys.setdefault(name, len(keys) + 1)

                args: list[Any] = [key(self.lease_prefix + release) if release else 0,
                                   len(dead)]
                for holder in dead:
                    args += [key(self.lease_prefix + holder), holder]
                number = {h: i + 1 for i, h in enumerate(dead)}
                charged: list[Any] = []
                for name, parsed in held.items():
                    if parsed is None:
                        charged += [name, 0, 1, "", ""]
                    elif parsed[0] in number:
                        charged += [name, number[parsed[0]], key(self.prefix + parsed[1]),
                                    charge_of(parsed[2]) or "", parsed[2]]
                zero = [name for name, value in records.items() if value == "0"]
                args += [len(charged) // 5, *charged, len(zero), *zero]
                reply = await client.eval(_REAP, len(keys), *keys, *args)
        except (RedisError, OSError) as exc:
            self._down("lease", exc)
            return None
        out = []
        for name, amount in zip(reply[::2], reply[1::2], strict=True):
            parsed = parse_held(str(name))
            if parsed is not None:
                out.append(Charged(parsed[0], parsed[1], parsed[2], int(amount)))
        return out

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


def _expiry(table: str, expires: float) -> int:
    """A table's EXPIREAT (0: none; the reservations' records have none: they are
    emptied as calls settle and dead holders are charged)."""
    return 0 if table == ORPHANS or not expires else math.ceil(expires)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))
