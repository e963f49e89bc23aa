"""The state file's schema: its versions, the migrations between them, and opening a
file brought up to date (`open_file`: every process of the store, and the worker
supervisor once before the workers start).

A file that is not a database, or has a newer schema than this gateway knows, stops the
start with the path and what to do.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from gateway.services.state.base import StateUnavailable
from gateway.services.state.sqlite_connect import connect, prepare, transaction
from gateway.services.state.sqlite_log import log_path

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "StateFileError", "open_file"]

log = logging.getLogger("sandbox_gateway.state")

SCHEMA_VERSION = 8
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
    8: (  # each process's share of a budget, held while it may decide alone
        # (`state/alone_records.py`): a record per limit (`tbl`: its key) and holder
        "CREATE TABLE IF NOT EXISTS shares (tbl TEXT NOT NULL, holder TEXT NOT NULL, "
        "slot TEXT NOT NULL, serial INTEGER NOT NULL, record TEXT NOT NULL, "
        "expires_at REAL NOT NULL, PRIMARY KEY (tbl, holder)) WITHOUT ROWID",
    ),
}


class StateFileError(Exception):
    """The state file cannot be used (not a database, a newer schema, unreadable); the
    message names the path and what to do."""

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
    with transaction(conn):
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
        prepare(path)
        conn = connect(path, busy_timeout)
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

