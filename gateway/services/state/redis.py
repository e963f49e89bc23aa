"""Shared gateway state in Redis, mirrored in memory so lookups never do I/O.

Every replica keeps a local mirror of the revoked token ids and the registered sandbox
addresses. `start()` loads both from Redis and subscribes to `<prefix>:events`; a
background task applies the events other replicas publish, re-syncs fully every
`resync_interval` seconds (a safety net for lost pub/sub messages) and, when Redis goes
away, reconnects with backoff and re-syncs fully (events may have been missed).

Layout in Redis (`prefix` defaults to `sandbox-gateway`):
- `<prefix>:revoked:<jti>` = `1`, expiring (`EXAT`) when the token would expire anyway;
- `<prefix>:sandboxes`, a hash ip -> `{"sandbox": ..., "policy": ...}` (JSON);
- `<prefix>:ephemeral:<sha256 of the alias>` = `{"credential", "sandbox", "value",
  "alias", "exp"}` (JSON), a secret a provider minted for a sandbox and the alias the
  sandbox holds in its place, expiring with it (`EXAT`);
- `<prefix>:mint:<credential cache name>` = `{"value", "parts", "minted_at",
  "expires_at", "due_at"}` (JSON), a credential the gateway minted, expiring with it,
  and `<prefix>:mintlease:<name>` = the process minting it now (`PX`, see
  `gateway.services.minting.shared`); `<prefix>:refresh-tokens`, a hash key -> `[origin, value]`
  of rotated OAuth2 refresh tokens;
- `<prefix>:events`, a pub/sub channel of JSON changes (`revoke`, `register`,
  `unregister`, `ephemeral`, and `record` with the kind of a shared record written:
  ask mode's grants, approvals and tool pins, which their watchers then re-read); each
  write and its event go in one MULTI/EXEC (a record's, in its script), so every
  replica sees changes in the order Redis applied them.

Counters (usage, budgets) are hashes `<prefix>:c:<table>` sent in batches by
`gateway.services.state.counters_redis.RedisCounters` on its own beat; see that module.
It also keeps each process's lease (`<prefix>:lease:<holder>`, listed in the hash
`<prefix>:leases`): the holder budget reservations are recorded under
(`gateway.services.state.leases`).

Trade-offs while Redis is unreachable (`sandbox_gateway_state_store_up{store="redis"}`
is 0 and the outage is logged once):
- reads keep answering from the last mirror: a token revoked elsewhere during the outage
  stays usable here until Redis is back (bounded by the token's own expiry), and
  sandboxes keep their last known registration. Refusing every request instead would
  turn a Redis outage into a full gateway outage.
- writes fail closed: they raise `StateUnavailable` (the admin API answers 503). A
  revocation still takes effect on this replica at once (on each of its worker processes
  through the supervisor's relay, `identity/revocations.py`, which also retries the write
  every second) and is written to Redis when it is back: revocations only ever grow, so
  each full re-sync re-seeds the ones Redis lost (a restart without persistence).
  Registrations are not applied locally on failure: Redis is their source of truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis as syncredis
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry as SyncRetry

from gateway.core.secret_value import SecretValue
from gateway.net.resolver import unguarded
from gateway.observability import metrics
from gateway.services.secrets.ephemeral import EphemeralKey, EphemeralKeys
from gateway.services.state.base import SandboxAddress, SharedMint, StateUnavailable
from gateway.services.state.counters import CountersOf
from gateway.services.state.counters_redis import RedisCounters
from gateway.services.state.log import RETAIN, LogEntry, LogQuery, entry_bytes

log = logging.getLogger("sandbox_gateway.state")

_STORE = "redis"
_SCAN_BATCH = 1000
# A credential's mint lease: taken if free (or held by the same process: extended).
_LOG_FIELDS = ("a", "s", "p", "h", "d", "c", "e", "l")
_LOG_CHUNK = 1000
_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def _log_entry(values: dict[Any, Any]) -> LogEntry | None:
    try:
        at, *rest = (values[k] for k in _LOG_FIELDS)
        return LogEntry(float(at), *(str(v) for v in rest))
    except (KeyError, ValueError, TypeError):
        metrics.STATE_STORE_ERRORS.labels(op="decode").inc()
        return None


_LEASE = ("local held = redis.call('get', KEYS[1]) "
          "if held == false or held == ARGV[1] then "
          "redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end return 0")
# Given back only by its holder.
_RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) end return 0")
# A shared record ("<rev>|<json>") written if new (ARGV[1] -1) or at revision ARGV[1];
# KEYS[2] indexes a kind's keys (ARGV[4]); ARGV[3]: its lifetime in milliseconds.
_RECORD_PUT = ("local cur = redis.call('get', KEYS[1]) local want = tonumber(ARGV[1]) "
               "if want < 0 then if cur then return 0 end else "
               "if not cur then return 0 end "
               "local bar = string.find(cur, '|', 1, true) "
               "if tonumber(string.sub(cur, 1, bar - 1)) ~= want then return 0 end end "
               "local rev = 1 if want >= 0 then rev = want + 1 end "
               "redis.call('set', KEYS[1], rev .. '|' .. ARGV[2], 'PX', ARGV[3]) "
               "redis.call('sadd', KEYS[2], ARGV[4]) "
               "redis.call('publish', ARGV[5], ARGV[6]) return 1")


def redact_url(url: str) -> str:
    """`url` without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisState(CountersOf):
    """`StateStore` shared by every replica through Redis (see the module docstring)."""

    _counters: RedisCounters

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "sandbox-gateway",
        resync_interval: float = 30.0,
        op_timeout: float = 2.0,
        start_timeout: float = 10.0,
        backoff: tuple[float, float] = (0.1, 5.0),
        clock: Callable[[], float] = time.time,
        counter_interval: float = 0.25,
        admit_timeout: float = 0.25,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.channel = f"{prefix}:events"
        self.sandboxes_key = f"{prefix}:sandboxes"
        self._revoked_prefix = f"{prefix}:revoked:"
        self._ephemeral_prefix = f"{prefix}:ephemeral:"
        self._mint_prefix = f"{prefix}:mint:"
        self._lease_prefix = f"{prefix}:mintlease:"
        self._log_key = f"{prefix}:log"
        self.log_retain = RETAIN
        self.log_retain_bytes = 0
        self._entry_bytes = 0.0  # the entries' mean size so far (a bound in bytes)
        self._refresh_key = f"{prefix}:refresh-tokens"
        self.ephemeral = EphemeralKeys(clock)
        self.ephemeral.share = self._share_ephemeral
        self._writes: set[asyncio.Task[None]] = set()
        self.resync_interval = resync_interval
        self.op_timeout = op_timeout
        self.admit_timeout = admit_timeout
        self.start_timeout = start_timeout
        self.backoff = backoff
        self.clock = clock
        self._revoked: dict[str, float] = {}
        self._sandboxes: dict[str, SandboxAddress] = {}
        self._record_versions: dict[str, int] = {}  # record writes heard of, by kind
        self._records_synced = 0  # full re-syncs (each may follow missed events)
        self._wakeup: asyncio.Event | None = None  # (record_wakeup)
        self._redis: aioredis.Redis | None = None
        self._sub_client: aioredis.Redis | None = None
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self._up = False
        self._next_resync = 0.0
        self._next_prune = 0.0
        self._counters = RedisCounters(prefix, interval=counter_interval, clock=clock,
                                       url_for_logs=redact_url(url))

    # -- counters (synchronous, local; shared in batches) -------------------------------

    async def flush_counters(self) -> None:
        """Send pending counts now (tests, shutdown); normally done every interval."""
        await self._counters.flush()

    # -- lookups (synchronous, local, no I/O) -----------------------------------------

    def is_revoked(self, jti: str) -> bool:
        expires_at = self._revoked.get(jti)
        return expires_at is not None and expires_at > self.clock()

    def sandbox_for(self, ip: str) -> SandboxAddress | None:
        return self._sandboxes.get(ip)

    def sandboxes(self) -> list[SandboxAddress]:
        return list(self._sandboxes.values())

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

    # -- changes ----------------------------------------------------------------------

    async def revoke(self, jti: str, expires_at: float) -> None:
        """Revoke `jti` until `expires_at` here at once, and on every replica via Redis."""
        exat = math.ceil(expires_at)
        if exat <= self.clock():
            return  # the token has expired: it is refused regardless
        self._apply_revoke(jti, float(exat))
        event = {"op": "revoke", "jti": jti, "exp": exat}

        def write(pipe: Any) -> None:
            pipe.set(self._revoked_prefix + jti, "1", exat=exat)
            pipe.publish(self.channel, json.dumps(event))

        await self._transaction("revoke", write,
                                f"revocation of {jti} holds on this replica only")

    async def register_sandbox(self, entry: SandboxAddress) -> None:
        """Register `entry.ip` for every replica."""
        value = json.dumps({"sandbox": entry.sandbox, "policy": entry.policy})
        event = {"op": "register", "ip": entry.ip, "sandbox": entry.sandbox,
                 "policy": entry.policy}

        def write(pipe: Any) -> None:
            pipe.hset(self.sandboxes_key, entry.ip, value)
            pipe.publish(self.channel, json.dumps(event))

        await self._transaction("register", write, f"sandbox {entry.ip} is not registered")
        self._sandboxes[entry.ip] = entry

    async def unregister_sandbox(self, ip: str) -> bool:
        """Forget `ip` on every replica; True if it was registered."""
        event = {"op": "unregister", "ip": ip}

        def write(pipe: Any) -> None:
            pipe.hdel(self.sandboxes_key, ip)
            pipe.publish(self.channel, json.dumps(event))

        results = await self._transaction("unregister", write,
                                          f"sandbox {ip} is still registered")
        local = self._sandboxes.pop(ip, None) is not None
        return bool(results[0]) or local

    def _share_ephemeral(self, key: EphemeralKey) -> None:
        """Write a minted secret for the other replicas, in the background (the caller
        is synchronous); this replica knows it already."""
        task = asyncio.get_running_loop().create_task(self._write_ephemeral(key))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write_ephemeral(self, key: EphemeralKey) -> None:
        exat = math.ceil(key.expires_at)
        event = {"op": "ephemeral", "credential": key.credential, "sandbox": key.sandbox,
                 "value": key.value.reveal(),
                 "alias": key.alias.reveal() if key.alias is not None else None, "exp": exat}

        def write(pipe: Any) -> None:
            pipe.set(self._ephemeral_prefix + key.digest, json.dumps(event), exat=exat)
            pipe.publish(self.channel, json.dumps(event))

        with contextlib.suppress(StateUnavailable):  # (logged and counted there)
            await self._transaction("ephemeral", write,
                                    "a provider-minted secret is known to this replica only")

    def _apply_ephemeral(self, event: dict[str, Any]) -> None:
        alias = event.get("alias")
        self.ephemeral.add(EphemeralKey(str(event["credential"]), str(event["sandbox"]),
                                        SecretValue(str(event["value"])),
                                        float(event["exp"]),
                                        SecretValue(alias) if isinstance(alias, str) and alias
                                        else None), shared=True)

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

    # -- minted credentials (`MintShare`, see gateway.services.minting.shared) ------------------

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

    async def read_mint(self, name: str) -> SharedMint | None:
        raw = await self._op("mint", lambda r: r.get(self._mint_prefix + name))
        if raw is None:
            return None
        try:
            data = json.loads(str(raw))
            return SharedMint(str(data["value"]), tuple(str(p) for p in data["parts"]),
                              float(data["minted_at"]), None if data["expires_at"] is None
                              else float(data["expires_at"]), float(data["due_at"]))
        except (ValueError, KeyError, TypeError):
            metrics.STATE_STORE_ERRORS.labels(op="decode").inc()
            return None  # (minted anew and overwritten)

    async def lease_mint(self, name: str, holder: str, until: float) -> bool:
        ms = max(1, math.ceil((until - self.clock()) * 1000))
        held = await self._op("mint", lambda r: r.eval(
            _LEASE, 1, self._lease_prefix + name, holder, ms))
        return bool(held)

    async def write_mint(self, name: str, mint: SharedMint, holder: str) -> None:
        data = json.dumps({"value": mint.value, "parts": list(mint.parts),
                           "minted_at": mint.minted_at, "expires_at": mint.expires_at,
                           "due_at": mint.due_at})
        exat = None if mint.expires_at is None else math.ceil(mint.expires_at)

        async def write(r: Any) -> None:
            async with r.pipeline(transaction=True) as pipe:
                pipe.set(self._mint_prefix + name, data, exat=exat)
                pipe.eval(_RELEASE, 1, self._lease_prefix + name, holder)
                await pipe.execute()

        await self._op("mint", write)

    async def release_mint(self, name: str, holder: str) -> None:
        with contextlib.suppress(StateUnavailable):  # (the lease lapses by itself)
            await self._op("mint", lambda r: r.eval(_RELEASE, 1, self._lease_prefix + name,
                                                    holder))

    # -- shared records (`Records`: approvals, grants) ------------------------------------

    def _record_key(self, kind: str, key: str) -> str:
        return f"{self.prefix}:record:{kind}:{key}"

    @staticmethod
    def _parse_record(raw: object) -> tuple[dict[str, Any], int] | None:
        rev, _, doc = str(raw).partition("|")
        try:
            return json.loads(doc), int(rev)
        except ValueError:
            metrics.STATE_STORE_ERRORS.labels(op="decode").inc()
            return None

    async def record_get(self, kind: str, key: str) -> tuple[dict[str, Any], int] | None:
        raw = await self._op("record", lambda r: r.get(self._record_key(kind, key)))
        return None if raw is None else self._parse_record(raw)

    async def record_list(self, kind: str) -> list[dict[str, Any]]:
        index = f"{self.prefix}:records:{kind}"

        async def read(r: Any) -> list[dict[str, Any]]:
            keys = sorted(await r.smembers(index))
            values = await r.mget([self._record_key(kind, k) for k in keys]) if keys else []
            gone = [k for k, v in zip(keys, values, strict=True) if v is None]
            if gone:
                await r.srem(index, *gone)  # (expired: forgotten by the index too)
            return [p[0] for v in values if v is not None
                    and (p := self._parse_record(v)) is not None]

        return list(await self._op("record", read))

    async def record_put(self, kind: str, key: str, doc: dict[str, Any], expires_at: float,
                         rev: int | None) -> bool:
        ms = max(1, math.ceil((expires_at - self.clock()) * 1000))
        event = json.dumps({"op": "record", "kind": kind})
        written = await self._op("record", lambda r: r.eval(
            _RECORD_PUT, 2, self._record_key(kind, key), f"{self.prefix}:records:{kind}",
            -1 if rev is None else rev, json.dumps(doc, separators=(",", ":")), ms, key,
            self.channel, event))
        if written:
            self._record_changed(kind)
        return bool(written)

    def record_version(self, kind: str) -> int:
        """Raised by every record of `kind` written (the `record` events on the channel,
        and this replica's own writes) and by every full re-sync (events may have been
        missed meanwhile)."""
        return self._records_synced + self._record_versions.get(kind, 0)

    def _record_changed(self, kind: str) -> None:
        self._record_versions[kind] = self._record_versions.get(kind, 0) + 1
        if self._wakeup is not None:
            self._wakeup.set()

    def record_wakeup(self) -> asyncio.Event:
        """Set by every record write this replica makes or hears on the channel, and by
        every full re-sync."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        return self._wakeup

    async def read_refresh(self, key: str) -> tuple[str, str] | None:
        raw = await self._op("refresh", lambda r: r.hget(self._refresh_key, key))
        if raw is None:
            return None
        origin, value = json.loads(str(raw))
        return str(origin), str(value)

    async def write_refresh(self, key: str, origin: str, value: str) -> None:
        await self._op("refresh", lambda r: r.hset(self._refresh_key, key,
                                                   json.dumps([origin, value])))

    # -- the request log (`state/log.py`): a stream capped near its bound ----------------

    def _log_cap(self) -> int:
        """The stream's length bound: `log_retain` entries and, for `log_retain_bytes`,
        as many entries as fit at the mean size seen so far (so near, not exact)."""
        caps = [self.log_retain] if self.log_retain else []
        if self.log_retain_bytes:
            caps.append(max(1, int(self.log_retain_bytes / (self._entry_bytes or 1024))))
        return min(caps) if caps else RETAIN

    async def log_append(self, entries: Sequence[LogEntry]) -> None:
        if entries:
            mean = sum(map(entry_bytes, entries)) / len(entries)
            self._entry_bytes = mean if not self._entry_bytes else \
                0.9 * self._entry_bytes + 0.1 * mean
        cap = self._log_cap()

        async def add(r: Any) -> None:
            pipe = r.pipeline(transaction=False)
            for e in entries:
                pipe.xadd(self._log_key, dict(zip(_LOG_FIELDS, e, strict=True)),
                          maxlen=cap, approximate=True)
            await pipe.execute()

        await self._op("log", add)

    async def log_read(self, query: LogQuery, limit: int, *, before: str | None = None,
                       after: str | None = None) -> list[tuple[str, LogEntry]]:
        """Read in chunks, filtered here (a stream has no query language), at most the
        retained entries."""
        out: list[tuple[str, LogEntry]] = []
        edge = f"({after}" if after is not None else f"({before}" if before else None
        for _ in range(max(1, self._log_cap() // _LOG_CHUNK + 1)):
            chunk = await self._op("log", functools.partial(self._log_chunk, edge,
                                                            after is not None))
            for ident, values in chunk:
                entry = _log_entry(values)
                if entry is not None and query.matches(entry):
                    out.append((str(ident), entry))
                    if len(out) >= limit:
                        return out
            if len(chunk) < _LOG_CHUNK:
                break
            edge = f"({chunk[-1][0]}"
        return out

    async def _log_chunk(self, edge: str | None, forward: bool, r: Any) -> Any:
        if forward:
            return await r.xrange(self._log_key, min=edge, max="+", count=_LOG_CHUNK)
        return await r.xrevrange(self._log_key, max=edge or "+", min="-", count=_LOG_CHUNK)

    async def log_get(self, cursor: str) -> LogEntry | None:
        if not _STREAM_ID.fullmatch(cursor):
            return None
        found = await self._op("log", lambda r: r.xrange(self._log_key, min=cursor,
                                                         max=cursor, count=1))
        return _log_entry(found[0][1]) if found else None

    async def log_last(self) -> str:
        found = await self._op("log", lambda r: r.xrevrange(self._log_key, count=1))
        return str(found[0][0]) if found else "0"

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
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
        # Budget admission's own connection: synchronous (the metering core is), short
        # timeouts (a request waits at most that long before its replica's view decides).
        admission = syncredis.Redis.from_url(
            self.url, decode_responses=True, socket_timeout=self.admit_timeout,
            socket_connect_timeout=self.admit_timeout, retry=SyncRetry(NoBackoff(), 0))
        self._counters.start(self._redis, admission)

    async def close(self) -> None:
        """Stop following, send pending counts (best effort), close both connections."""
        for task in list(self._writes):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, self.op_timeout)
        await self._counters.close()
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

    # -- synchronisation --------------------------------------------------------------

    async def resync(self) -> None:
        """Replace the mirror with Redis's state (revocations: union, re-seeding any
        Redis lost). Raises RedisError/OSError when Redis is unreachable."""
        assert self._redis is not None
        redis = self._redis
        with unguarded():
            keys = [k async for k in redis.scan_iter(
                match=_glob_escape(self._revoked_prefix) + "*", count=_SCAN_BATCH)]
            ttls: list[Any] = []
            for i in range(0, len(keys), _SCAN_BATCH):
                async with redis.pipeline(transaction=False) as pipe:
                    for key in keys[i:i + _SCAN_BATCH]:
                        pipe.pttl(key)
                    ttls.extend(await pipe.execute())
            raw_sandboxes = {str(k): str(v)
                             for k, v in (await redis.hgetall(self.sandboxes_key)).items()}
            minted = [k async for k in redis.scan_iter(
                match=_glob_escape(self._ephemeral_prefix) + "*", count=_SCAN_BATCH)]
            minted_values = [v for i in range(0, len(minted), _SCAN_BATCH)
                             for v in await redis.mget(minted[i:i + _SCAN_BATCH])]
            now = self.clock()
            remote: dict[str, float] = {}
            for key, ttl in zip(keys, ttls, strict=True):
                if ttl == -2:
                    continue  # expired between SCAN and PTTL
                remote[key[len(self._revoked_prefix):]] = (
                    math.inf if ttl == -1 else now + ttl / 1000.0)
            lost = {j: exp for j, exp in self._revoked.items()
                    if j not in remote and exp > now + 1}
            if lost:
                async with redis.pipeline(transaction=False) as pipe:
                    for jti, exp in lost.items():
                        exat = None if math.isinf(exp) else math.ceil(exp)
                        pipe.set(self._revoked_prefix + jti, "1", exat=exat, nx=True)
                    await pipe.execute()
                log.warning("state store: re-seeded %d revocation(s) missing from Redis",
                            len(lost))
        merged = {j: exp for j, exp in self._revoked.items() if exp > now}
        for jti, exp in remote.items():
            merged[jti] = max(exp, merged.get(jti, 0.0))
        self._revoked = merged
        sandboxes: dict[str, SandboxAddress] = {}
        for ip, text in raw_sandboxes.items():
            entry = self._parse_sandbox(ip, text)
            if entry is not None:
                sandboxes[ip] = entry
        self._sandboxes = sandboxes
        for value in minted_values:
            if value is None:
                continue  # expired between SCAN and MGET
            try:
                self._apply_ephemeral(json.loads(str(value)))
            except (ValueError, KeyError, TypeError):
                metrics.STATE_STORE_ERRORS.labels(op="decode").inc()
                log.warning("state store: ignoring a malformed minted-secret entry")
        self._records_synced += 1
        if self._wakeup is not None:
            self._wakeup.set()
        self._next_resync = asyncio.get_running_loop().time() + self.resync_interval

    def _parse_sandbox(self, ip: str, text: str) -> SandboxAddress | None:
        try:
            data = json.loads(text)
            return SandboxAddress(sandbox=str(data["sandbox"]), ip=ip,
                                  policy=str(data["policy"]))
        except (ValueError, KeyError, TypeError):
            metrics.STATE_STORE_ERRORS.labels(op="decode").inc()
            log.warning("state store: ignoring malformed sandbox entry for %s in %s",
                        ip, self.sandboxes_key)
            return None

    def _apply_revoke(self, jti: str, expires_at: float) -> None:
        self._revoked[jti] = max(expires_at, self._revoked.get(jti, 0.0))

    def _apply_event(self, data: object) -> None:
        """Apply one change published by a replica (this one included: applying every
        event in channel order makes all mirrors converge to Redis's order)."""
        try:
            event = json.loads(str(data))
            op = event["op"]
            if op == "revoke":
                self._apply_revoke(str(event["jti"]), float(event["exp"]))
            elif op == "register":
                ip = str(event["ip"])
                self._sandboxes[ip] = SandboxAddress(sandbox=str(event["sandbox"]), ip=ip,
                                                     policy=str(event["policy"]))
            elif op == "unregister":
                self._sandboxes.pop(str(event["ip"]), None)
            elif op == "ephemeral":
                self._apply_ephemeral(event)
            elif op == "record":
                self._record_changed(str(event["kind"]))
            else:
                raise ValueError(op)
        except (ValueError, KeyError, TypeError):
            metrics.STATE_STORE_ERRORS.labels(op="decode").inc()
            # (never the event itself: a minted-secret event carries a secret)
            log.warning("state store: ignoring a malformed event on %s", self.channel)

    def _prune(self) -> None:
        """Drop revocations past their expiry (their tokens are refused regardless)."""
        now = self.clock()
        for jti in [j for j, exp in self._revoked.items() if exp <= now]:
            del self._revoked[jti]

    def revoked_ids(self) -> list[str]:
        """The jtis revoked in the local mirror (for tests and diagnostics)."""
        now = self.clock()
        return [j for j, exp in self._revoked.items() if exp > now]
