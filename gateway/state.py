"""State that every gateway process must agree on: revoked tokens, registered sandboxes.

Lookups are synchronous and local (they run on every request); changes are async so
a shared implementation (Redis) can publish them to the other replicas. The memory
store is the single-process default.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class StateUnavailable(RuntimeError):
    """The shared state store could not be reached; the change was not shared."""


@dataclass(frozen=True, slots=True)
class SandboxAddress:
    """A sandbox registered by source address (transparent mode)."""

    sandbox: str
    ip: str
    policy: str


class StateStore(Protocol):
    """Shared gateway state. `is_revoked` and `sandbox_for` must not do I/O."""

    def is_revoked(self, jti: str) -> bool: ...
    async def revoke(self, jti: str, expires_at: float) -> None: ...
    def sandbox_for(self, ip: str) -> SandboxAddress | None: ...
    async def register_sandbox(self, entry: SandboxAddress) -> None: ...
    async def unregister_sandbox(self, ip: str) -> bool: ...
    def sandboxes(self) -> list[SandboxAddress]: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...


class MemoryState:
    """In-process state: correct for one gateway process, lost on restart."""

    def __init__(self) -> None:
        self._revoked: dict[str, float] = {}
        self._sandboxes: dict[str, SandboxAddress] = {}

    def is_revoked(self, jti: str) -> bool:
        return jti in self._revoked

    async def revoke(self, jti: str, expires_at: float) -> None:
        now = time.time()
        # Forget revocations of tokens that have expired anyway: they are refused regardless.
        for old in [j for j, exp in self._revoked.items() if exp < now]:
            del self._revoked[old]
        self._revoked[jti] = expires_at

    def sandbox_for(self, ip: str) -> SandboxAddress | None:
        return self._sandboxes.get(ip)

    async def register_sandbox(self, entry: SandboxAddress) -> None:
        self._sandboxes[entry.ip] = entry

    async def unregister_sandbox(self, ip: str) -> bool:
        return self._sandboxes.pop(ip, None) is not None

    def sandboxes(self) -> list[SandboxAddress]:
        return list(self._sandboxes.values())

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None


def build_state(config: Mapping[str, Any]) -> StateStore:
    """The store named by the `state` config section: `memory` (default) or `redis`."""
    kind = config.get("store", "memory")
    unknown = set(config) - {"store", "url", "prefix"}
    if unknown:
        raise ValueError(f"state.{sorted(unknown)[0]}: unknown key (known: store, url, prefix)")
    if kind == "memory":
        return MemoryState()
    if kind == "redis":
        url = config.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError("state.url: required for store redis, e.g. redis://redis:6379/0")
        from gateway.state_redis import RedisState

        return RedisState(url, prefix=str(config.get("prefix", "sandbox-gateway")))
    raise ValueError(f"state.store: {kind!r} is not a store; use memory or redis")
