"""`RedisState`'s part for the console's request log (`state/log.py`): a stream,
`<prefix>:log`, capped near its bound (`log_retain` entries, and `log_retain_bytes` at
the mean entry size seen so far) by `XADD MAXLEN ~`, read in chunks and filtered here (a
stream has no query language).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from gateway.observability import metrics
from gateway.services.state.log import RETAIN, LogEntry, LogQuery, entry_bytes
from gateway.services.state.redis_link import RedisLink

__all__ = ["RedisLog"]

_LOG_FIELDS = ("a", "s", "p", "h", "d", "c", "e", "l")
_LOG_CHUNK = 1000
_STREAM_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def _log_entry(values: dict[Any, Any]) -> LogEntry | None:
    try:
        at, *rest = (values[k] for k in _LOG_FIELDS)
        return LogEntry(float(at), *(str(v) for v in rest))
    except (KeyError, ValueError, TypeError):
        metrics.STATE_STORE_ERRORS.labels(op="decode").inc()
        return None


class RedisLog(RedisLink):
    """The request log in a Redis stream."""

    _log_key: str
    log_retain: int
    log_retain_bytes: int
    _entry_bytes: float  # the entries' mean size so far (a bound in bytes)

    def _log_cap(self) -> int:
        """The stream's length bound: `log_retain` entries and, for `log_retain_bytes`,
        as many entries as fit at the mean size seen so far (so near, not exact)."""
        caps = [self.log_retain] if self.log_retain else []
        if self.log_retain_bytes:
            caps.append(max(1, int(self.log_retain_bytes / (self._entry_bytes or 1024))))
        return min(caps) if caps else RETAIN

    async def log_append(self, entries: Sequence[LogEntry]) -> None:
        if entries:
            mean = sum(map(entry_bytes, entries)) / len(entries)
            self._entry_bytes = mean if not self._entry_bytes else \
                0.9 * self._entry_bytes + 0.1 * mean
        cap = self._log_cap()

        async def add(r: Any) -> None:
            pipe = r.pipeline(transaction=False)
            for e in entries:
                pipe.xadd(self._log_key, dict(zip(_LOG_FIELDS, e, strict=True)),
                          maxlen=cap, approximate=True)
            await pipe.execute()

        await self._op("log", add)

    async def log_read(self, query: LogQuery, limit: int, *, before: str | None = None,
                       after: str | None = None) -> list[tuple[str, LogEntry]]:
        """Read in chunks, filtered here (a stream has no query language), at most the
        retained entries."""
        out: list[tuple[str, LogEntry]] = []
        edge = f"({after}" if after is not None else f"({before}" if before else None
        for _ in range(max(1, self._log_cap() // _LOG_CHUNK + 1)):
            chunk = await self._op("log", functools.partial(self._log_chunk, edge,
                                                            after is not None))
            for ident, values in chunk:
                entry = _log_entry(values)
                if entry is not None and query.matches(entry):
                    out.append((str(ident), entry))
                    if len(out) >= limit:
                        return out
            if len(chunk) < _LOG_CHUNK:
                break
            edge = f"({chunk[-1][0]}"
        return out

    async def _log_chunk(self, edge: str | None, forward: bool, r: Any) -> Any:
        if forward:
            return await r.xrange(self._log_key, min=edge, max="+", count=_LOG_CHUNK)
        return await r.xrevrange(self._log_key, max=edge or "+", min="-", count=_LOG_CHUNK)

    async def log_get(self, cursor: str) -> LogEntry | None:
        if not _STREAM_ID.fullmatch(cursor):
            return None
        found = await self._op("log", lambda r: r.xrange(self._log_key, min=cursor,
                                                         max=cursor, count=1))
        return _log_entry(found[0][1]) if found else None

    async def log_last(self) -> str:
        found = await self._op("log", lambda r: r.xrevrange(self._log_key, count=1))
        return str(found[0][0]) if found else "0"

    # -- lifecycle --------------------------------------------------------------------
