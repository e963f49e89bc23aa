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

**Its parts**, a module each, make one `RedisState`: `redis_link.py` (the two clients,
the channel followed, reconnects, every call bounded), `redis_mints.py` (minted
credentials and their leases, refresh tokens), `redis_records.py` (shared records),
`redis_log.py` (the request log); this module is the mirror (revocations, sandboxes,
provider-minted secrets: their writes, events and full re-syncs) and the whole's start
and close.

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
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

import redis as syncredis
from redis.backoff import NoBackoff
from redis.retry import Retry as SyncRetry

from gateway.core.secret_value import SecretValue
from gateway.net.resolver import unguarded
from gateway.observability import metrics
from gateway.services.secrets.ephemeral import EphemeralKey, EphemeralKeys
from gateway.services.state.base import SandboxAddress, StateUnavailable
from gateway.services.state.counters import CountersOf
from gateway.services.state.counters_redis import RedisCounters
from gateway.services.state.log import RETAIN
from gateway.services.state.redis_link import log, redact_url
from gateway.services.state.redis_log import RedisLog
from gateway.services.state.redis_mints import RedisMints
from gateway.services.state.redis_records import RedisRecords

__all__ = ["RedisState", "StateUnavailable", "redact_url"]

_SCAN_BATCH = 1000


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)



class RedisState(RedisMints, RedisRecords, RedisLog, CountersOf):
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
        self._redis = None
        self._sub_client = None
        self._pubsub = None
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


    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, load the current state and follow changes (`RedisLink._open`), then
        open budget admission's own connection."""
        await self._open()
        assert self._redis is not None
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
        await self._shut()

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
