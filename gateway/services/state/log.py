"""The request log the console reads: recent audit lines, shared by every process of a
store and bounded (`console.retain` lines), filtered by the fields people look for.

Not the audit trail: that is `audit.path` / stdout, complete and in order
(`gateway/observability/audit.py`). This is a copy of its newest lines, kept where every
worker and replica can read them — a ring in memory (`memory`: one process), a table in
the state file (`sqlite`: the processes of a host) or a capped stream (`redis`:
replicas) — so a console page served by any process shows them all.

Cursors are the store's own ids as text, increasing: the page after `before` is older,
`after` gives newer lines, oldest first (the live stream's poll).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

__all__ = ["RETAIN", "LogEntry", "LogLines", "LogQuery", "MemoryLog", "cursor_number"]

RETAIN = 100_000  # console.retain default


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
    """The request log of a state store. Raise `StateUnavailable` when it cannot answer."""

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
    """`LogLines` for one process: a ring of `retain` entries."""

    def __init__(self, retain: int = RETAIN) -> None:
        self._ring: deque[tuple[int, LogEntry]] = deque(maxlen=retain)
        self._ids = itertools.count(1)

    @property
    def log_retain(self) -> int:
        return self._ring.maxlen or 0

    @log_retain.setter
    def log_retain(self, retain: int) -> None:
        self._ring = deque(self._ring, maxlen=retain)

    async def log_append(self, entries: Sequence[LogEntry]) -> None:
        self._ring.extend((next(self._ids), entry) for entry in entries)

    async def log_read(self, query: LogQuery, limit: int, *, before: str | None = None,
                       after: str | None = None) -> list[tuple[str, LogEntry]]:
        out: list[tuple[str, LogEntry]] = []
        if after is not None:
            start = cursor_number(after)
            for ident, entry in self._ring:
                if ident > start and query.matches(entry):
                    out.append((str(ident), entry))
                    if len(out) >= limit:
                        break
            return out
        end = cursor_number(before) if before is not None else None
        for ident, entry in reversed(self._ring):
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
