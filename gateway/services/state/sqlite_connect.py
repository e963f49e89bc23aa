"""Opening a SQLite file of the state store the one way each is opened (the state file,
`sqlite_schema.py`; the request log's, `sqlite_log.py`): made 0600 in a 0700 directory,
in WAL mode (readers never wait for the writer), writes in `BEGIN IMMEDIATE`
transactions (no other process writes between a transaction's reads and writes)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["connect", "open_log", "prepare", "transaction"]


def connect(path: Path, busy_timeout: float, *,
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
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
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


def prepare(path: Path) -> None:
    """The directory (0700) and the file (0600) before SQLite opens it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


def open_log(path: Path, busy_timeout: float) -> sqlite3.Connection:
    """A connection to the request log's file (made 0600 in a 0700 directory)."""
    prepare(path)
    return connect(path, busy_timeout, incremental=True)
