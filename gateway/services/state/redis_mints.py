"""`RedisState`'s part for credentials minted once for every replica (`MintShare`, see
`gateway.services.minting.shared`) and rotated OAuth2 refresh tokens.

`<prefix>:mint:<name>` holds a minted credential as JSON, expiring with it;
`<prefix>:mintlease:<name>` the process minting it now (`PX`), taken by a script only if
free or already its own, and given back only by its holder; `<prefix>:refresh-tokens`, a
hash key -> `[origin, value]`. Every call goes through `_op`: a Redis that cannot answer
raises `StateUnavailable`, and the caller mints for itself.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

from gateway.observability import metrics
from gateway.services.state.base import SharedMint, StateUnavailable
from gateway.services.state.redis_link import RedisLink

__all__ = ["RedisMints"]


_LEASE = ("local held = redis.call('get', KEYS[1]) "
          "if held == false or held == ARGV[1] then "
          "redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end return 0")
# Given back only by its holder.
_RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) end return 0")
# A shared record ("<rev>|<json>") written if new (ARGV[1] -1) or at revision ARGV[1];


class RedisMints(RedisLink):
    """Minted credentials and refresh tokens in Redis."""

    _mint_prefix: str
    _lease_prefix: str
    _refresh_key: str

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

    async def read_refresh(self, key: str) -> tuple[str, str] | None:
        raw = await self._op("refresh", lambda r: r.hget(self._refresh_key, key))
        if raw is None:
            return None
        origin, value = json.loads(str(raw))
        return str(origin), str(value)

    async def write_refresh(self, key: str, origin: str, value: str) -> None:
        await self._op("refresh", lambda r: r.hset(self._refresh_key, key,
                                                   json.dumps([origin, value])))

