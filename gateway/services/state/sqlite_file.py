"""What the parts of the SQLite store share (`sqlite.py`: `SqliteState` is made of them):
this process's connection to the state file, whether the file takes writes (`problem`),
and the changes it could not write yet.

A write that fails (disk full, read-only file) keeps what it could not write, in order,
for the store's retries (`_change`, `_write_held`); `problem` says so (`/readyz`), one
log line when it starts and one when it ends, and
`sandbox_gateway_state_store_up{store="sqlite"}` is 0 meanwhile. A probe (`_probe`: a
write nothing reads) lets a process that writes nothing notice an outage and its end.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.observability import metrics
from gateway.services.state.base import StateUnavailable
from gateway.services.state.sqlite_connect import transaction

__all__ = ["SqliteFile", "json_text"]

log = logging.getLogger("sandbox_gateway.state")

_STORE = "sqlite"


class SqliteFile:
    """The connection, its health and the held changes (set up by `SqliteState`)."""

    path: Path
    clock: Callable[[], float]
    _conn: sqlite3.Connection | None
    _held: list[tuple[str, tuple[Any, ...]]]  # change statements not written
    _problem: str | None
    _last_write: float  # monotonic: the last write that committed

    @property
    def problem(self) -> str | None:
        """Why the file is not being written (None: it is)."""
        return self._problem

    @property
    def healthy(self) -> bool:
        return self._problem is None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateUnavailable("the state store is not started")
        return self._conn

    def _change(self, statements: Sequence[tuple[str, tuple[Any, ...]]]) -> bool:
        """Write `statements` and raise the change counter in one transaction; on failure
        hold them (in order) for the retries. True if they are written."""
        self._held.extend(statements)
        return self._write_held()

    def _write_held(self) -> bool:
        if not self._held:
            return True
        try:
            with transaction(self._db()) as conn:
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

    def _probe(self) -> None:
        """A write nothing reads (`meta` row `probe`): does the file take writes now? So
        every process notices an outage within a few seconds, and its end within one,
        not only the process whose write failed (`problem`, `/readyz`)."""
        try:
            with transaction(self._db()) as conn:
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


def json_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
