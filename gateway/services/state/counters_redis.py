"""Counters shared by replicas through Redis, sent in short batches (see ``counters``).

Layout: one hash per table, ``<prefix>:c:<table>``, field -> integer, expiring
(``EXPIREAT``) when the table does. Every ``interval`` seconds one write (a Lua script,
``counters_redis_write``) sends the pending batch (``HINCRBY`` per field, ``EXPIREAT``
per table) and re-reads the fields this replica consulted lately; its answer holds the
new shared values. ``HINCRBY`` is atomic, so replicas never lose each other's counts.

A request never waits for Redis: ``count`` and ``counter`` only touch the local view.
While Redis is unreachable the batch stays pending (counted locally, sent when Redis
answers again), ``counters_degraded`` is True and the outage is logged once.

**Every write counts once**, also when its answer is lost (Redis stalled past the
timeout and ran it when it resumed, or the connection broke after it was sent): the
write is kept as unsure, counted in the local view, and resolved by the next write
that is answered - applied then if it never ran, not again if it did
(``counters_redis_write``: each write's mark).

**Budget admission is exact across replicas.** `admit` (check every limit, count the
request and its reservation) is one such write: it first adds this replica's pending
batch, then reads the limits' fields, and counts the admission only if every limit
holds - so no two replicas admit on the same remaining allowance. It is a synchronous
call (the metering core is synchronous, like SQLite's admission transaction) bounded by
`admit_timeout` (0.25 s); the answer refreshes the local view of every field it
touched. While Redis is unreachable (or that call gets no answer in time) admission
falls back to this process's share of the room (the outage is reported:
`counters_degraded`, the `state_store_up` gauge, one log line;
``counters.first_refused_alone``: 1 / the processes holding leases, at most what it
admitted lately), a share Redis holds for it from before it was cut off: each write
carries this process's records (``alone_records``: ``<prefix>:a:<limit key>``, a hash of
holder -> record, indexed by slot in ``<prefix>:a-of:<slot>``) and every admission
counts the other holders' shares as used. So the processes stay within the ceiling
whether all of them are cut off or only some (one whose link stalls while the others
are answered: tests/services/state/test_counters_shares.py); an admission whose answer was
lost is reconciled with that view's decision when it is resolved (the call counted once
if it was forwarded, not at all if it was refused). Settlements (what a call used,
counted after its response) still travel in the batches, so a token or cost budget sees
another replica's finished call within one interval.

**Reservations outlive their replica** (``gateway.services.state.leases``): the
admission also records the reservation under this process's lease
(``<prefix>:lease:<holder>``, a key Redis expires itself, ``PX``; listed in the hash
``<prefix>:leases``), in the hash ``<prefix>:c:o`` (no expiry: emptied as calls settle
and dead holders are charged). A write applies a settlement only while the lease key
exists. ``lease_reap`` charges, in one script, every record of a holder whose lease key
is gone (expired, taken over by the process that restarted in its slot, or given back)
and deletes it: exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import redis as syncredis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.net.resolver import unguarded
from gateway.observability import metrics
from gateway.services.state.alone_records import Records, decide_alone
from gateway.services.state.counters import (
    Admission,
    CounterView,
    Increment,
    StoreAway,
    Table,
)
from gateway.services.state.counters_redis_write import (
    ANSWERED_LIFE_MS,
    SCRIPT,
    Shares,
    Write,
    WriteCall,
)
from gateway.services.state.lease_keeper import Lease, LeaseHolding
from gateway.services.state.leases import ORPHANS, Charged, charge_of, parse_held

__all__ = ["RedisCounters"]

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
_SOON = 0.02  # seconds: an admission's own flush follows the last one's by at least this
_SEP = "\x1f"  # between a holder and a records hash in the slot's index (as SCRIPT joins)


class RedisCounters(LeaseHolding):
    """``Counters`` in Redis (see the module docstring). ``start`` with a client."""

    def __init__(self, prefix: str, *, interval: float = 0.25,
                 clock: Callable[[], float] = time.time, forget_after: float = 900.0,
                 url_for_logs: str = "redis") -> None:
        self.prefix = f"{prefix}:c:"
        self.shares_prefix = f"{prefix}:a:"  # the processes' shares, by budget table
        self.shares_index = f"{prefix}:a-of:"  # by slot: each holder's records there
        self.records = Records()
        self._closing = False
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
        self._soon: asyncio.Task[None] | None = None  # a flush right after an admission
        self._soon_at = -math.inf  # (monotonic) when the last one started
        self._flushing = asyncio.Lock()  # (one flush at a time)
        self._degraded = False
        self.marks_prefix = f"{prefix}:write:{secrets.token_hex(8)}:"  # this replica's writes
        self._serial = 0
        self._unsure: list[Write] = []  # writes whose answer never came (oldest first)
        self._answered_marks: list[str] = []  # to keep a minute more (the next write)

    # -- Counters ------------------------------------------------------------------------

    def count(self, increments: Iterable[Increment]) -> None:
        self.view.add(increments)

    def settle(self, holder: str, increments: Iterable[Increment]) -> None:
        """Sent with the next batch, applied only while ``holder``'s lease exists."""
        self.view.add_settling(holder, increments)

    def counter(self, table: str, field: str) -> int:
        return self.view.value(table, field)

    def admit(self, admission: Admission, *, share: bool = True) -> int | None:
        """Check and count in Redis, atomically (see the module docstring); this
        replica's share decides while Redis cannot answer, or (``share`` False) nothing
        does: ``StoreAway``, nothing counted (a write whose answer was lost, if Redis
        ran it after all, is undone when resolved, as a refusal here)."""
        if share:
            self.records.track(admission, self.view.clock())
        client = self._sync
        if client is not None and not self._degraded:
            call = self._call(admission)
            try:
                with unguarded():
                    reply = client.eval(SCRIPT, *call.build(admission, {}))
                refused = self._answered(call, reply)
                self._flush_soon()
                return refused
            except (RedisError, OSError) as exc:
                self._down("admit", exc)
                self._unanswered(call)  # (what it carried counts here meanwhile)
                if not share:
                    raise StoreAway(self._away()) from None
                refused = self._alone(admission)
                if refused is None and call.write.admission:
                    # forwarded: counted here now, in Redis once the write is resolved
                    self._unsure[-1] = replace(call.write, admitted_here=True)
                    self.view.set_unsure(i for w in self._unsure for i in w.counted())
                return refused
        if not share:
            raise StoreAway(self._away())
        refused = self._alone(admission)
        if refused is None:
            self.count(admission.increments)
        return refused

    def _flush_soon(self) -> None:
        """Write this process's records again now rather than within ``interval``: an
        admission's write carried the values read before it, its answer the new ones
        (a stale record holds more of the room than its process may spend)."""
        if self._soon is not None or self._client is None or not self.records.limits:
            return
        wait = self._soon_at + _SOON - time.monotonic()  # (at most one each _SOON)
        try:
            with unguarded():
                self._soon = asyncio.get_running_loop().create_task(
                    self._flush_once(max(0.0, wait)), name="counters-soon")
        except RuntimeError:  # (no loop: a tool; the next flush writes them)
            return

    async def _flush_once(self, wait: float) -> None:
        try:
            if wait:
                await asyncio.sleep(wait)
            self._soon_at = time.monotonic()
            await self.flush()
        except Exception:  # a bug must not be lost in a task nobody awaits
            log.exception("counters: unexpected error while flushing to Redis")
        finally:
            self._soon = None

    def _away(self) -> str:
        return f"Redis at {self.url_for_logs} does not answer"

    def _alone(self, admission: Admission) -> int | None:
        """This process's share decides, the one Redis holds for it
        (``alone_records.decide_alone``), on what it last read and what is counted here
        and not written."""
        return decide_alone(admission, self.records, None if self._closing else self.holder,
                            self.view.known, self.view.unwritten, self._away())

    def _call(self, admission: Admission | None) -> WriteCall:
        """The next write: what is pending (taken), the admission, the unsure writes."""
        batch = tuple(self._entries(self.view.take()))
        settling = tuple((holder, tuple(self._entries(tables)))
                         for holder, tables in self.view.take_settling().items())
        self._serial += 1
        write = Write(f"{self.marks_prefix}{self._serial}", batch, settling,
                      admission.increments if admission is not None else ())
        answered, self._answered_marks = tuple(self._answered_marks), []
        return WriteCall(self.prefix, self.lease_prefix, write, tuple(self._unsure),
                         answered, self._shares())

    def _shares(self) -> Shares:
        """The records this write carries (``alone_records``), after the batch was
        taken: every share decided on alone under a record it deletes is in it."""
        holder = self.holder
        if holder is None or self._closing:
            records: tuple[Any, ...] = ()
        else:
            records = tuple(self.records.due(holder, self.view.shared, self.processes,
                                             self.view.clock(), self._serial))
            self.records.sent(holder, records)
        forget = tuple(self.records.stale(self.view.clock(), self._closing))
        slot = self.lease.slot if self.lease is not None else ""
        return Shares(self.shares_prefix, holder or "",
                      self.shares_index + slot if slot else "", records, forget,
                      self.leases_key)

    def _shares_due(self) -> bool:
        """A record to write or delete (a write is sent for it alone)."""
        holder = self.holder
        now = self.view.clock()
        return bool(self.records.stale(now, self._closing)) or (
            holder is not None and not self._closing and bool(self.records.due(
                holder, self.view.shared, self.processes, now, self._serial + 1)))

    def _answered(self, call: WriteCall, reply: list[Any]) -> int | None:
        """Apply a write's answer to the view: the refused limit (None: admitted)."""
        refused = int(reply[0])
        if refused < 0:  # (resolved as unsure already: never when answered in time)
            raise RedisError("the write was resolved before its answer came")
        if call.write.admission or refused:
            self.others_held = int(reply[1])
        if int(reply[2]):  # (the leases as Redis lists them: a process started lately)
            self.processes = int(reply[2])
        dropped = int(reply[3])
        for number in reply[4:4 + dropped]:
            self._settlements_dropped(call.holders[int(number) - 1])
        for (table, name), value in zip(call.report, reply[4 + dropped:], strict=True):
            self.view.set_shared(table, name, int(value))
        if call.carried:
            resolved = {w.mark for w in call.carried}
            self._unsure = [w for w in self._unsure if w.mark not in resolved]
            self.view.set_unsure(i for w in self._unsure for i in w.counted())
        for table, _, _, expires in call.write.admission:
            if self.view.expires.get(table, 0.0) < expires:
                self.view.expires[table] = expires
        self.records.answered(call.shares.holder, call.shares.records)
        self.records.forgotten(call.shares.forget)
        self._answered_marks.append(call.write.mark)
        return None if refused == 0 else refused - 1

    def _unanswered(self, call: WriteCall) -> None:
        """A write whose answer never came: unsure until a later write resolves it."""
        self._answered_marks[:0] = call.answered
        if not call.write.empty():
            self._unsure.append(call.write)
            self.view.set_unsure(i for w in self._unsure for i in w.counted())

    def _entries(self, batch: dict[str, Table]) -> list[Increment]:
        return [(t, f, a, self.view.expires.get(t, 0.0))
                for t, fields in batch.items() for f, a in fields.items()]

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        """Whole tables from Redis plus what is pending here (the local view if Redis
        cannot be read). A write whose answer was lost is resolved first (a flush): it
        may be in Redis already, and counted here too it would show twice."""
        if self._unsure and self._client is not None:
            await self.flush()
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
        for task in (self._task, self._soon):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._soon = None
        self._closing = True  # (decides nothing alone from now on; its records go)
        if self._client is not None and (self.view.pending or self.view.settling
                                         or self._unsure or self.records.recorded):
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
        """Send the pending batch and settlements, resolve unsure writes and refresh
        the watched values (one script). While Redis is down, nothing is sent until it
        answers a PING (what is not sent stays pending, not unsure)."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        self.view.prune()
        client = self._client
        if client is None:
            return
        watched = self.view.watched_fields()
        if self._degraded:
            try:
                with unguarded():
                    await client.ping()
            except (RedisError, OSError):
                return
        for table, names in self.records.fields().items():  # (the next records' values)
            watched[table] = sorted({*watched.get(table, ()), *names})
        if (self.view.pending or self.view.settling or watched or self._unsure
                or self._shares_due()):
            call = self._call(None)
            try:
                with unguarded():
                    reply = await client.eval(SCRIPT, *call.build(None, watched))
                self._answered(call, reply)
            except (RedisError, OSError) as exc:
                self._unanswered(call)
                self._down("count", exc)
                return
            except asyncio.CancelledError:  # (stopped while it waited: sent or not)
                self._unanswered(call)
                raise
        elif self._answered_marks:  # nothing more to write: the last marks kept a minute
            marks, self._answered_marks = self._answered_marks, []
            try:
                with unguarded():
                    async with client.pipeline(transaction=False) as pipe:
                        for mark in marks:
                            pipe.pexpire(mark, ANSWERED_LIFE_MS)
                        await pipe.execute()
            except (RedisError, OSError) as exc:
                self._answered_marks[:0] = marks
                self._down("count", exc)
                return
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
                shares = self.shares_index + slot  # (those of the process before it here)
                recorded = [str(m) for m in (await client.smembers(shares) if takeover
                                             else ())]
                async with client.pipeline(transaction=True) as pipe:
                    for other, where in index.items():
                        if where == slot and other != holder:
                            pipe.delete(self.lease_prefix + other)
                    for member in recorded:
                        other, _, key = member.partition(_SEP)
                        if other != holder:
                            pipe.hdel(key, other)
                            pipe.srem(shares, member)
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
                self.processes = max(1, sum(1 for n in alive if n))  # (live leases)
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


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))
