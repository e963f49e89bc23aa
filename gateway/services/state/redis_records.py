"""`RedisState`'s part for shared JSON records (`Records`: ask mode's approvals and grants,
MCP tool pins, console sessions), with each kind's change counter.

A record is `<prefix>:record:<kind>:<key>` = `<rev>|<json>`, expiring with it (`PX`),
indexed in the set `<prefix>:records:<kind>`; a script writes it only if new or at the
revision the writer read, and publishes a `record` event with its kind in the same call,
so every replica's watchers re-read in the order Redis applied the writes.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from gateway.observability import metrics
from gateway.services.state.redis_link import RedisLink

__all__ = ["RedisRecords"]

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



class RedisRecords(RedisLink):
    """Shared records in Redis."""

    prefix: str
    _record_versions: dict[str, int]  # record writes heard of, by kind
    _records_synced: int  # full re-syncs (each may follow missed events)
    _wakeup: asyncio.Event | None  # (record_wakeup)

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
