"""The console's request log in its own SQLite file, next to the state file (`sqlite`
store): `gateway-requests.db` beside `gateway.db`.

Apart from the state that must survive (revocations, budgets, registrations) because it
is the one part that grows with traffic: in the state file, 100,000 lines made it 75 MB,
and a log that filled the volume was a state-store outage (revocations and budgets not
written). Here it has its own file, its own write lock (a batch of lines never waits
for, nor holds up, a revocation) and a bound in bytes as well as in lines:

- **lines** (`lines`, `console.retain: 100000`): the oldest beyond the count go with
  each batch (ids only grow, so that is one range delete);
- **bytes** (`max_bytes`, `console.retain: 50MiB`, and 1 KiB a line for a bound in
  lines: `log.BYTES_PER_LINE`): when the pages in use pass it, the oldest lines go
  until a tenth of it is free again (freed pages are reused: the file stays at the
  bound). SQLite's `max_page_count` is set a little above it, so no write can grow the
  file past it whatever the lines hold: a batch that hits it (`SQLITE_FULL`) makes room
  by dropping a quarter of the log and is written once more;
- **its WAL** is truncated to `WAL_LIMIT` after each checkpoint (`journal_size_limit`);
- **holding** (`hold`): while the state volume is short of space (`SqliteState` watches
  it), the file does not grow at all: new lines replace the oldest.

A write that still fails raises `StateUnavailable`: the request log's feed holds the
lines and retries (`log_feed.py`); the state store is not marked unavailable for it.

The store uses it from threads (`SqliteState.log_append`: a batch of a few hundred lines
took 3-5 ms, a checkpoint 25, on the event loop): one lock makes each use of its
connection whole.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.observability import metrics
from gateway.services.state.base import StateUnavailable
from gateway.services.state.log import COLUMNS, RETAIN, LogEntry, LogQuery, cursor_number
from gateway.services.state.sqlite_connect import transaction

__all__ = ["LOG_SCHEMA", "WAL_LIMIT", "SqliteLog", "log_path"]

LOG_SCHEMA = 1  # the request-log file's own schema version (PRAGMA user_version)
WAL_LIMIT = 4 * 1024 * 1024  # bytes its WAL is truncated to after a checkpoint
_COLUMNS = ", ".join(COLUMNS)
_SLACK = 1024 * 1024  # bytes max_page_count allows past the bound (a batch's room)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS log (id INTEGER PRIMARY KEY, at REAL NOT NULL, "
    "sandbox TEXT NOT NULL, policy TEXT NOT NULL, host TEXT NOT NULL, "
    "decision TEXT NOT NULL, code TEXT NOT NULL, engine TEXT NOT NULL, line TEXT NOT NULL)",
)


def log_path(state: Path) -> Path:
    """The request log's file for the state file `state` (`gateway.db` ->
    `gateway-requests.db`, in the same directory)."""
    return state.with_name(f"{state.stem}-requests{state.suffix or '.db'}")


class SqliteLog:
    """See the module docstring. Opened at its first use (no file with `console.retain:
    0`); `connect(path, busy_timeout)` opens a connection the way the state file's are
    (WAL, the file 0600 in a 0700 directory), a new file with `auto_vacuum=INCREMENTAL`
    (pages freed past a lowered bound can be given back)."""

    def __init__(self, path: Path, connect: Any, busy_timeout: float = 5.0) -> None:
        self.path = path
        self._connect = connect
        self.busy_timeout = busy_timeout
        self.lines = RETAIN
        self.max_bytes = RETAIN * 1024
        self._held: int | None = None  # holding: the bytes it may use (None: not held)
        self._holding = False
        self._conn: sqlite3.Connection | None = None
        self._page = 4096
        self._cap_pages = 0  # max_page_count as set
        self._lock = threading.Lock()  # (one use of the connection at a time)

    # -- the file -------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            try:
                conn = self._connect(self.path, self.busy_timeout)
            except (sqlite3.Error, OSError) as exc:
                raise self._failed(exc) from None
            try:
                version = int(conn.execute("PRAGMA user_version").fetchone()[0])
                if version > LOG_SCHEMA:
                    raise sqlite3.DatabaseError(
                        f"schema version {version} is newer than this gateway's ({LOG_SCHEMA})")
                if version < LOG_SCHEMA:
                    with transaction(conn):
                        for statement in _SCHEMA:
                            conn.execute(statement)
                        conn.execute(f"PRAGMA user_version={LOG_SCHEMA}")
                conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
                self._page = int(conn.execute("PRAGMA page_size").fetchone()[0])
            except sqlite3.Error as exc:
                conn.close()
                raise self._failed(exc) from None
            self._conn = conn
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _failed(self, exc: BaseException) -> StateUnavailable:
        metrics.STATE_STORE_ERRORS.labels(op="log").inc()
        return StateUnavailable(f"the request log {self.path} cannot be used "
                                f"({type(exc).__name__}: {exc})")

    def _used(self, conn: sqlite3.Connection) -> int:
        """Bytes of the file's pages in use (free pages are reused before it grows)."""
        pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
        return (pages - free) * self._page

    def hold(self, holding: bool) -> None:
        """While `holding` (the state volume is short of space) the file does not grow:
        the bound becomes what it uses when the hold begins."""
        self._holding = holding
        if not holding:
            self._held = None

    @property
    def holding(self) -> bool:
        return self._holding

    def _bound(self, conn: sqlite3.Connection) -> int:
        """The bytes the log may use now: its bound, or while held what it used when the
        hold began."""
        bound = self.max_bytes or (1 << 62)
        if self._holding:
            if self._held is None:
                self._held = max(self._used(conn), self._page * 8)
            bound = min(bound, self._held)
        return bound

    def _cap(self, conn: sqlite3.Connection, bound: int) -> None:
        """No write grows the file past the bound plus a batch's room."""
        pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        wanted = max(pages, math.ceil((bound + _SLACK) / self._page)) \
            if bound < 1 << 62 else 0xFFFFFFFE
        if wanted != self._cap_pages:
            conn.execute(f"PRAGMA max_page_count={wanted}")
            self._cap_pages = wanted

    # -- writing --------------------------------------------------------------------------

    def append(self, entries: Sequence[LogEntry]) -> None:
        """One transaction: the entries in, the oldest beyond the bounds out."""
        with self._lock:
            self._appended(entries)

    def _appended(self, entries: Sequence[LogEntry]) -> None:
        try:
            conn = self._db()
            bound = self._bound(conn)
            self._cap(conn, bound)
            try:
                self._append(conn, entries, bound)
            except sqlite3.OperationalError as exc:
                if "full" not in str(exc):
                    raise
                # The cap (or the disk): make room by dropping a quarter, once.
                with transaction(conn):
                    self._drop_oldest(conn, fraction=0.25)
                self._append(conn, entries, bound)
            self._shrink(conn, bound)
        except sqlite3.Error as exc:
            raise self._failed(exc) from None

    def _shrink(self, conn: sqlite3.Connection, bound: int) -> None:
        """A file larger than its bound (the bound was lowered) gives its free pages back
        to the volume."""
        pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        if pages * self._page > bound + _SLACK:
            free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
            if free:
                conn.execute(f"PRAGMA incremental_vacuum({free})").fetchall()
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                self._cap_pages = 0  # (set again for the smaller file)

    def _append(self, conn: sqlite3.Connection, entries: Sequence[LogEntry],
                bound: int) -> None:
        with transaction(conn):
            conn.executemany(f"INSERT INTO log ({_COLUMNS}) VALUES "  # noqa: S608
                             "(?, ?, ?, ?, ?, ?, ?, ?)", entries)
            if self.lines:
                conn.execute("DELETE FROM log WHERE id <= last_insert_rowid() - ?",
                              (self.lines,))
            used = self._used(conn)
            if used > bound:
                self._drop_oldest(conn, fraction=1 - 0.9 * bound / used)

    def _drop_oldest(self, conn: sqlite3.Connection, fraction: float) -> None:
        """Delete the oldest `fraction` of the lines (ids are contiguous: the oldest are
        the lowest)."""
        low, high = conn.execute("SELECT min(id), max(id) FROM log").fetchone()
        if low is None:
            return
        count = max(1, math.ceil((high - low + 1) * min(1.0, fraction)))
        conn.execute("DELETE FROM log WHERE id < ?", (low + count,))

    # -- reading --------------------------------------------------------------------------

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        try:
            with self._lock:
                return self._db().execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise self._failed(exc) from None

    def read(self, query: LogQuery, limit: int, *, before: str | None = None,
             after: str | None = None) -> list[tuple[str, LogEntry]]:
        where, args = query.where()
        if after is not None:
            where, order = f"{where} AND id > ?", "ASC"
            args.append(cursor_number(after))
        else:
            order = "DESC"
            if before is not None:
                where += " AND id < ?"
                args.append(cursor_number(before))
        rows = self._read(f"SELECT id, {_COLUMNS} FROM log WHERE {where} "  # noqa: S608
                          f"ORDER BY id {order} LIMIT ?", (*args, limit))
        return [(str(row[0]), LogEntry(*row[1:])) for row in rows]

    def get(self, cursor: str) -> LogEntry | None:
        rows = self._read(f"SELECT {_COLUMNS} FROM log WHERE id = ?",  # noqa: S608
                          (int(cursor),)) if cursor.isdigit() else []
        return LogEntry(*rows[0]) if rows else None

    def last(self) -> str:
        rows = self._read("SELECT max(id) FROM log", ())
        return str(rows[0][0] or 0)

    def used_bytes(self) -> int:
        """Bytes of the file in use (for tests and `state check`)."""
        try:
            with self._lock:
                return self._used(self._db())
        except sqlite3.Error as exc:
            raise self._failed(exc) from None
