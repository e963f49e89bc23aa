"""The gateway's state in one SQLite file: shared by its processes on a host, kept across
restarts.

Revoked tokens, registered sandboxes, secrets providers minted for sandboxes, the
counters (usage ledger, budgets and their reservations, deferred jobs), the credentials
the gateway mints (with the lease of the process minting one: `gateway.services.minting.shared`)
and rotated OAuth2 refresh tokens live in one
database in WAL mode (readers never wait for the writer), mode 0600 in a 0700
directory. Every worker process of one gateway opens the same file: a change one makes
is committed before its call returns, and the others see it at their next lookup.

**The hot path stays in memory.** Lookups (`is_revoked`, `sandbox_for`, the provider
secrets) read an in-memory view. At most every `CHECK_INTERVAL` (20 ms) a lookup asks
SQLite whether the file changed (`PRAGMA data_version`: no I/O, the WAL index in shared
memory; 3 µs, so not on every request) and, when it did and the change counter
(`meta.epoch`, raised by every change to those tables) moved, reloads the view; counter
traffic reloads nothing. A change (`revoke`, a registration) returns only
`CHECK_INTERVAL` after its commit: by then every process's next lookup sees it, so a
revocation holds on every worker before `POST /v1/tokens/revoke` answers.

**Its parts**, a module each, make one `SqliteState`: `sqlite_file.py` (the connection,
whether the file takes writes, the changes held), `sqlite_counters.py` (counters in
batches, budget admission, the leases reservations outlive their process under),
`sqlite_mints.py` (minted credentials, refresh tokens), `sqlite_records.py` (shared
records); `sqlite_schema.py` opens a file and brings its schema up to date,
`sqlite_tools.py` serves `state check` and `state backup` and reads the volume,
`sqlite_connect.py` opens every file of the store the same way.

**The console's request log** is not in this file: it has its own beside it
(`sqlite_log.py`, `gateway-requests.db`), bounded in bytes, so the part that grows with
traffic never holds the write lock nor fills the file of what must survive. Every
`volume_check` seconds (`state.volume_check`, 10 s by default) the volume's free space
and the files' sizes are read (metrics); below `FREE_SHARE` of the volume or
`FREE_FLOOR` bytes free, `warning` says so (`/readyz`, still ready) and the request log
stops growing.

**Faults.** A write that fails (disk full, read-only file) keeps what it could not
write, in order, and retries every second: counters count on locally, a revocation holds
in this process at once (and on the other workers through the supervisor's relay,
`identity/revocations.py`); `problem` says so (`/readyz`), one log line when it starts and
one when it ends, `sandbox_gateway_state_store_up{store="sqlite"}` is 0 meanwhile. A
process that has written nothing for `_PROBE` seconds probes the file with a write nothing
reads, so every worker notices an outage (and its end), not only the one whose write
failed. A file
that is not a database, or has a newer schema than this gateway knows, stops the start
with the path and what to do. A process killed in a transaction loses nothing committed
(SQLite's journal rolls the rest back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.core.secret_value import SecretValue
from gateway.observability import metrics
from gateway.services.secrets.ephemeral import EphemeralKey, EphemeralKeys
from gateway.services.state.alone_records import Records
from gateway.services.state.base import SandboxAddress, StateUnavailable
from gateway.services.state.counters import CounterView
from gateway.services.state.file_changes import FileChanges
from gateway.services.state.lease_keeper import Lease
from gateway.services.state.log import LogEntry, LogQuery
from gateway.services.state.sqlite_connect import open_log, transaction
from gateway.services.state.sqlite_counters import SqliteCounters
from gateway.services.state.sqlite_log import SqliteLog, log_path
from gateway.services.state.sqlite_mints import SqliteMints
from gateway.services.state.sqlite_records import SqliteRecords
from gateway.services.state.sqlite_schema import open_file
from gateway.services.state.sqlite_tools import (
    backup_file,
    counts,
    file_sizes,
    volume,
    volume_warning,
)

__all__ = ["CHECK_INTERVAL", "SqliteState"]

log = logging.getLogger("sandbox_gateway.state")

_STORE = "sqlite"
CHECK_INTERVAL = 0.02  # seconds: how stale a process's view may be
_RETRY = 1.0  # seconds between attempts to write what a failed write held
_PROBE = 2.0  # seconds without a write after which a probe checks the file takes writes
_REVOKE = ("INSERT INTO revoked (jti, expires_at) VALUES (?, ?) ON CONFLICT(jti) DO UPDATE "
           "SET expires_at = max(expires_at, excluded.expires_at)")
_PRUNE = 60.0  # seconds between sweeps of expired rows


class SqliteState(SqliteCounters, SqliteMints, SqliteRecords):
    """`StateStore` in one SQLite file (see the module docstring)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time,
                 busy_timeout: float = 5.0, volume_check: float = 10.0) -> None:
        self.path = path
        self.clock = clock
        self.busy_timeout = busy_timeout
        self.ephemeral = EphemeralKeys(clock)
        self.ephemeral.share = self._share_ephemeral
        self.ephemeral.before = self._refresh
        self._conn: sqlite3.Connection | None = None
        self._next_check = 0.0  # monotonic: when the view is checked again
        self._revoked: dict[str, float] = {}
        self._sandboxes: dict[str, SandboxAddress] = {}
        self._data_version = -1
        self._epoch = -1
        self.view = CounterView(clock)  # the pending counter batch (the file has the rest)
        self._flush_scheduled = False
        self.records = Records()  # this process's shares of budgets (`alone_records`)
        self._serial = 0
        self._closing = False
        self._refresh_scheduled = False
        self._processes_read = -math.inf
        self._refreshed_at = -math.inf
        self._held: list[tuple[str, tuple[Any, ...]]] = []  # change statements not written
        self._problem: str | None = None
        self._last_write = time.monotonic()  # the last write that committed
        self._task: asyncio.Task[None] | None = None
        self._last_prune = 0.0
        self._refresh_tokens: dict[str, tuple[str, str]] = {}  # written (or held) here
        self._record_versions: dict[str, int] = {}  # kind -> its change counter (`meta`)
        self._records_seen = -1  # the data_version they were read at
        self._wakeup: asyncio.Event | None = None  # (record_wakeup)
        self._changes: FileChanges | None = None  # other processes' writes (inotify)
        self.lease: Lease | None = None
        self._dropped: set[str] = set()
        self._dropped_log = (log, "state store: settlements of calls admitted under lease %s "
                             "were not written: the lease was found dead and their "
                             "reservations charged in full")
        self.requests = SqliteLog(log_path(path), open_log, busy_timeout)
        self._warning: str | None = None  # the state volume is short of space
        self._last_volume = -math.inf
        self.volume_check = volume_check  # seconds between readings of the state volume

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open (create) the file, bring its schema up to date, load the view."""
        self._conn = open_file(self.path, self.busy_timeout)
        self._refresh(force=True)
        self.watch_volume()
        metrics.STATE_STORE_UP.labels(store=_STORE).set(1)
        self._task = asyncio.get_running_loop().create_task(self._background(),
                                                            name="state-sqlite")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._closing = True  # (decides nothing alone from now on; its shares go)
        self.flush()
        if not self.view.pending:
            self.forget_shares()
        if self.lease is not None and self._conn is not None:
            await self.lease.stop()  # (after the flush: what settled is not charged)
            self.lease = None
        self.requests.close()
        if self._changes is not None:
            asyncio.get_running_loop().remove_reader(self._changes.fileno())
            self._changes.close()
            self._changes = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _background(self) -> None:
        """Retry held writes (else probe the file now and then); prune expired rows now
        and then; watch the volume."""
        while True:
            await asyncio.sleep(_RETRY)
            try:
                if self._held or self.view.pending or self.view.settling:
                    self.flush()
                elif (self._problem is not None
                      or time.monotonic() - self._last_write >= _PROBE):
                    self._probe()
                if not self.view.pending:  # (what it counted alone is written)
                    self.forget_shares()
                self.refresh_shares()
                now = self.clock()
                if now - self._last_prune > _PRUNE:
                    self._last_prune = now
                    self._prune(now)
                if time.monotonic() - self._last_volume >= self.volume_check:
                    self.watch_volume()
            except Exception:  # a bug must not stop the retries
                log.exception("state store: background work failed")

    def watch_volume(self) -> str | None:
        """Read the state volume's free space and the files' sizes (metrics); below the
        threshold (`volume_warning`) say so (`warning`, /readyz, one log line when it
        begins and one when it ends) and hold the request log at its size."""
        self._last_volume = time.monotonic()
        try:
            free, total = volume(self.path)
        except OSError:
            return self._warning
        metrics.STATE_VOLUME_FREE.set(free)
        for name, size in file_sizes(self.path).items():
            metrics.STATE_FILE_BYTES.labels(file=name).set(size)
        warning = volume_warning(free, total)
        if (warning is None) != (self._warning is None):
            if warning is not None:
                log.warning("state store: %s", warning)
            else:
                log.warning("state store: the state volume has %d MiB free again: the "
                            "request log grows to its bound again", free // (1024 * 1024))
        self._warning = warning
        self.requests.hold(warning is not None)
        return warning

    @property
    def warning(self) -> str | None:
        """Why the state may soon not be written (the volume is short of space), or None."""
        return self._warning

    def _refresh(self, force: bool = False) -> None:
        """Reload the view if another process changed what it holds."""
        conn = self._conn
        if conn is None:
            return
        now = time.monotonic()
        if now < self._next_check and not force:
            return
        self._next_check = now + CHECK_INTERVAL
        try:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if version == self._data_version and not force:
                return
            self._data_version = version
            epoch = int(conn.execute("SELECT value FROM meta WHERE key='epoch'").fetchone()[0])
            if epoch == self._epoch and not force:
                return
            self._epoch = epoch
            now = self.clock()
            revoked = dict(conn.execute("SELECT jti, expires_at FROM revoked WHERE "
                                        "expires_at > ?", (now,)).fetchall())
            sandboxes = {ip: SandboxAddress(sandbox, ip, policy) for ip, sandbox, policy in
                         conn.execute("SELECT ip, sandbox, policy FROM sandboxes")}
            minted = conn.execute("SELECT credential, sandbox, value, expires_at, alias FROM "
                                  "ephemeral WHERE expires_at > ?", (now,)).fetchall()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            return
        for jti, expires_at in list(self._revoked.items()):  # (held, not yet written)
            if any(s for s, args in self._held if args and args[0] == jti):
                revoked.setdefault(jti, expires_at)
        self._revoked = revoked
        self._sandboxes = sandboxes
        self.ephemeral.extend(EphemeralKey(c, s, SecretValue(v), e, SecretValue(a) if a else None)
                              for c, s, v, e, a in minted)

    def is_revoked(self, jti: str) -> bool:
        self._refresh()
        expires_at = self._revoked.get(jti)
        return expires_at is not None and expires_at > self.clock()

    def sandbox_for(self, ip: str) -> SandboxAddress | None:
        self._refresh()
        return self._sandboxes.get(ip)

    def sandboxes(self) -> list[SandboxAddress]:
        self._refresh()
        return list(self._sandboxes.values())

    def revoked_ids(self) -> list[str]:
        """The jtis revoked now (for tests and diagnostics)."""
        self._refresh()
        now = self.clock()
        return [j for j, exp in self._revoked.items() if exp > now]

    # -- changes --------------------------------------------------------------------------

    async def revoke(self, jti: str, expires_at: float) -> None:
        """Revoke `jti` for every process (committed before this returns). When the file
        cannot be written the revocation holds in this process's view and is written
        with the held changes (raises StateUnavailable); revoking it again meanwhile
        holds one change, not two."""
        self._revoked[jti] = max(expires_at, self._revoked.get(jti, 0.0))
        self._held = [h for h in self._held if h[0] != _REVOKE or h[1][:1] != (jti,)]
        if not self._change([(_REVOKE, (jti, self._revoked[jti]))]):
            raise StateUnavailable(f"the state file cannot be written ({self._problem}): "
                                   f"the revocation of {jti} is held in this process and "
                                   "written when the file is writable again")
        await asyncio.sleep(CHECK_INTERVAL)  # (every process's view has it now)

    async def register_sandbox(self, entry: SandboxAddress) -> None:
        if not self._change([("INSERT INTO sandboxes (ip, sandbox, policy) VALUES (?, ?, ?) "
                              "ON CONFLICT(ip) DO UPDATE SET sandbox = excluded.sandbox, "
                              "policy = excluded.policy",
                              (entry.ip, entry.sandbox, entry.policy))]):
            self._held = [h for h in self._held if h[1][:1] != (entry.ip,)]
            raise StateUnavailable(f"the state file cannot be written ({self._problem}): "
                                   f"sandbox {entry.ip} is not registered")
        self._sandboxes[entry.ip] = entry
        await asyncio.sleep(CHECK_INTERVAL)

    async def unregister_sandbox(self, ip: str) -> bool:
        known = self.sandbox_for(ip) is not None
        if not self._change([("DELETE FROM sandboxes WHERE ip = ?", (ip,))]):
            self._held = [h for h in self._held if h[1][:1] != (ip,)]
            raise StateUnavailable(f"the state file cannot be written ({self._problem}): "
                                   f"sandbox {ip} is still registered")
        self._sandboxes.pop(ip, None)
        await asyncio.sleep(CHECK_INTERVAL)
        return known

    def _share_ephemeral(self, key: EphemeralKey) -> None:
        """A provider-minted secret and its alias for the other processes (the file is
        0600)."""
        self._change([("INSERT OR REPLACE INTO ephemeral (digest, credential, sandbox, value, "
                       "expires_at, alias) VALUES (?, ?, ?, ?, ?, ?)",
                       (key.digest, key.credential, key.sandbox, key.value.reveal(),
                        key.expires_at, key.alias.reveal() if key.alias else None))])

    # -- minted credentials (`MintShare`, see gateway.services.minting.shared) -----------------
    # -- the request log (`state/log.py`): its own file (`sqlite_log.py`) ----------------

    @property
    def log_retain(self) -> int:
        return self.requests.lines

    @log_retain.setter
    def log_retain(self, lines: int) -> None:
        self.requests.lines = lines

    @property
    def log_retain_bytes(self) -> int:
        return self.requests.max_bytes

    @log_retain_bytes.setter
    def log_retain_bytes(self, size: int) -> None:
        self.requests.max_bytes = size

    async def log_append(self, entries: Sequence[LogEntry]) -> None:
        """One transaction in the request log's file: the entries in, the oldest beyond
        its bounds out (a failure is the log's: StateUnavailable, the state is not). In
        a thread, as every use of the log's file: a batch takes milliseconds, a
        checkpoint tens (sqlite3 lets go of the GIL while SQLite works), and on the
        event loop every request of the process waited for it (`SqliteLog`)."""
        await asyncio.to_thread(self.requests.append, entries)

    async def log_read(self, query: LogQuery, limit: int, *, before: str | None = None,
                       after: str | None = None) -> list[tuple[str, LogEntry]]:
        return await asyncio.to_thread(self.requests.read, query, limit, before=before,
                                       after=after)

    async def log_get(self, cursor: str) -> LogEntry | None:
        return await asyncio.to_thread(self.requests.get, cursor)

    async def log_last(self) -> str:
        return await asyncio.to_thread(self.requests.last)

    # -- counters -------------------------------------------------------------------------
    # -- housekeeping ---------------------------------------------------------------------

    def _prune(self, now: float) -> None:
        try:
            with transaction(self._db()) as conn:
                for table in ("counters", "revoked", "ephemeral", "records", "shares"):
                    conn.execute(f"DELETE FROM {table} WHERE expires_at <= ?",  # noqa: S608
                                 (now,))
                conn.execute("DELETE FROM minted WHERE (value IS NULL OR expires_at <= ?) AND "
                             "(lease_until IS NULL OR lease_until <= ?)", (now, now))
        except sqlite3.Error as exc:
            self._failed("prune", exc)

    # -- tools ----------------------------------------------------------------------------

    def backup(self, target: Path) -> None:
        """An online copy of the database (SQLite's backup API), mode 0600."""
        backup_file(self.path, target)

    def dump(self) -> dict[str, int]:
        """What the file holds, in rows per table (no values)."""
        return counts(self._db())
