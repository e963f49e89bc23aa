"""State that every gateway process must agree on: revoked tokens, registered sandboxes,
secrets providers minted for sandboxes (``ephemeral``, see ``gateway.secrets.ephemeral``)
and counters (usage totals, budget consumption; see ``gateway.counters``).

Lookups are synchronous and local (they run on every request); changes are async so
a shared implementation (Redis) can publish them to the other replicas. Stores:
``sqlite`` (the default, ``gateway.state_sqlite``: one file shared by the processes of
one host, kept across restarts), ``redis`` (``gateway.state_redis``: replicas) and
``memory`` (one process, lost on restart: tests and throw-away runs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.counters import Admission, CountersOf, Increment, MemoryCounters, Table
from gateway.secrets.ephemeral import EphemeralKeys


class StateUnavailable(RuntimeError):
    """The shared state store could not be reached; the change was not shared."""


@dataclass(frozen=True, slots=True)
class SandboxAddress:
    """A sandbox registered by source address (transparent mode)."""

    sandbox: str
    ip: str
    policy: str


class StateStore(Protocol):
    """Shared gateway state. `is_revoked`, `sandbox_for`, `count` and `counter` must not
    do I/O. `ephemeral` is the local view of provider-minted secrets; a key added to it
    is shared with the other processes by the store."""

    ephemeral: EphemeralKeys

    def count(self, increments: Iterable[Increment]) -> None: ...
    def counter(self, table: str, field: str) -> int: ...
    def admit(self, admission: Admission) -> int | None: ...
    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]: ...
    @property
    def counters_degraded(self) -> bool: ...
    def is_revoked(self, jti: str) -> bool: ...
    async def revoke(self, jti: str, expires_at: float) -> None: ...
    def sandbox_for(self, ip: str) -> SandboxAddress | None: ...
    async def register_sandbox(self, entry: SandboxAddress) -> None: ...
    async def unregister_sandbox(self, ip: str) -> bool: ...
    def sandboxes(self) -> list[SandboxAddress]: ...
    @property
    def problem(self) -> str | None: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...


class MemoryState(CountersOf):
    """In-process state: correct for one gateway process, lost on restart."""

    _counters: MemoryCounters

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._revoked: dict[str, float] = {}
        self._sandboxes: dict[str, SandboxAddress] = {}
        self._counters = MemoryCounters(clock)
        self.ephemeral = EphemeralKeys(clock)

    @property
    def problem(self) -> str | None:
        """Why the store is not shared/written now (None: it is; never, in memory)."""
        return None

    def is_revoked(self, jti: str) -> bool:
        expires_at = self._revoked.get(jti)
        return expires_at is not None and expires_at > time.time()

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


def build_state(config: Mapping[str, Any], base: Path | None = None) -> StateStore:
    """The store named by the `state` config section: `sqlite` (the default; `path`,
    relative to `base`, default `state/gateway.db`), `redis` (`url`, `prefix`) or
    `memory`."""
    kind = config.get("store", "sqlite")
    known = {"sqlite": {"store", "path"}, "redis": {"store", "url", "prefix"},
             "memory": {"store"}}
    if kind not in known:
        raise ValueError(f"state.store: {kind!r} is not a store; use sqlite, redis or memory")
    unknown = set(config) - known[kind]
    if unknown:
        raise ValueError(f"state.{sorted(unknown)[0]}: unknown key for store {kind} (known: "
                         f"{', '.join(sorted(known[kind]))})")
    if kind == "memory":
        return MemoryState()
    if kind == "sqlite":
        raw = config.get("path", "state/gateway.db")
        if not isinstance(raw, str | Path) or not str(raw):
            raise ValueError("state.path: the SQLite file's path, e.g. ./state/gateway.db")
        path = Path(raw).expanduser()
        if not path.is_absolute():
            path = (base or Path.cwd()) / path
        from gateway.state_sqlite import SqliteState

        return SqliteState(path)
    url = config.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError("state.url: required for store redis, e.g. redis://redis:6379/0")
    from gateway.state_redis import RedisState

    return RedisState(url, prefix=str(config.get("prefix", "sandbox-gateway")))


log = logging.getLogger("sandbox_gateway")
