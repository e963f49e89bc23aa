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

**Counters** are added to a pending batch and written within `FLUSH_DELAY` (0.25 s) in
one transaction (`INSERT … ON CONFLICT DO UPDATE value = value + …`): on a busy worker a
transaction costs ~130 µs of CPU (3 statements of ~30 µs with cold caches), and one per
call made a metered call 5-6% dearer (`make bench`). `counter` reads the file (a point
lookup) plus what is pending here; `counter_tables` (`GET /v1/usage`) waits out
`FLUSH_DELAY` first, so it includes every call that ended, on any worker. A settlement
still pending on another worker leaves the call's reservation counted meanwhile.
`admit` (budget admission) is one `BEGIN IMMEDIATE` transaction: the limits are checked
against the committed values and the increments written before any other process can
admit, so workers never overshoot together.

**Reservations outlive their process** (`gateway.services.state.leases`): admission
commits a call's reservation and its record under this process's lease (table
`leases`: holder, slot, expiry; renewed every `leases.BEAT`); a settlement waits in the
batch with the rest and is written only if the lease still stands, in the flush's one
transaction (the usage, the release and the record's removal: all or nothing). A
process killed before its batch was written leaves its reservations committed: the
next process to start in its slot, or any live one once the lease expires, charges
them as used (`lease_reap`, one transaction: exactly once).

**The console's request log** is not in this file: it has its own beside it
(`sqlite_log.py`, `gateway-requests.db`), bounded in bytes, so the part that grows with
traffic never holds the write lock nor fills the file of what must survive. Every
`_VOLUME` seconds the volume's free space and the files' sizes are read (metrics); below
`FREE_SHARE` of the volume or `FREE_FLOOR` bytes free, `warning` says so (`/readyz`,
still ready) and the request log stops growing.

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
import json
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gateway.core.secret_value import SecretValue
from gateway.observability import metrics
from gateway.services.secrets.ephemeral import EphemeralKey, EphemeralKeys
from gateway.services.state.base import SandboxAddress, SharedMint, StateUnavailable
from gateway.services.state.counters import Admission, CounterView, Increment, Table, first_refused
from gateway.services.state.lease_keeper import Lease, LeaseHolding
from gateway.services.state.leases import ORPHANS, Charged, charge_of, parse_held
from gateway.services.state.log import LogEntry, LogQuery
from gateway.services.state.sqlite_log import SqliteLog, log_path

__all__ = ["FREE_FLOOR", "FREE_SHARE", "SCHEMA_VERSION", "SqliteState", "StateFileError",
           "backup_file", "check_file", "file_sizes", "log_summary", "open_file", "summary",
           "volume", "volume_warning"]

log = logging.getLogger("sandbox_gateway.state")

_STORE = "sqlite"
SCHEMA_VERSION = 7
# Each version's statements, applied in order to bring a file up to SCHEMA_VERSION.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS revoked (jti TEXT PRIMARY KEY, expires_at REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS sandboxes (ip TEXT PRIMARY KEY, sandbox TEXT NOT NULL, "
        "policy TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS ephemeral (digest TEXT PRIMARY KEY, credential TEXT NOT NULL, "
        "sandbox TEXT NOT NULL, value TEXT NOT NULL, expires_at REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS counters (tbl TEXT NOT NULL, field TEXT NOT NULL, "
        "value INTEGER NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (tbl, field)) "
        "WITHOUT ROWID",
        "CREATE INDEX IF NOT EXISTS counters_expiry ON counters (expires_at)",
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('epoch', '0')",
    ),
    2: (  # minted credentials shared by the processes, rotated OAuth2 refresh tokens
        "CREATE TABLE IF NOT EXISTS minted (name TEXT PRIMARY KEY, value TEXT, parts TEXT, "
        "minted_at REAL, expires_at REAL, due_at REAL, lease_holder TEXT, lease_until REAL)",
        "CREATE TABLE IF NOT EXISTS refresh_tokens (key TEXT PRIMARY KEY, origin TEXT NOT NULL, "
        "value TEXT NOT NULL, updated_at REAL NOT NULL)",
        # Every counter write rewrote this index's entry (a fifth of a batch's cost); the
        # once-a-minute prune scans the table instead.
        "DROP INDEX IF EXISTS counters_expiry",
    ),
    3: (  # shared JSON records: ask mode's approvals and grants
        "CREATE TABLE IF NOT EXISTS records (kind TEXT NOT NULL, key TEXT NOT NULL, "
        "doc TEXT NOT NULL, rev INTEGER NOT NULL, expires_at REAL NOT NULL, "
        "PRIMARY KEY (kind, key)) WITHOUT ROWID",
    ),
    4: (  # the console's request log: the newest audit lines (`state/log.py`)
        # (ids only grow: the newest row is never the one trimmed)
        "CREATE TABLE IF NOT EXISTS log (id INTEGER PRIMARY KEY, at REAL NOT NULL, "
        "sandbox TEXT NOT NULL, policy TEXT NOT NULL, host TEXT NOT NULL, "
        "decision TEXT NOT NULL, code TEXT NOT NULL, engine TEXT NOT NULL, line TEXT NOT NULL)",
    ),
    5: (  # the alias a sandbox holds for a provider-minted secret (NULL: a marker only)
        "ALTER TABLE ephemeral ADD COLUMN alias TEXT",
    ),
    6: (  # the leases reservations are recorded under (`state/leases.py`)
        "CREATE TABLE IF NOT EXISTS leases (holder TEXT PRIMARY KEY, slot TEXT NOT NULL, "
        "expires_at REAL NOT NULL) WITHOUT ROWID",
    ),
    7: (  # the request log moved to its own file (`sqlite_log.py`): its lines are dropped
        # (the audit trail has them); the space is given back after the migration
        "DROP TABLE IF EXISTS log",
    ),
}
# Add to a counter (its window's expiry kept the latest).
_ADD = ("INSERT INTO counters (tbl, field, value, expires_at) VALUES (?, ?, ?, ?) "
        "ON CONFLICT(tbl, field) DO UPDATE SET value = value + excluded.value, "
        "expires_at = max(expires_at, excluded.expires_at)")
# A record kind's change counter, raised with every write of a record of that kind.
_RECORDS = "records:"
_BUMP = ("INSERT INTO meta (key, value) VALUES (?, '1') ON CONFLICT(key) DO UPDATE SET "
         "value = CAST(value AS INTEGER) + 1")
CHECK_INTERVAL = 0.02  # seconds: how stale a process's view may be
FLUSH_DELAY = 0.25  # seconds a counted increment waits to be written with the next ones
_RETRY = 1.0  # seconds between attempts to write what a failed write held
_PROBE = 2.0  # seconds without a write after which a probe checks the file takes writes
_REVOKE = ("INSERT INTO revoked (jti, expires_at) VALUES (?, ?) ON CONFLICT(jti) DO UPDATE "
           "SET expires_at = max(expires_at, excluded.expires_at)")
_PRUNE = 60.0  # seconds between sweeps of expired rows
_VOLUME = 10.0  # seconds between readings of the state volume's free space
# /readyz warns (and the request log stops growing) when the state volume has less free
# than FREE_SHARE of its size or FREE_FLOOR bytes, whichever is more.
FREE_SHARE = 0.10
FREE_FLOOR = 64 * 1024 * 1024


class StateFileError(Exception):
    """The state file cannot be used (not a database, a newer schema, unreadable); the
    message names the path and what to do."""


def _connect(path: Path, busy_timeout: float, *,
             incremental: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=busy_timeout, isolation_level=None,
                           check_same_thread=False)
    try:
        if incremental:  # (a new file only, and before WAL: freed pages can be given back)
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        # Switching a new file to WAL takes an exclusive lock and does not wait for
        # it (processes starting together): retry within the busy timeout.
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoint, atomic always
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction, taken at once (BEGIN IMMEDIATE: no other process writes
    between its reads and writes); rolled back if the block raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _prepare(path: Path) -> None:
    """The directory (0700) and the file (0600) before SQLite opens it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


def _migrate(conn: sqlite3.Connection, path: Path) -> int:
    """Bring the file's schema up to SCHEMA_VERSION; raise for a newer one."""
    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if version > SCHEMA_VERSION:
        raise StateFileError(
            f"the state file {path} has schema version {version}, and this gateway knows "
            f"versions up to {SCHEMA_VERSION}: run the gateway version that wrote it, or "
            "restore a backup taken with this version (`sandbox-gateway state backup`)")
    if version == SCHEMA_VERSION:
        return version
    with _transaction(conn):
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])  # (under the lock)
        for step in range(version + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[step]:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version={step}")
    if version < 7:
        _give_back(conn, path)
    return SCHEMA_VERSION


def _give_back(conn: sqlite3.Connection, path: Path) -> None:
    """After the request log left the file (version 7), give its pages back to the
    volume (VACUUM: a copy of what is left, small). Best effort: another process
    reading, or no room for the copy, leaves the pages free for the state to reuse."""
    free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    page = int(conn.execute("PRAGMA page_size").fetchone()[0])
    if free * page < 1024 * 1024:
        return
    try:
        conn.execute("VACUUM")
    except sqlite3.Error as exc:
        log.warning("state store: %s: the request log's %d MiB could not be given back "
                    "(%s); they are reused as the state grows", path,
                    free * page // (1024 * 1024), exc)
        return
    log.warning("state store: %s: the console's request log moved to %s (its lines are in "
                "the audit trail); %d MiB given back", path, log_path(path).name,
                free * page // (1024 * 1024))


def open_file(path: Path, busy_timeout: float = 5.0) -> sqlite3.Connection:
    """Open (create: 0600 in a 0700 directory) the state file in WAL mode with its
    schema brought up to date; raise StateUnavailable naming the path and what to do.
    (The worker supervisor calls it once before the workers start.)"""
    try:
        _prepare(path)
        conn = _connect(path, busy_timeout)
        try:
            _migrate(conn, path)
            conn.execute("SELECT count(*) FROM counters").fetchone()
        except BaseException:
            conn.close()
            raise
    except StateFileError as exc:
        raise StateUnavailable(str(exc)) from None
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc) and "busy" not in str(exc):
            raise _unusable(path, exc) from None
        raise StateUnavailable(
            f"the state file {path} stayed locked for {busy_timeout:g}s ({exc}): another "
            "process holds it (a gateway of another host sharing a network file system? "
            "the file must be local to one host)") from None
    except sqlite3.DatabaseError as exc:
        raise _unusable(path, exc) from None
    except OSError as exc:
        raise StateUnavailable(f"cannot open the state file {path}: "
                               f"{exc.strerror or exc}") from None
    return conn


def _unusable(path: Path, exc: sqlite3.Error) -> StateUnavailable:
    return StateUnavailable(
        f"the state file {path} cannot be used ({exc}): check it with `sandbox-gateway "
        "state check`, then restore a backup or move it aside (a new one is made at the "
        "next start; revocations and budgets in it are lost)")


def _open_log(path: Path, busy_timeout: float) -> sqlite3.Connection:
    """A connection to the request log's file (made 0600 in a 0700 directory)."""
    _prepare(path)
    return _connect(path, busy_timeout, incremental=True)


def volume_warning(free: int, total: int) -> str | None:
    """Why the state volume is short of space (below `FREE_SHARE` of its size or
    `FREE_FLOOR` bytes, whichever is more), or None."""
    floor = max(FREE_FLOOR, int(total * FREE_SHARE))
    if total <= 0 or free >= floor:
        return None
    return (f"the state volume has {free // (1024 * 1024)} MiB free of "
            f"{total // (1024 * 1024)} MiB (below {floor // (1024 * 1024)} MiB: "
            f"{FREE_SHARE:.0%} or {FREE_FLOOR // (1024 * 1024)} MiB): the request log no "
            "longer grows; free space or grow the volume before the state cannot be written")


def volume(path: Path) -> tuple[int, int]:
    """Free bytes (for an unprivileged user) and size of the volume holding `path`."""
    st = os.statvfs(path.parent if not path.is_dir() else path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def file_sizes(path: Path) -> dict[str, int]:
    """Bytes of the store's files that exist: state, state_wal, log, log_wal."""
    out = {}
    for name, file in (("state", path), ("state_wal", path.with_name(path.name + "-wal")),
                       ("log", log_path(path)),
                       ("log_wal", log_path(path).with_name(log_path(path).name + "-wal"))):
        with contextlib.suppress(OSError):
            out[name] = file.stat().st_size
    return out


def check_file(path: Path) -> list[str]:
    """What is wrong with a state file (`state check`): an empty list when it is a
    sound database of a schema this gateway knows."""
    if not path.exists():
        return [f"{path}: no such file"]
    problems = []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                problems.append(f"{path}: schema version {version} is newer than this "
                                f"gateway's ({SCHEMA_VERSION})")
            result = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            if result != ["ok"]:
                problems.extend(f"{path}: {line}" for line in result[:20])
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        problems.append(f"{path}: {exc}")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        problems.append(f"{path}: mode {mode:o} lets others read it (it holds secrets a "
                        "provider minted and token ids): chmod 600")
    return problems


class _Writes:
    """What could not be written yet (a failed commit), in order, retried."""

    def __init__(self) -> None:
        self.statements: list[tuple[str, tuple[Any, ...]]] = []


class SqliteState(LeaseHolding):
    """`StateStore` in one SQLite file (see the module docstring)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time,
                 busy_timeout: float = 5.0) -> None:
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
        self._held: list[tuple[str, tuple[Any, ...]]] = []  # change statements not written
        self._problem: str | None = None
        self._last_write = time.monotonic()  # the last write that committed
        self._task: asyncio.Task[None] | None = None
        self._last_prune = 0.0
        self._refresh_tokens: dict[str, tuple[str, str]] = {}  # written (or held) here
        self._record_versions: dict[str, int] = {}  # kind -> its change counter (`meta`)
        self._records_seen = -1  # the data_version they were read at
        self.lease: Lease | None = None
        self._dropped: set[str] = set()
        self._dropped_log = (log, "state store: settlements of calls admitted under lease %s "
                             "were not written: the lease was found dead and their "
                             "reservations charged in full")
        self.requests = SqliteLog(log_path(path), _open_log, busy_timeout)
        self._warning: str | None = None  # the state volume is short of space
        self._last_volume = -math.inf

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
        self.flush()
        if self.lease is not None and self._conn is not None:
            await self.lease.stop()  # (after the flush: what settled is not charged)
            self.lease = None
        self.requests.close()
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
                now = self.clock()
                if now - self._last_prune > _PRUNE:
                    self._last_prune = now
                    self._prune(now)
                if time.monotonic() - self._last_volume >= _VOLUME:
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
    def problem(self) -> str | None:
        """Why the file is not being written (None: it is)."""
        return self._problem

    @property
    def warning(self) -> str | None:
        """Why the state may soon not be written (the volume is short of space), or None."""
        return self._warning

    @property
    def healthy(self) -> bool:
        return self._problem is None

    # -- the view (lookups: no I/O beyond SQLite's shared memory) --------------------------

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateUnavailable("the state store is not started")
        return self._conn

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

    def _change(self, statements: Sequence[tuple[str, tuple[Any, ...]]]) -> bool:
        """Write `statements` and raise the change counter in one transaction; on failure
        hold them (in order) for the retries. True if they are written."""
        self._held.extend(statements)
        return self._write_held()

    def _write_held(self) -> bool:
        if not self._held:
            return True
        try:
            with _transaction(self._db()) as conn:
                for sql, args in self._held:
                    conn.execute(sql, args)
                conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 "
                             "WHERE key='epoch'")
        except sqlite3.Error as exc:
            self._failed("write", exc)
            return False
        self._held = []
        self._recovered()
        return True

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

    def _mint_txn(self, op: str, sql: str, args: tuple[Any, ...]) -> int:
        """One statement in a write transaction: the rows it changed; StateUnavailable
        when the file cannot be written (the caller then mints for itself)."""
        try:
            with _transaction(self._db()) as conn:
                changed = conn.execute(sql, args).rowcount
        except sqlite3.Error as exc:
            self._failed(op, exc)
            raise StateUnavailable(f"the state file cannot be written ({self._problem})") \
                from None
        self._recovered()
        return int(changed)

    async def read_mint(self, name: str) -> SharedMint | None:
        try:
            row = self._db().execute(
                "SELECT value, parts, minted_at, expires_at, due_at FROM minted WHERE name = ? "
                "AND value IS NOT NULL", (name,)).fetchone()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            raise StateUnavailable(f"the state file cannot be read ({self._problem})") from None
        if row is None:
            return None
        value, parts, minted_at, expires_at, due_at = row
        return SharedMint(value, tuple(json.loads(parts or "[]")), minted_at, expires_at, due_at)

    async def lease_mint(self, name: str, holder: str, until: float) -> bool:
        return self._mint_txn(
            "mint", "INSERT INTO minted (name, lease_holder, lease_until) VALUES (?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET lease_holder = excluded.lease_holder, "
            "lease_until = excluded.lease_until WHERE minted.lease_until IS NULL OR "
            "minted.lease_until <= ? OR minted.lease_holder = excluded.lease_holder",
            (name, holder, until, self.clock())) == 1

    async def write_mint(self, name: str, mint: SharedMint, holder: str) -> None:
        # (SET expressions read the row as it was: the lease is dropped only if held)
        self._mint_txn(
            "mint", "INSERT INTO minted (name, value, parts, minted_at, expires_at, due_at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value, "
            "parts = excluded.parts, minted_at = excluded.minted_at, expires_at = "
            "excluded.expires_at, due_at = excluded.due_at, lease_holder = CASE WHEN "
            "lease_holder = ? THEN NULL ELSE lease_holder END, lease_until = CASE WHEN "
            "lease_holder = ? THEN NULL ELSE lease_until END",
            (name, mint.value, _json(list(mint.parts)), mint.minted_at, mint.expires_at,
             mint.due_at, holder, holder))

    async def release_mint(self, name: str, holder: str) -> None:
        with contextlib.suppress(StateUnavailable):  # (the lease lapses by itself)
            self._mint_txn("mint", "UPDATE minted SET lease_holder = NULL, lease_until = NULL "
                           "WHERE name = ? AND lease_holder = ?", (name, holder))

    async def read_refresh(self, key: str) -> tuple[str, str] | None:
        local = self._refresh_tokens.get(key)
        if local is not None and any(args[:1] == (key,) for _, args in self._held):
            return local  # (written here, not yet to the file)
        try:
            row = self._db().execute("SELECT origin, value FROM refresh_tokens WHERE key = ?",
                                     (key,)).fetchone()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            if local is not None:
                return local
            raise StateUnavailable(f"the state file cannot be read ({self._problem})") from None
        return None if row is None else (row[0], row[1])

    async def write_refresh(self, key: str, origin: str, value: str) -> None:
        """Keep a rotated refresh token (held and retried if the file cannot be written:
        the token the server rotated to is never lost while this process runs)."""
        self._refresh_tokens[key] = (origin, value)
        self._change([("INSERT INTO refresh_tokens (key, origin, value, updated_at) VALUES "
                       "(?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET origin = excluded.origin, "
                       "value = excluded.value, updated_at = excluded.updated_at",
                       (key, origin, value, self.clock()))])

    # -- shared records (`Records`: approvals, grants) ------------------------------------

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        try:
            return self._db().execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            raise StateUnavailable(f"the state file cannot be read ({self._problem})") from None

    async def record_get(self, kind: str, key: str) -> tuple[dict[str, Any], int] | None:
        rows = self._read("SELECT doc, rev FROM records WHERE kind = ? AND key = ? AND "
                          "expires_at > ?", (kind, key, self.clock()))
        return (json.loads(rows[0][0]), int(rows[0][1])) if rows else None

    async def record_list(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(doc) for (doc,) in self._read(
            "SELECT doc FROM records WHERE kind = ? AND expires_at > ?", (kind, self.clock()))]

    async def record_put(self, kind: str, key: str, doc: dict[str, Any], expires_at: float,
                         rev: int | None) -> bool:
        text = _json(doc)
        if rev is None:  # (an expired record is none: replaced)
            return self._record_txn(
                kind, "INSERT INTO records (kind, key, doc, rev, expires_at) VALUES "
                "(?, ?, ?, 1, ?) ON CONFLICT(kind, key) DO UPDATE SET doc = excluded.doc, "
                "rev = 1, expires_at = excluded.expires_at WHERE records.expires_at <= ?",
                (kind, key, text, expires_at, self.clock()))
        return self._record_txn(
            kind, "UPDATE records SET doc = ?, rev = rev + 1, expires_at = ? WHERE "
            "kind = ? AND key = ? AND rev = ? AND expires_at > ?",
            (text, expires_at, kind, key, rev, self.clock()))

    def _record_txn(self, kind: str, sql: str, args: tuple[Any, ...]) -> bool:
        """Write one record and, in the same transaction, raise its kind's change
        counter (`meta` row ``records:<kind>``) if it was written."""
        try:
            with _transaction(self._db()) as conn:
                written = conn.execute(sql, args).rowcount == 1
                if written:
                    conn.execute(_BUMP, (_RECORDS + kind,))
        except sqlite3.Error as exc:
            self._failed("record", exc)
            raise StateUnavailable(f"the state file cannot be written ({self._problem})") \
                from None
        self._recovered()
        if written:
            self._record_versions[kind] = self._record_versions.get(kind, 0) + 1
        return written

    def record_version(self, kind: str) -> int:
        """Raised whenever a record of `kind` is written, by any process of the file: its
        change counter, re-read only when SQLite says the file changed (`PRAGMA
        data_version`, the WAL index in shared memory: a few µs)."""
        conn = self._conn
        if conn is None:
            return self._record_versions.get(kind, 0)
        try:
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if version != self._records_seen:
                self._records_seen = version
                self._record_versions = {
                    key[len(_RECORDS):]: int(value) for key, value in conn.execute(
                        "SELECT key, value FROM meta WHERE key >= ? AND key < ?",
                        (_RECORDS, _RECORDS[:-1] + chr(ord(_RECORDS[-1]) + 1)))}
        except sqlite3.Error as exc:
            self._failed("read", exc)
        return self._record_versions.get(kind, 0)

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
        its bounds out (a failure is the log's: StateUnavailable, the state is not)."""
        self.requests.append(entries)

    async def log_read(self, query: LogQuery, limit: int, *, before: str | None = None,
                       after: str | None = None) -> list[tuple[str, LogEntry]]:
        return self.requests.read(query, limit, before=before, after=after)

    async def log_get(self, cursor: str) -> LogEntry | None:
        return self.requests.get(cursor)

    async def log_last(self) -> str:
        return self.requests.last()

    # -- counters -------------------------------------------------------------------------

    def count(self, increments: Iterable[Increment]) -> None:
        """Add to the pending batch; it is written within `FLUSH_DELAY` with whatever
        else was counted meanwhile (one transaction for a busy worker's many calls)."""
        self.view.add(increments)
        self._schedule_flush()

    def settle(self, holder: str, increments: Iterable[Increment]) -> None:
        """A settlement: written with the next batch, in its transaction, if `holder`'s
        lease is still in the file then (else dropped: its reservations were charged)."""
        self.view.add_settling(holder, increments)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_later(FLUSH_DELAY, self.flush)
            except RuntimeError:  # no loop (a tool, a test): now
                self.flush()

    def counter(self, table: str, field: str) -> int:
        pending = self.view.unwritten(table, field)
        try:
            row = self._db().execute(
                "SELECT value FROM counters WHERE tbl = ? AND field = ? AND expires_at > ?",
                (table, field, self.clock())).fetchone()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            row = None
        return (int(row[0]) if row else 0) + pending

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        """Whole tables as the file has them once every process has written what it
        counted (they write within `FLUSH_DELAY`): a call that ended anywhere is in."""
        await asyncio.sleep(FLUSH_DELAY + 0.005)
        self.flush()
        now = self.clock()
        out: dict[str, Table] = {}
        try:
            for table in tables:
                rows = self._db().execute(
                    "SELECT field, value FROM counters WHERE tbl = ? AND expires_at > ?",
                    (table, now)).fetchall()
                if rows:
                    out[table] = {f: int(v) for f, v in rows}
        except sqlite3.Error as exc:
            self._failed("read", exc)
        for table in tables:  # (what could not be written is still counted)
            if self.view.has_unwritten(table):
                out[table] = self.view.table(table, out.get(table, {}))
        return out

    @property
    def counters_degraded(self) -> bool:
        return self._problem is not None

    def flush(self) -> None:
        """Write the pending counter batch (and held changes) in one transaction."""
        self._flush_scheduled = False
        if self._held:
            self._write_held()
        batch = self.view.take()
        settling = self.view.take_settling()
        if (not batch and not settling) or self._conn is None:
            self.view.restore(batch)
            self.view.restore_settling(settling)
            return
        try:
            dropped = self._counters_txn(self._rows(batch), {
                holder: self._rows(tables) for holder, tables in settling.items()})
        except sqlite3.Error as exc:
            self.view.restore(batch)
            self.view.restore_settling(settling)
            self._failed("counters", exc)
            return
        self._recovered()
        for holder in dropped:
            self._settlements_dropped(holder)

    def _rows(self, batch: dict[str, Table]) -> list[tuple[str, str, int, float]]:
        return [(table, field, amount, self.view.expires.get(table, 0.0))
                for table, fields in batch.items() for field, amount in fields.items()]

    def _counters_txn(self, rows: list[tuple[str, str, int, float]],
                      settling: dict[str, list[tuple[str, str, int, float]]]) -> list[str]:
        """The batch, and each holder's settlements if its lease stands; the holders
        whose settlements were dropped."""
        dropped = []
        with _transaction(self._db()) as conn:
            conn.executemany(_ADD, rows)
            for holder, settled in settling.items():
                if conn.execute("SELECT 1 FROM leases WHERE holder = ?",
                                (holder,)).fetchone() is None:
                    dropped.append(holder)
                else:
                    conn.executemany(_ADD, settled)
        return dropped

    # -- leases (`leases.LeaseStore`; `holder`, `take_lease`: `LeaseHolding`) -------------

    async def lease_claim(self, holder: str, slot: str, ttl: float, takeover: bool) -> bool:
        try:
            with _transaction(self._db()) as conn:
                if takeover:
                    conn.execute("UPDATE leases SET expires_at = 0 WHERE slot = ? AND "
                                 "holder != ?", (slot, holder))
                conn.execute("INSERT INTO leases (holder, slot, expires_at) VALUES (?, ?, ?) "
                             "ON CONFLICT(holder) DO UPDATE SET expires_at = "
                             "excluded.expires_at", (holder, slot, self.clock() + ttl))
        except sqlite3.Error as exc:
            self._failed("lease", exc)
            return False
        self._recovered()
        return True

    async def lease_renew(self, holder: str, ttl: float) -> bool | None:
        try:
            with _transaction(self._db()) as conn:
                kept = conn.execute("UPDATE leases SET expires_at = ? WHERE holder = ?",
                                    (self.clock() + ttl, holder)).rowcount == 1
        except sqlite3.Error as exc:
            self._failed("lease", exc)
            return None
        self._recovered()
        return kept

    async def lease_reap(self, release: str | None) -> list[Charged] | None:
        """One transaction: every record of a holder without a live lease charged as
        used and deleted, with the dead leases (and `release`'s)."""
        now = self.clock()
        try:
            with _transaction(self._db()) as conn:
                if release is not None:
                    conn.execute("DELETE FROM leases WHERE holder = ?", (release,))
                live = {h for (h,) in conn.execute(
                    "SELECT holder FROM leases WHERE expires_at > ?", (now,))}
                charged = self._charge(conn, live, now)
                conn.execute("DELETE FROM leases WHERE expires_at <= ?", (now,))
        except sqlite3.Error as exc:
            self._failed("lease", exc)
            return None
        self._recovered()
        return charged

    @staticmethod
    def _charge(conn: sqlite3.Connection, live: set[str], now: float) -> list[Charged]:
        charged: list[Charged] = []
        gone: list[tuple[str, str]] = []
        for name, value in conn.execute("SELECT field, value FROM counters WHERE tbl = ?",
                                        (ORPHANS,)).fetchall():
            held = parse_held(name)
            if held is not None and held[0] in live:
                if value == 0:  # (settled: nothing to keep)
                    gone.append((ORPHANS, name))
                continue
            gone.append((ORPHANS, name))
            target = charge_of(held[2]) if held is not None else None
            if held is None or target is None or value <= 0:
                continue
            holder, table, field = held
            row = conn.execute("SELECT expires_at FROM counters WHERE tbl = ? AND field = ? "
                               "AND expires_at > ?", (table, field, now)).fetchone()
            if row is None:
                continue  # (its window is over)
            conn.executemany(_ADD, [(table, target, value, row[0]),
                                    (table, field, -value, row[0])])
            charged.append(Charged(holder, table, field, int(value)))
        conn.executemany("DELETE FROM counters WHERE tbl = ? AND field = ?", gone)
        return charged

    def admit(self, admission: Admission) -> int | None:
        """Check `admission`'s limits against the committed counters and, if every one
        holds, write its increments, in one transaction: None if admitted, else the
        index of the first limit that refused it."""
        self.flush()  # (what this process counted so far is in the file first)
        now = self.clock()
        try:
            with _transaction(self._db()) as conn:
                refused = first_refused(admission, lambda table, field: _value(
                    conn.execute("SELECT value FROM counters WHERE tbl = ? AND field = ? "
                                 "AND expires_at > ?", (table, field, now)).fetchone()))
                if refused is None:
                    conn.executemany(_ADD, list(admission.increments))
        except sqlite3.Error as exc:
            # Cannot decide across processes: decide on this process's reading (the
            # outage is reported) and keep the increments to write later.
            self._failed("admit", exc)
            refused = first_refused(admission, self.counter)
            if refused is None:
                self.view.add(admission.increments)
            return refused
        self._recovered()
        return refused

    # -- housekeeping ---------------------------------------------------------------------

    def _prune(self, now: float) -> None:
        try:
            with _transaction(self._db()) as conn:
                for table in ("counters", "revoked", "ephemeral", "records"):
                    conn.execute(f"DELETE FROM {table} WHERE expires_at <= ?",  # noqa: S608
                                 (now,))
                conn.execute("DELETE FROM minted WHERE (value IS NULL OR expires_at <= ?) AND "
                             "(lease_until IS NULL OR lease_until <= ?)", (now, now))
        except sqlite3.Error as exc:
            self._failed("prune", exc)

    def _probe(self) -> None:
        """A write nothing reads (`meta` row `probe`): does the file take writes now? So
        every process notices an outage within a few seconds, and its end within one,
        not only the process whose write failed (`problem`, `/readyz`)."""
        try:
            with _transaction(self._db()) as conn:
                conn.execute("INSERT INTO meta (key, value) VALUES ('probe', ?) ON CONFLICT"
                             "(key) DO UPDATE SET value = excluded.value", (str(time.time()),))
        except sqlite3.Error as exc:
            self._failed("probe", exc)
            return
        self._recovered()

    def _failed(self, op: str, exc: BaseException) -> None:
        metrics.STATE_STORE_ERRORS.labels(op=op).inc()
        reason = f"{type(exc).__name__}: {exc}"
        if self._problem is None:
            self._problem = f"the state file {self.path} cannot be used ({reason})"
            metrics.STATE_STORE_UP.labels(store=_STORE).set(0)
            log.error("state store: %s; enforcing from this process's view, and writing what "
                      "it holds when the file is usable again", self._problem)

    def _recovered(self) -> None:
        self._last_write = time.monotonic()
        if self._problem is not None:
            self._problem = None
            metrics.STATE_STORE_UP.labels(store=_STORE).set(1)
            log.warning("state store: the state file %s is written again", self.path)

    # -- tools ----------------------------------------------------------------------------

    def backup(self, target: Path) -> None:
        """An online copy of the database (SQLite's backup API), mode 0600."""
        backup_file(self.path, target)

    def dump(self) -> dict[str, int]:
        """What the file holds, in rows per table (no values)."""
        return _counts(self._db())


_TABLES = ("revoked", "sandboxes", "ephemeral", "counters", "minted", "refresh_tokens",
           "records", "log", "leases")  # (log: in files of schema 4 to 6)


def _counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Rows per table (of those the file's schema version has)."""
    present = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    return {name: int(conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0])  # noqa: S608
            for name in _TABLES if name in present}


def summary(path: Path) -> tuple[int, dict[str, int]]:
    """The schema version and rows per table of the file at `path`, read-only (`state
    check`; no values)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0]), _counts(conn)
    finally:
        conn.close()


def log_summary(path: Path) -> tuple[int, int] | None:
    """Lines in the request log of the state file `path` and the bytes of its pages in
    use, read-only; None when it has none (yet)."""
    file = log_path(path)
    if not file.exists():
        return None
    conn = sqlite3.connect(f"file:{file}?mode=ro", uri=True, timeout=5)
    try:
        lines = int(conn.execute("SELECT count(*) FROM log").fetchone()[0])
        pages, free, page = (int(conn.execute(f"PRAGMA {name}").fetchone()[0])
                             for name in ("page_count", "freelist_count", "page_size"))
        return lines, (pages - free) * page
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def backup_file(source: Path, target: Path) -> None:
    """Copy the database at `source` to `target` online (SQLite's backup API: a
    consistent snapshot while the gateway keeps writing), mode 0600."""
    _prepare(target)
    src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
    try:
        dst = sqlite3.connect(str(target))
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()
    os.chmod(target, 0o600)


def _value(row: tuple[Any, ...] | None) -> int:
    return int(row[0]) if row else 0


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
