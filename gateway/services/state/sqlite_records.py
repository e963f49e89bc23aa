"""The SQLite store's shared JSON records (`Records`: ask mode's approvals and grants,
MCP tool pins, console sessions), with each kind's change counter: `SqliteState`'s part
for them."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from typing import Any

from gateway.services.state.base import StateUnavailable
from gateway.services.state.file_changes import FileChanges
from gateway.services.state.sqlite_connect import transaction
from gateway.services.state.sqlite_file import SqliteFile, json_text

__all__ = ["SqliteRecords"]

# A record kind's change counter, raised with every write of a record of that kind.
_RECORDS = "records:"
_BUMP = ("INSERT INTO meta (key, value) VALUES (?, '1') ON CONFLICT(key) DO UPDATE SET "
         "value = CAST(value AS INTEGER) + 1")
# The counters are re-read at most this often: one watcher's check asks for each kind it
# follows in turn, and one look at the file answers them all (this process's own writes
# count at once, `_record_txn`).
_RECHECK = 0.005  # seconds


class SqliteRecords(SqliteFile):
    """Shared records in the state file."""

    _record_versions: dict[str, int]  # kind -> its change counter (`meta`)
    _records_seen: int  # the data_version they were read at
    _records_next = 0.0  # monotonic: when the file is looked at again
    _wakeup: asyncio.Event | None  # (record_wakeup)
    _changes: FileChanges | None  # the file's writes by any process (inotify)

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
        text = json_text(doc)
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
            with transaction(self._db()) as conn:
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
            if self._wakeup is not None:
                self._wakeup.set()
        return written

    def record_wakeup(self) -> asyncio.Event | None:
        """Set when the file (or its WAL) is written by any process (inotify), and by
        this process's record writes; None where inotify is not available (the watcher
        then asks every 50 ms)."""
        if self._wakeup is not None:
            return self._wakeup
        changes = FileChanges.open(self.path)
        if changes is None:
            return None
        self._changes = changes
        self._wakeup = asyncio.Event()
        asyncio.get_running_loop().add_reader(changes.fileno(), self._file_written)
        return self._wakeup

    def _file_written(self) -> None:
        changes, wakeup = self._changes, self._wakeup
        if changes is not None and wakeup is not None and changes.read():
            self._records_next = 0.0  # (look at the file at the next ask, not in 5 ms)
            wakeup.set()
            self.file_changed()

    def file_changed(self) -> None:
        """Another process (or this one) wrote the file: the counters' hook."""

    def record_version(self, kind: str) -> int:
        """Raised whenever a record of `kind` is written, by any process of the file: its
        change counter, re-read only when SQLite says the file changed (`PRAGMA
        data_version`, the WAL index in shared memory: a few µs)."""
        conn = self._conn
        now = time.monotonic()
        if conn is None or now < self._records_next:
            return self._record_versions.get(kind, 0)
        self._records_next = now + _RECHECK
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

