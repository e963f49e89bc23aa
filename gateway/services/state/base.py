"""State that every gateway process must agree on: revoked tokens, registered sandboxes,
secrets providers minted for sandboxes (``ephemeral``, see ``gateway.services.secrets.ephemeral``)
and counters (usage totals, budget consumption; see ``gateway.services.state.counters``).

Lookups are synchronous and local (they run on every request); changes are async so
a shared implementation (Redis) can publish them to the other replicas. Stores:
``sqlite`` (the default, ``gateway.services.state.sqlite``: one file shared by the processes of
one host, kept across restarts), ``redis`` (``gateway.services.state.redis``: replicas) and
``memory`` (one process, lost on restart: tests and throw-away runs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core.identity import SandboxAddress as SandboxAddress  # (re-exported)
from gateway.core.refusal import StateUnavailable as StateUnavailable  # (re-exported)
from gateway.services.secrets.ephemeral import EphemeralKeys
from gateway.services.state.counters import Admission, CountersOf, Increment, Table
from gateway.services.state.log import LogLines, MemoryLog
from gateway.services.state.memory_counters import MemoryCounters


@dataclass(frozen=True, slots=True)
class SharedMint:
    """A minted credential's value as the processes share it (`gateway.services.minting.shared`).
    ``parts``: a composite value's pieces (AWS key id, secret, session token), else ();
    ``expires_at`` None: no known expiry; from ``due_at`` on, the next fetch mints anew."""

    value: str
    parts: tuple[str, ...]
    minted_at: float
    expires_at: float | None
    due_at: float


class MintShare(Protocol):
    """Minted credentials and rotated OAuth2 refresh tokens, shared by the processes of a
    store, so a credential is minted once (a process holds a **lease** on its mint
    while it mints) and a refresh token a server rotated is the one every process (and
    the next start) uses. Raise `StateUnavailable` when the store cannot answer."""

    async def read_mint(self, name: str) -> SharedMint | None: ...
    async def lease_mint(self, name: str, holder: str, until: float) -> bool: ...
    async def write_mint(self, name: str, mint: SharedMint, holder: str) -> None: ...
    async def release_mint(self, name: str, holder: str) -> None: ...
    async def read_refresh(self, key: str) -> tuple[str, str] | None: ...
    async def write_refresh(self, key: str, origin: str, value: str) -> None: ...


class MemoryMints:
    """`MintShare` for one process (the memory store; a minter given no store)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.mint_clock = clock
        self._mints: dict[str, SharedMint] = {}
        self._leases: dict[str, tuple[str, float]] = {}
        self._refresh: dict[str, tuple[str, str]] = {}

    async def read_mint(self, name: str) -> SharedMint | None:
        return self._mints.get(name)

    async def lease_mint(self, name: str, holder: str, until: float) -> bool:
        current = self._leases.get(name)
        if current is not None and current[0] != holder and current[1] > self.mint_clock():
            return False
        self._leases[name] = (holder, until)
        return True

    async def write_mint(self, name: str, mint: SharedMint, holder: str) -> None:
        self._mints[name] = mint
        await self.release_mint(name, holder)

    async def release_mint(self, name: str, holder: str) -> None:
        if self._leases.get(name, ("", 0.0))[0] == holder:
            del self._leases[name]

    async def read_refresh(self, key: str) -> tuple[str, str] | None:
        return self._refresh.get(key)

    async def write_refresh(self, key: str, origin: str, value: str) -> None:
        self._refresh[key] = (origin, value)


class Records(Protocol):
    """Small JSON documents every process of a store shares (ask mode's approvals and
    grants), by kind and key, each with a revision for compare-and-set and an expiry
    (an expired record is gone). Raise `StateUnavailable` when the store cannot answer."""

    async def record_get(self, kind: str, key: str) -> tuple[dict[str, Any], int] | None:
        """The record and its revision, or None."""
    async def record_list(self, kind: str) -> list[dict[str, Any]]: ...
    async def record_put(self, kind: str, key: str, doc: dict[str, Any], expires_at: float,
                         rev: int | None) -> bool:
        """Write it if `rev` is None and there is no record (an expired one is none), or
        if the record's revision is `rev`; True if written."""
    def record_version(self, kind: str) -> int:
        """A number that changes whenever a record of `kind` is written, by any process
        of the store, as far as this one has heard (no network I/O: cheap enough to be
        asked every 50 ms; SQLite reads a change counter when the file changed, Redis
        counts the changes it publishes). Expiry is no change."""
    def record_wakeup(self) -> asyncio.Event | None:
        """An event set whenever a record of any kind may have been written: by this
        process, or by another as far as this one hears (SQLite: inotify on the file;
        Redis: its channel). The record watcher waits on it instead of asking
        `record_version` every 50 ms. None: the store cannot tell; ask. (Called on the
        running loop.)"""


class MemoryRecords:
    """`Records` for one process."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.record_clock = clock
        self._records: dict[tuple[str, str], tuple[dict[str, Any], int, float]] = {}
        self._record_versions: dict[str, int] = {}
        self._wakeup: asyncio.Event | None = None

    def _live(self, kind: str, key: str) -> tuple[dict[str, Any], int, float] | None:
        found = self._records.get((kind, key))
        if found is not None and found[2] <= self.record_clock():
            del self._records[(kind, key)]
            return None
        return found

    async def record_get(self, kind: str, key: str) -> tuple[dict[str, Any], int] | None:
        found = self._live(kind, key)
        return None if found is None else (json.loads(json.dumps(found[0])), found[1])

    async def record_list(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(json.dumps(found[0])) for k, key in list(self._records)
                if k == kind and (found := self._live(k, key)) is not None]

    async def record_put(self, kind: str, key: str, doc: dict[str, Any], expires_at: float,
                         rev: int | None) -> bool:
        found = self._live(kind, key)
        if (found is None) != (rev is None) or (found is not None and found[1] != rev):
            return False
        self._records[(kind, key)] = (json.loads(json.dumps(doc)), (rev or 0) + 1, expires_at)
        self._record_versions[kind] = self._record_versions.get(kind, 0) + 1
        if self._wakeup is not None:
            self._wakeup.set()
        return True

    def record_version(self, kind: str) -> int:
        return self._record_versions.get(kind, 0)

    def record_wakeup(self) -> asyncio.Event:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        return self._wakeup


class StateStore(MintShare, Records, LogLines, Protocol):
    """Shared gateway state. `is_revoked`, `sandbox_for`, `count` and `counter` must not
    do I/O. `ephemeral` is the local view of provider-minted secrets; a key added to it
    is shared with the other processes by the store."""

    ephemeral: EphemeralKeys
    log_retain: int  # the request log's bound in lines (console.retain; 0: none)
    log_retain_bytes: int  # ... and in bytes (0: none)

    def count(self, increments: Iterable[Increment]) -> None: ...
    def counter(self, table: str, field: str) -> int: ...
    def admit(self, admission: Admission, *, share: bool = True) -> int | None: ...
    def settle(self, holder: str, increments: Iterable[Increment]) -> None: ...
    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]: ...
    @property
    def counters_degraded(self) -> bool: ...
    @property
    def processes(self) -> int: ...
    @property
    def others_held(self) -> int: ...
    @property
    def holder(self) -> str | None: ...
    async def take_lease(self, slot: str, *, ttl: float = ..., beat: float = ...) -> None:
        """Take this process's lease (the holder of its calls' reservations, see
        ``gateway.services.state.leases``), renew it and charge dead holders' until
        ``close``; while it cannot be written, serve without it and claim it at each beat."""
    def is_revoked(self, jti: str) -> bool: ...
    async def revoke(self, jti: str, expires_at: float) -> None: ...
    def sandbox_for(self, ip: str) -> SandboxAddress | None: ...
    async def register_sandbox(self, entry: SandboxAddress) -> None: ...
    async def unregister_sandbox(self, ip: str) -> bool: ...
    def sandboxes(self) -> list[SandboxAddress]: ...
    @property
    def problem(self) -> str | None: ...
    @property
    def warning(self) -> str | None:
        """Why the store may soon not be written (its volume is short of space), or None."""
    async def start(self) -> None: ...
    async def close(self) -> None: ...


class MemoryState(CountersOf, MemoryMints, MemoryRecords, MemoryLog):
    """In-process state: correct for one gateway process, lost on restart."""

    _counters: MemoryCounters

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        MemoryMints.__init__(self, clock)
        MemoryRecords.__init__(self, clock)
        MemoryLog.__init__(self)
        self._revoked: dict[str, float] = {}
        self._sandboxes: dict[str, SandboxAddress] = {}
        self._counters = MemoryCounters(clock)
        self.ephemeral = EphemeralKeys(clock)

    @property
    def problem(self) -> str | None:
        """Why the store is not shared/written now (None: it is; never, in memory)."""
        return None

    @property
    def warning(self) -> str | None:
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
        await self._counters.close()


log = logging.getLogger("sandbox_gateway")
