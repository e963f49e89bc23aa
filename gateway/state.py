"""State that every gateway process must agree on: revoked tokens, registered sandboxes,
secrets providers minted for sandboxes (``ephemeral``, see ``gateway.secrets.ephemeral``)
and counters (usage totals, budget consumption; see ``gateway.counters``).

Lookups are synchronous and local (they run on every request); changes are async so
a shared implementation (Redis) can publish them to the other replicas. The memory
store is the single-process default. Counter increments are synchronous too: they are
batched locally and shared in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gateway.counters import CountersOf, Increment, JournalCounters, MemoryCounters, Table
from gateway.secrets.ephemeral import EphemeralKey, EphemeralKeys
from gateway.secrets.value import SecretValue


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
    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]: ...
    @property
    def counters_degraded(self) -> bool: ...
    def is_revoked(self, jti: str) -> bool: ...
    async def revoke(self, jti: str, expires_at: float) -> None: ...
    def sandbox_for(self, ip: str) -> SandboxAddress | None: ...
    async def register_sandbox(self, entry: SandboxAddress) -> None: ...
    async def unregister_sandbox(self, ip: str) -> bool: ...
    def sandboxes(self) -> list[SandboxAddress]: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...


class MemoryState(CountersOf):
    """In-process state: correct for one gateway process, lost on restart."""

    _counters: MemoryCounters | JournalCounters

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._revoked: dict[str, float] = {}
        self._sandboxes: dict[str, SandboxAddress] = {}
        self._counters: MemoryCounters | JournalCounters = MemoryCounters(clock)
        self.ephemeral = EphemeralKeys(clock)

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


class JournalState(MemoryState):
    """State shared by the worker processes of one gateway on one host.

    Every change is appended as a JSON line to a journal file (under `flock`, so lines
    never interleave); every process applies its own changes at once and the others'
    within `interval` seconds by reading what was appended since its last look.
    Lookups stay in memory. Used automatically with `workers > 1` and the memory store.
    Counters go to a second file next to it (`<path>.counters`, see
    `gateway.counters.JournalCounters`), synced on the same beat.
    """

    def __init__(self, path: Path, interval: float = 0.2,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.path = path
        self.interval = interval
        self._offset = 0
        self._task: asyncio.Task[None] | None = None
        self._journal_counters = JournalCounters(path.with_name(path.name + ".counters"),
                                                 clock=clock)
        self._counters = self._journal_counters
        self.ephemeral.share = self._share_ephemeral

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(mode=0o600, exist_ok=True)
        self._catch_up()
        try:
            self._journal_counters.start()
        except OSError as exc:
            raise StateUnavailable(f"cannot open the counters journal "
                                   f"{self._journal_counters.path}: {exc.strerror}") from None
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._journal_counters.flush()

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self._catch_up()
            except OSError as exc:
                log.warning("state journal %s unreadable: %s", self.path, exc.strerror)
            try:
                self._journal_counters.sync()
            except Exception:  # a counters bug must not stop revocations from syncing
                log.exception("counters journal: unexpected error")

    def _catch_up(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            try:
                self._apply(json.loads(line))
            except (ValueError, KeyError, TypeError):
                log.warning("state journal %s: skipped a malformed line", self.path)

    def _apply(self, event: dict[str, Any]) -> None:
        op = event["op"]
        if op == "revoke":
            self._revoked[str(event["jti"])] = float(event["exp"])
        elif op == "register":
            entry = SandboxAddress(str(event["sandbox"]), str(event["ip"]), str(event["policy"]))
            self._sandboxes[entry.ip] = entry
        elif op == "unregister":
            self._sandboxes.pop(str(event["ip"]), None)
        elif op == "ephemeral":
            self.ephemeral.add(EphemeralKey(str(event["credential"]), str(event["sandbox"]),
                                            SecretValue(str(event["value"])),
                                            float(event["exp"])), shared=True)

    def _append(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
        try:
            with self.path.open("ab") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.write(line)
        except OSError as exc:
            raise StateUnavailable(f"cannot write the state journal {self.path}: "
                                   f"{exc.strerror}") from None
        self._apply(event)

    async def revoke(self, jti: str, expires_at: float) -> None:
        self._append({"op": "revoke", "jti": jti, "exp": expires_at})

    def _share_ephemeral(self, key: EphemeralKey) -> None:
        """A minted secret for the other workers (the journal is mode 0600)."""
        try:
            self._append({"op": "ephemeral", "credential": key.credential,
                          "sandbox": key.sandbox, "value": key.value.reveal(),
                          "exp": key.expires_at})
        except StateUnavailable as exc:
            log.warning("provider-minted secret known to this worker only: %s", exc)

    async def register_sandbox(self, entry: SandboxAddress) -> None:
        self._append({"op": "register", "sandbox": entry.sandbox, "ip": entry.ip,
                      "policy": entry.policy})

    async def unregister_sandbox(self, ip: str) -> bool:
        known = ip in self._sandboxes
        self._append({"op": "unregister", "ip": ip})
        return known


def build_state(config: Mapping[str, Any]) -> StateStore:
    """The store named by the `state` config section: `memory` (default) or `redis`."""
    kind = config.get("store", "memory")
    unknown = set(config) - {"store", "url", "prefix"}
    if unknown:
        raise ValueError(f"state.{sorted(unknown)[0]}: unknown key (known: store, url, prefix)")
    if kind == "memory":
        return MemoryState()
    if kind == "journal":
        path = config.get("url")
        if not isinstance(path, str) or not path:
            raise ValueError("state.url: the journal file path is required for store journal")
        return JournalState(Path(path))
    if kind == "redis":
        url = config.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError("state.url: required for store redis, e.g. redis://redis:6379/0")
        from gateway.state_redis import RedisState

        return RedisState(url, prefix=str(config.get("prefix", "sandbox-gateway")))
    raise ValueError(f"state.store: {kind!r} is not a store; use memory or redis")


log = logging.getLogger("sandbox_gateway")
