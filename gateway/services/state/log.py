"""The request log the console reads: recent audit lines, shared by every process of a
store and bounded (`console.retain`: lines, bytes, or both), filtered by the fields
people look for.

Not the audit trail: that is `audit.path` / stdout, complete and in order
(`gateway/observability/audit.py`). This is a copy of its newest lines, kept where every
worker and replica can read them — a ring in memory (`memory`: one process), its own
SQLite file next to the state file (`sqlite`: the processes of a host;
`sqlite_log.py`) or a capped stream (`redis`: replicas) — so a console page served by
any process shows them all.

Cursors are the store's own ids as text, increasing: the page after `before` is older,
`after` gives newer lines, oldest first (the live stream's poll).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

__all__ = ["BYTES_PER_LINE", "RETAIN", "LogEntry", "LogLines", "LogQuery", "MemoryLog",
           "cursor_number", "entry_bytes"]

RETAIN = 100_000  # console.retain default (lines)
# A bound in lines also bounds the log's size: at most this many bytes a line on average
# (measured: 750 bytes a line in the SQLite file with the gateway's usual audit lines).
BYTES_PER_LINE = 1024
_OVERHEAD = 64  # bytes a row costs besides its text (ids, time, SQLite's cell and page)


class LogEntry(NamedTuple):
    """One audit line and the fields it is filtered by (a tuple: a row as stored)."""

    at: float
    sandbox: str
    policy: str
    host: str
    decision: str
    code: str  # the refusal's error code ("" for none)
    engine: str
    line: str  # the audit line (JSON)

    @classmethod
    def of(cls, record: dict[str, Any], at: float, line: str) -> LogEntry:
        """The entry of an audit record (`core/audit.record`) written as `line`."""
        return cls(at, record.get("sandbox") or "", record.get("policy") or "",
                   record.get("host") or "", record.get("decision") or "",
                   record.get("error") or "", record.get("engine") or "", line)



COLUMNS = LogEntry._fields


def entry_bytes(entry: LogEntry) -> int:
    """What an entry costs in the log, about (its text and fields plus a row's overhead)."""
    return (len(entry.line) + len(entry.sandbox) + len(entry.policy) + len(entry.host)
            + len(entry.decision) + len(entry.code) + len(entry.engine) + _OVERHEAD)
_EXACT = ("sandbox", "policy", "decision", "code", "engine")


@dataclass(frozen=True, slots=True)
class LogQuery:
    """What a page asks for: each field given must match (`host` is a part of the name,
    case-insensitive; the others exact), between `since` and `until` (Unix seconds)."""

    sandbox: str = ""
    policy: str = ""
    host: str = ""
    decision: str = ""
    code: str = ""
    engine: str = ""
    since: float | None = None
    until: float | None = None

    def matches(self, entry: LogEntry) -> bool:
        for name in _EXACT:
            wanted = getattr(self, name)
            if wanted and getattr(entry, name) != wanted:
                return False
        return (not self.host or self.host.lower() in entry.host.lower()) and (
            self.since is None or entry.at >= self.since) and (
            self.until is None or entry.at <= self.until)

    def where(self) -> tuple[str, list[Any]]:
        """The SQL condition (over the `log` table's columns) and its arguments."""
        terms, args = ["1"], []
        for name in _EXACT:
            wanted = getattr(self, name)
            if wanted:
                terms.append(f"{name} = ?")
                args.append(wanted)
        if self.host:
            terms.append("instr(lower(host), ?) > 0")
            args.append(self.host.lower())
        if self.since is not None:
            terms.append("at >= ?")
            args.append(self.since)
        if self.until is not None:
            terms.append("at <= ?")
            args.append(self.until)
        return " AND ".join(terms), args


def cursor_number(cursor: str) -> int:
    """A cursor as the id of the memory and SQLite logs (the page checks its form: digits,
    or a Redis stream id, whose first part is taken)."""
    return int(cursor.partition("-")[0])


class LogLines(Protocol):
    """The request log of a state store, bounded by `log_retain` lines and
    `log_retain_bytes` bytes (0: no bound of that kind). Raise `StateUnavailable` when it
    cannot answer."""

    async def log_append(self, entries: Sequence[LogEntry]) -> None:
        """Add `entries` (oldest first); the oldest beyond the store's bound go."""
    async def log_read(self, query: LogQuery, limit: int, *, before: str | None = None,
                       after: str | None = None) -> list[tuple[str, LogEntry]]:
        """Up to `limit` matching entries: newest first (older than `before` when given),
        or with `after`, the ones newer than it, oldest first."""
    async def log_get(self, cursor: str) -> LogEntry | None: ...
    async def log_last(self) -> str:
        """The newest entry's cursor ("0": none yet): a live stream starts after it."""


class MemoryLog:
    """`LogLines` for one process: a ring of at most `log_retain` entries and
    `log_retain_bytes` bytes (`entry_bytes`)."""

    def __init__(self, retain: int = RETAIN) -> None:
        self._ring: deque[tuple[int, LogEntry, int]] = deque()
        self._ids = itertools.count(1)
        self._bytes = 0
        self._lines = retain
        self._max_bytes = 0

    @property
    def log_retain(self) -> int:
        return self._lines

    @log_retain.setter
    def log_retain(self, retain: int) -> None:
        self._lines = retain
        self._trim()

    @property
    def log_retain_bytes(self) -> int:
        return self._max_bytes

    @log_retain_bytes.setter
    def log_retain_bytes(self, size: int) -> None:
        self._max_bytes = size
        self._trim()

    def _trim(self) -> None:
        ring = self._ring
        while ring and ((self._lines and len(ring) > self._lines)
                        or (self._max_bytes and self._bytes > self._max_bytes)):
            self._bytes -= ring.popleft()[2]

    async def log_append(self, entries: Sequence[LogEntry]) -> None:
        for entry in entries:
            size = entry_bytes(entry)
            self._ring.append((next(self._ids), entry, size))
            self._bytes += size
        self._trim()

    async def log_read(self, query: LogQuery, limit: int, *, before: str | None = None,
                       after: str | None = None) -> list[tuple[str, LogEntry]]:
        out: list[tuple[str, LogEntry]] = []
        if after is not None:
            start = cursor_number(after)
            for ident, entry, _ in self._ring:
                if ident > start and query.matches(entry):
                    out.append((str(ident), entry))
                    if len(out) >= limit:
                        break
            return out
        end = cursor_number(before) if before is not None else None
        for ident, entry, _ in reversed(self._ring):
            if (end is None or ident < end) and query.matches(entry):
                out.append((str(ident), entry))
                if len(out) >= limit:
                    break
        return out

    async def log_get(self, cursor: str) -> LogEntry | None:
        try:
            wanted = int(cursor)
        except ValueError:
            return None
        if not self._ring or not self._ring[0][0] <= wanted <= self._ring[-1][0]:
            return None
        return self._ring[wanted - self._ring[0][0]][1]

    async def log_last(self) -> str:
        return str(self._ring[-1][0]) if self._ring else "0"
