"""Counters every gateway process adds to: usage totals and budget consumption.

A counter is ``table`` -> ``field`` -> integer, and a table expires at a given time (a
budget window's end, an hourly usage bucket's retention). The state stores implement
``Counters``:

* ``count`` and ``counter`` are synchronous and do no I/O: a request never waits on a
  file or on Redis. ``count`` adds to a local pending batch; ``counter`` answers the
  last known shared value plus what is pending here.
* the batch is shared every ``interval`` (0.25 s): appended to the counters journal
  (worker processes on one host) or sent to Redis (replicas), which also refreshes the
  shared values this process reads.
* ``counter_tables`` (admin API) reads whole tables as fresh as the store allows.
* ``counters_degraded`` is True while the shared store cannot be written: counts go on
  locally and are sent when it is back.

``CounterView`` is that local state; ``MemoryCounters`` (one process) and
``JournalCounters`` (a compacting append-only file shared by the workers of one host)
are two stores; ``gateway.counters_redis.RedisCounters`` is the third.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

__all__ = [
    "CounterView",
    "Counters",
    "Increment",
    "JournalCounters",
    "MemoryCounters",
]

log = logging.getLogger("sandbox_gateway.counters")

Table = dict[str, int]


Increment = tuple[str, str, int, float]
"""``(table, field, amount, expires_at)``: add ``amount`` to ``table[field]``; the table
expires at ``expires_at`` (Unix). A plain tuple: every metered exchange makes several."""


class Counters(Protocol):
    """Shared counters (see the module docstring)."""

    def count(self, increments: Iterable[Increment]) -> None: ...
    def counter(self, table: str, field: str) -> int: ...
    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]: ...
    @property
    def counters_degraded(self) -> bool: ...


class CountersOf:
    """The Counters port answered by a store's `_counters` (the state stores' mixin)."""

    _counters: Counters

    def count(self, increments: Iterable[Increment]) -> None:
        self._counters.count(increments)

    def counter(self, table: str, field: str) -> int:
        return self._counters.counter(table, field)

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        return await self._counters.counter_tables(tables)

    @property
    def counters_degraded(self) -> bool:
        return self._counters.counters_degraded


class CounterView:
    """The local picture: last known shared values plus the pending (unsent) batch.

    ``forget_after`` (seconds, None = never) drops shared values neither read nor
    written for that long, for stores that hold the real totals elsewhere (Redis); the
    values ``counter`` read in that time are the ``watched`` ones a flush refreshes.
    """

    def __init__(self, clock: Callable[[], float] = time.time,
                 forget_after: float | None = None) -> None:
        self.clock = clock
        self.forget_after = forget_after
        self.shared: dict[str, Table] = {}
        self.pending: dict[str, Table] = {}
        self.expires: dict[str, float] = {}
        self.watched: dict[tuple[str, str], float] = {}
        self._touched: dict[tuple[str, str], float] = {}

    def add(self, increments: Iterable[Increment]) -> None:
        """Add to the pending batch."""
        self._merge(self.pending, increments)

    def add_shared(self, increments: Iterable[Increment]) -> None:
        """Add straight to the shared values (a store without a batch, or others' lines)."""
        self._merge(self.shared, increments)

    def _merge(self, into: dict[str, Table], increments: Iterable[Increment]) -> None:
        expires = self.expires
        for table, field, amount, expires_at in increments:
            fields = into.get(table)
            if fields is None:
                fields = into[table] = {}
            fields[field] = fields.get(field, 0) + amount
            if expires.get(table, 0.0) < expires_at:
                expires[table] = expires_at

    def value(self, table: str, field: str) -> int:
        """Shared + pending; remembers that this value is read (a flush refreshes it)."""
        if self.forget_after is not None:
            self.watched[(table, field)] = self.clock()
        shared = self.shared.get(table)
        pending = self.pending.get(table)
        return ((shared.get(field, 0) if shared else 0)
                + (pending.get(field, 0) if pending else 0))

    def table(self, table: str, base: Table | None = None) -> Table:
        """A whole table: ``base`` (fresh from the store) or the shared values, plus
        the pending batch."""
        out = dict(self.shared.get(table, {}) if base is None else base)
        for field, amount in self.pending.get(table, {}).items():
            out[field] = out.get(field, 0) + amount
        return out

    def take(self) -> dict[str, Table]:
        """The pending batch, now being sent (``restore`` it if that fails)."""
        batch, self.pending = self.pending, {}
        return batch

    def restore(self, batch: dict[str, Table]) -> None:
        """Put a batch that could not be sent back in front of the pending one."""
        for table, fields in batch.items():
            pending = self.pending.setdefault(table, {})
            for field, amount in fields.items():
                pending[field] = pending.get(field, 0) + amount

    def set_shared(self, table: str, field: str, value: int) -> None:
        """The store's current value of one field."""
        self.shared.setdefault(table, {})[field] = value
        if self.forget_after is not None:
            self._touched[(table, field)] = self.clock()

    def watched_fields(self) -> dict[str, list[str]]:
        """Fields read lately and not pending, by table: what a flush should re-read."""
        out: dict[str, list[str]] = {}
        for table, field in self.watched:
            if field not in self.pending.get(table, {}):
                out.setdefault(table, []).append(field)
        return out

    def prune(self) -> None:
        """Drop expired tables and (with ``forget_after``) values unused for that long."""
        now = self.clock()
        for table in [t for t, exp in self.expires.items() if exp <= now]:
            del self.expires[table]
            self.shared.pop(table, None)
            self.pending.pop(table, None)
        if self.forget_after is None:
            return
        horizon = now - self.forget_after
        for key in [k for k, at in self.watched.items() if at < horizon]:
            del self.watched[key]
        for key in [k for k, at in self._touched.items() if at < horizon]:
            del self._touched[key]
        for table in list(self.shared):
            fields = self.shared[table]
            for field in [f for f in fields if (table, f) not in self.watched
                          and (table, f) not in self._touched]:
                del fields[field]
            if not fields:
                del self.shared[table]

    def live(self, table: str) -> bool:
        """False once ``table`` has expired."""
        return self.expires.get(table, 0.0) > self.clock()


class MemoryCounters:
    """Counters of one process (the ``memory`` state store)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.view = CounterView(clock)
        self._last_prune = 0.0

    def count(self, increments: Iterable[Increment]) -> None:
        self.view.add_shared(increments)
        now = self.view.clock()
        if now - self._last_prune > 60:
            self._last_prune = now
            self.view.prune()

    def counter(self, table: str, field: str) -> int:
        return self.view.value(table, field) if self.view.live(table) else 0

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        return {t: self.view.table(t) for t in tables if self.view.live(t)}

    @property
    def counters_degraded(self) -> bool:
        return False


_HEADER = b'{"journal":'


class JournalCounters:
    """Counters shared by the worker processes of one host through one file.

    Each process appends its batch as one JSON line under ``flock`` (``{"by": <process
    id>, "t": {table: [expires_at, {field: amount}]}}``) and reads the lines the others
    appended since its last look; it never re-applies its own lines (they were applied
    when sent). When the file passes ``compact_bytes``, the process that wrote last
    rewrites it, under the same lock, as a header with a fresh id plus the live totals,
    and renames it into place. A reader that finds another header (or a shorter file)
    starts over from the new file, own lines included. Writers lock, then check the
    path still names the file they locked, so nothing is appended to a replaced file.
    """

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time,
                 compact_bytes: int = 8 << 20) -> None:
        self.path = path
        self.compact_bytes = compact_bytes
        self.view = CounterView(clock)
        self.id = secrets.token_hex(8)
        self._file_id: str | None = None
        self._offset = 0
        self._degraded = False

    # -- Counters ------------------------------------------------------------------------

    def count(self, increments: Iterable[Increment]) -> None:
        self.view.add(increments)

    def counter(self, table: str, field: str) -> int:
        return self.view.value(table, field) if self.view.live(table) else 0

    async def counter_tables(self, tables: Sequence[str]) -> dict[str, Table]:
        with contextlib.suppress(OSError):
            self.catch_up()
        return {t: self.view.table(t) for t in tables if self.view.live(t)}

    @property
    def counters_degraded(self) -> bool:
        return self._degraded

    # -- sharing -------------------------------------------------------------------------

    def start(self) -> None:
        """Create the file if needed and read what is there."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(mode=0o600, exist_ok=True)
        self.catch_up()

    def sync(self) -> None:
        """One round: send the pending batch, read the others'. Never raises."""
        self.flush()
        try:
            self.catch_up()
        except OSError as exc:
            log.warning("counters journal %s unreadable: %s", self.path, exc.strerror)
        self.view.prune()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[IO[bytes]]:
        """The journal opened for appending, locked, and still the file at ``path``."""
        for _ in range(10):
            f = self.path.open("ab")
            try:
                fcntl.flock(f, fcntl.LOCK_EX)
                if os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino:
                    yield f
                    return
            finally:
                f.close()
        raise OSError(0, "the journal keeps being replaced")

    def flush(self) -> None:
        """Append the pending batch as one line (kept pending if the write fails)."""
        batch = self.view.take()
        if not batch:
            return
        tables = {t: [self.view.expires.get(t, 0.0), fields] for t, fields in batch.items()}
        line = json.dumps({"by": self.id, "t": tables}, separators=(",", ":")).encode() + b"\n"
        try:
            with self._locked() as f:
                f.write(line)
                f.flush()
                size = f.tell()
        except OSError as exc:
            self.view.restore(batch)
            if not self._degraded:
                self._degraded = True
                log.warning("counters journal %s not writable (%s): counting locally until "
                            "it is", self.path, exc.strerror or exc)
            return
        self._apply(tables)  # own lines are skipped when read back
        if self._degraded:
            self._degraded = False
            log.info("counters journal %s writable again", self.path)
        if size > self.compact_bytes:
            try:
                with self._locked():
                    self._compact()
            except OSError as exc:
                log.warning("counters journal %s: compaction failed: %s", self.path,
                            exc.strerror or exc)

    def _apply(self, tables: dict[str, Any]) -> None:
        self.view.add_shared(
            (table, field, int(amount), float(spec[0]))
            for table, spec in tables.items() for field, amount in spec[1].items())

    def catch_up(self) -> None:
        """Apply the lines other processes appended (all of them after a compaction)."""
        with self.path.open("rb") as f:
            first = f.readline(200)
            file_id = None
            if first.startswith(_HEADER):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    file_id = str(json.loads(first)["journal"])
            size = os.fstat(f.fileno()).st_size
            restart = file_id != self._file_id or size < self._offset
            if restart:
                self.view.shared = {}
                self._file_id = file_id
                self._offset = 0
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for raw in complete.splitlines():
            if raw.startswith(_HEADER):
                continue
            try:
                event = json.loads(raw)
                if event["by"] == self.id and not restart:
                    continue
                self._apply(event["t"])
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                log.warning("counters journal %s: skipped a malformed line", self.path)

    def _compact(self) -> None:
        """Rewrite the journal as its live totals (caller holds the lock)."""
        self.catch_up()
        self.view.prune()
        new_id = secrets.token_hex(8)
        tmp = self.path.with_name(f"{self.path.name}.{self.id}.tmp")
        with tmp.open("wb") as out:
            os.chmod(tmp, 0o600)
            out.write(_HEADER + json.dumps(new_id).encode() + b"}\n")
            for table, fields in self.view.shared.items():
                spec = {table: [self.view.expires.get(table, 0.0), fields]}
                out.write(json.dumps({"by": "", "t": spec}, separators=(",", ":")).encode()
                          + b"\n")
            size = out.tell()
        os.replace(tmp, self.path)
        self._file_id = new_id
        self._offset = size
