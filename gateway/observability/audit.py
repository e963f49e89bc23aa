"""The audit sink: where the core's audit records go (one JSON line each), and whether
they can go there now.

Records are built by `gateway.core.audit.record` (the same fields for every decision
on every engine); this module adds the worker index and the time, counts them by
policy, decision and path, and writes them — to stdout by default, or appended to
`audit.path` (`gateway/observability/audit_out.py` knows the targets).

**Written per loop tick.** Lines are gathered while the event loop runs its callbacks
and written together when the tick ends: one write for all of them, never a blocking
write on the loop (a full pipe is waited for with the loop's writer callback).

**Nothing lost silently.** A line the target does not take now is held, in order, up
to `audit.buffer` bytes, and written when the target takes lines again: retried every
second after an error (disk full, an unwritable file, a broken pipe), at once when a
blocked pipe becomes writable. The sink is *unavailable* while writes fail, or while
the held lines of a blocked target fill the buffer (7/8 of it: the rest is room for
the exchanges already under way; it is available again at half). Then `refusing` says
why and the gate refuses new exchanges `503 audit_unavailable` (`audit.on_failure:
refuse`, the default), or (`continue`) the gateway serves on. Each outage is one log
line when it begins and one when it ends, `/readyz` reports it,
`sandbox_gateway_audit_up` is 0 during it. Nothing here raises into the engines.

**Spilled, not dropped.** A line that does not fit in the buffer goes to the spill
journal (`audit_spill.py`: files in `audit.spill.path`, at most `audit.spill.max`
bytes), and so does every line after it until the journal is written out: the output
gets the held lines, then the journal's, then the new ones, in order. At the stop the
lines still held are written to the journal too (before the ones spilled earlier), and
the next start writes the journal first. Only a line that fits in neither is dropped:
counted (`sandbox_gateway_audit_dropped_lines_total`), and logged when dropping begins
and, with how many and the time range of the dropped lines, when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import IO, Any

import msgspec

from gateway.observability import metrics
from gateway.observability.audit_out import Out, StreamOut, open_file, open_stdout
from gateway.observability.audit_spill import Spill

__all__ = ["BUFFER", "Auditor"]

log = logging.getLogger("sandbox_gateway")

BUFFER = 4 * 1024 * 1024  # audit.buffer default
RETRY = 1.0  # seconds between attempts while writes fail
CLOSE_WAIT = 2.0  # at stop: how long a blocked pipe's reader is waited for
SYNC = 1.0  # seconds between fsyncs of the spill journal while lines are spilled to it
DRAIN = 4 * 1024 * 1024  # bytes of the spill journal written per loop callback
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode  # (built once)
_FAST = msgspec.json.Encoder(enc_hook=str).encode


def encode(record: dict[str, Any]) -> bytes:
    """One audit line (with its newline). msgspec writes it in about a tenth of the json
    module's time. For the values records hold (str, int, bool, None, lists and dicts of
    them, floats) the bytes are the json module's, with two exceptions handed to it: a
    line that is not ASCII or holds DEL (the json module escapes those, `ensure_ascii`),
    and a record msgspec cannot encode. A float the json module writes in exponent form
    may be written otherwise (its `1e-05` is `0.00001` here: the same number)."""
    try:
        line = _FAST(record)
    except (TypeError, ValueError, msgspec.EncodeError):
        return (_ENCODE(record) + "\n").encode()
    if not line.isascii() or line.find(b"\x7f") >= 0:  # (`find`: core/leaks.py `_plain`)
        return (_ENCODE(record) + "\n").encode()
    return line + b"\n"


class Auditor:
    """Writes audit lines to stdout or an append-only file (see the module docstring)."""

    def __init__(self, out: Out, *, worker: int | None = None, on_failure: str = "refuse",
                 buffer: int = BUFFER, retry: float = RETRY, spill: Spill | None = None,
                 ) -> None:
        self.out = out
        self.spill = spill  # lines past the buffer, and held at the stop (None: dropped)
        self._extra = {} if worker is None else {"worker": worker}
        self.on_failure = on_failure
        self.buffer = buffer
        self._full = buffer - buffer // 8  # held past this while blocked: unavailable
        self.retry = retry
        self._held: deque[bytes] = deque()
        self._offset = 0  # bytes of the first held line already written
        self.held_bytes = 0
        self.dropped = 0
        self.error: str | None = None  # the last write's error, while writes fail
        self._blocked_since: float | None = None  # the target would block (monotonic)
        self.problem: str | None = None  # why lines cannot be written now
        self.refusing: str | None = None  # the problem, when new exchanges are refused
        self._outage: tuple[float, int] | None = None  # began (monotonic), dropped then
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._watched: asyncio.AbstractEventLoop | None = None  # add_writer on out.fd
        self.closed = False
        self._released = False  # the output is closed
        self._sync_timer: asyncio.TimerHandle | None = None
        self._spill_error: str | None = None  # the journal's last error (logged once)
        self._drops: list[Any] | None = None  # dropping now: [count, first time, last time]
        self._second, self._stamp = -1, ""
        self._tap_failed = False
        # Each line written also goes here (the console's request log), never raising.
        self.tap: Callable[[dict[str, Any], float, bytes], None] | None = None
        metrics.AUDIT_UP.set(1)

    @classmethod
    def open(cls, path: Path | None = None, stream: IO[str] | None = None,
             **options: Any) -> Auditor:
        """The sink for `stream` (tests, embedding), else `path`, else stdout. Raises
        OSError when the file cannot be opened."""
        out = (StreamOut(stream) if stream is not None else
               open_file(path) if path is not None else open_stdout())
        return cls(out, **options)

    def start(self) -> None:
        """Write what the spill journal kept from before the start (a previous run's
        lines), before any new line; an output that does not take them makes the sink
        unavailable from the start (and retried, as in any outage)."""
        spill = self.spill
        if spill is None:
            return
        metrics.AUDIT_SPILLED.set(spill.bytes)
        if spill.found:
            log.warning("audit: %d bytes of audit lines kept in the spill journal %s are "
                        "written to %s first", spill.found, spill.directory, self.out.name)
            self._flush()

    # -- lines in -------------------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """Add the worker and the time, count the record, and write it (now or with the
        tick's other lines; held if the target does not take it). Never raises."""
        record.update(self._extra)
        now = time.time()
        second = int(now)
        if second != self._second:  # (the formatted second, once a second)
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        record["time"] = f"{self._stamp}.{int(now * 1000) % 1000:03d}Z"
        line = encode(record)
        metrics.child(metrics.REQUESTS, record.get("policy") or "-", record["decision"],
                      record.get("path_taken") or "-").inc()
        if self.tap is not None:
            try:
                self.tap(record, now, line)
            except Exception:  # (the console's copy never costs the trail its line)
                if not self._tap_failed:
                    self._tap_failed = True
                    log.exception("audit: the request log's copy of a line failed; the "
                                  "audit trail goes on")
        if self.closed:  # a connection cut off by the stop, after the sink closed
            self.dropped += 1
            metrics.AUDIT_DROPPED.inc()
            return
        if self.spill is not None and self.spill.pending:  # after the spilled lines
            self._to_spill(line, record["time"])
            return
        if self.held_bytes + len(line) > self.buffer:
            if self.error is None and self._blocked_since is None:
                self._flush()  # healthy, a tick larger than the buffer: write it now
            if self.held_bytes + len(line) > self.buffer:
                self._to_spill(line, record["time"])
                return
        self._held.append(line)
        self.held_bytes += len(line)
        if self.error is not None or self._blocked_since is not None:
            # The retry timer or the writer callback writes it (without a loop, now).
            if self._timer is None and self._watched is None:
                self._flush()
            elif self.problem is None and self.held_bytes > self._full:
                self._update()
            return
        if self.out.immediate:
            self._flush()
        elif not self._scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a command, a unit test): write now
                self._flush()
                return
            self._scheduled = True
            loop.call_soon(self._flush)

    def _to_spill(self, line: bytes, when: str) -> None:
        """`line` to the spill journal, or dropped (counted, logged) if it does not fit."""
        spill = self.spill
        # (room kept for the lines held in memory: they go to the journal at the stop)
        if spill is not None and len(line) <= spill.room() - self.held_bytes:
            try:
                spill.append(line)
            except OSError as exc:
                if self._spill_error is None:
                    log.error("audit: the spill journal %s cannot be written: %s",
                              spill.directory, exc.strerror or exc)
                self._spill_error = f"cannot be written: {exc.strerror or exc}"
            else:
                self._spill_error = None
                metrics.AUDIT_SPILLED.set(spill.bytes)
                self._arm_sync()
                if self.error is None and self._blocked_since is None \
                        and not self._scheduled:
                    self._schedule()  # healthy: the journal is being written out
                elif self.problem is None and self._blocked_since is not None:
                    self._update()  # (a blocked output: the journal counts as held)
                return
        self._drop(1, when, when)

    def _drop(self, count: int, first: str, last: str) -> None:
        self.dropped += count
        metrics.AUDIT_DROPPED.inc(count)
        if self._drops is not None:  # (ISO times: the earliest and the latest line's)
            self._drops[0] += count
            self._drops[1] = min(self._drops[1], first)
            self._drops[2] = max(self._drops[2], last)
            return
        self._drops = [count, first, last]
        log.error("audit lines are being dropped, from the line of %s on: %s", first,
                  self._why_dropped())

    def _why_dropped(self) -> str:
        spill = self.spill
        where = "audit.buffer is full and "
        if spill is None:
            return where + "there is no spill journal (audit.spill.max: 0)"
        if self._spill_error is not None:
            return where + f"the spill journal {spill.directory} {self._spill_error}"
        return where + (f"the spill journal {spill.directory} is full (audit.spill.max: "
                        f"{spill.limit} bytes)")

    def _drops_ended(self) -> None:
        """Name the lines dropped since dropping began (how many, which times)."""
        if self._drops is None:
            return
        count, first, last = self._drops
        self._drops = None
        log.error("%d audit line(s) were dropped, those of %s to %s: %s", count, first,
                  last, self._why_dropped())

    def _schedule(self) -> None:
        """Flush at the end of this tick (without a loop: now)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._flush()
            return
        self._scheduled = True
        loop.call_soon(self._flush)

    def _arm_sync(self) -> None:
        """fsync the spill journal within `SYNC` seconds (without a loop: now)."""
        if self._sync_timer is not None:
            return
        try:
            self._sync_timer = asyncio.get_running_loop().call_later(SYNC, self._sync)
        except RuntimeError:
            self._sync()

    def _sync(self) -> None:
        self._sync_timer = None
        if self.spill is not None and not self._released:
            try:
                self.spill.sync()
            except OSError as exc:
                log.error("audit: the spill journal %s cannot be synced: %s",
                          self.spill.directory, exc.strerror or exc)

    # -- lines out ------------------------------------------------------------------------

    def _flush(self) -> None:
        """Write what is held, then what is spilled, in order, until the target stops
        taking it."""
        self._scheduled = False
        if self._released:
            return
        out = self.out
        while self._held:
            data = self._slice(out.max_write)
            try:
                taken = out.write(data)
            except Exception as exc:  # OSError; a closed or broken stream (ValueError)
                self._failed(exc)
                return
            if taken <= 0:
                self._stalled()
                return
            self._consume(taken)
        if self.spill is not None and self.spill.pending and not self._drain(self.spill):
            return
        if self.error is not None or self._blocked_since is not None:
            self._recovered()

    def _drain(self, spill: Spill) -> bool:
        """Write the spill journal's lines (`DRAIN` bytes, then the rest in the next
        callback); False while some are left."""
        out, budget = self.out, DRAIN
        while budget > 0:
            try:
                data = spill.peek(out.max_write)
            except OSError as exc:
                log.error("audit: the spill journal %s cannot be read (%s): its lines are "
                          "left in it, not written", spill.directory, exc.strerror or exc)
                spill.abandon()  # (new lines are held again)
                metrics.AUDIT_SPILLED.set(0)
                return True
            if not data:
                break
            try:
                taken = out.write(data)
            except Exception as exc:  # as in _flush
                self._failed(exc)
                return False
            if taken <= 0:
                self._stalled()
                return False
            spill.consume(taken)
            budget -= taken
        metrics.AUDIT_SPILLED.set(spill.bytes)
        if spill.pending:
            if self.error is not None or self._blocked_since is not None:
                self._recovered()  # (writing works: not an outage while the rest goes)
            self._schedule()
            return False
        log.warning("audit: the lines kept in the spill journal %s are written to %s",
                    spill.directory, self.out.name)
        self._drops_ended()
        return True

    def _slice(self, limit: int) -> bytes:
        """The held bytes to write next: whole lines up to `limit` (at least one)."""
        held = self._held
        if self._offset == 0 and self.held_bytes <= limit:
            return held[0] if len(held) == 1 else b"".join(held)
        first = held[0][self._offset:]
        parts, size = [first], len(first)
        for line in islice(held, 1, None):
            if size + len(line) > limit:
                break
            parts.append(line)
            size += len(line)
        return first if len(parts) == 1 else b"".join(parts)

    def _consume(self, taken: int) -> None:
        held = self._held
        self.held_bytes -= taken
        if self.held_bytes == 0:
            held.clear()
            self._offset = 0
            return
        while taken:
            rest = len(held[0]) - self._offset
            if taken < rest:
                self._offset += taken
                return
            taken -= rest
            held.popleft()
            self._offset = 0

    # -- health ---------------------------------------------------------------------------

    def _failed(self, exc: Exception) -> None:
        code = getattr(exc, "errno", None)
        name = errno.errorcode.get(code, type(exc).__name__) if code else type(exc).__name__
        detail = getattr(exc, "strerror", None) or str(exc) or name
        self.error = f"{detail} ({name}) writing to {self.out.name}"
        metrics.child(metrics.AUDIT_WRITE_ERRORS, name).inc()
        self._unwatch()
        self._arm_retry()
        self._update()

    def _arm_retry(self) -> None:
        """Try again in `retry` seconds (on the running loop; without one, the next
        line tries)."""
        if self._timer is None:
            with contextlib.suppress(RuntimeError):
                self._timer = asyncio.get_running_loop().call_later(self.retry, self._retry)

    def _retry(self) -> None:
        self._timer = None
        self._flush()

    def _stalled(self) -> None:
        """The target would block (a pipe whose reader is behind): wait until writable."""
        if self._blocked_since is None:
            self._blocked_since = time.monotonic()
        fd = self.out.fd
        if fd is not None and self._watched is None:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                loop = asyncio.get_running_loop()
                loop.add_writer(fd, self._writable)
                self._watched = loop
        if self._watched is None:
            self._arm_retry()
        self._update()

    def _writable(self) -> None:
        self._unwatch()
        self._flush()

    def _unwatch(self) -> None:
        if self._watched is not None and self.out.fd is not None:
            self._watched.remove_writer(self.out.fd)
        self._watched = None

    def _recovered(self) -> None:
        self.error = None
        self._blocked_since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._unwatch()
        self._update()

    def _update(self) -> None:
        """Recompute `problem` and `refusing`; log, and set the metrics, when an outage
        begins or ends."""
        problem = self.error
        held = self.held_bytes + (self.spill.bytes if self.spill is not None else 0)
        if problem is None and self._blocked_since is not None and (
                held > self._full or (self.problem is not None and held > self.buffer // 2)):
            problem = (f"{self.out.name} has not taken audit lines for "
                       f"{time.monotonic() - self._blocked_since:.1f}s and "
                       f"{held} bytes are held (audit.buffer: {self.buffer})")
        began, ended = self.problem is None and problem is not None, \
            self.problem is not None and problem is None
        self.problem = problem
        self.refusing = problem if self.on_failure == "refuse" else None
        metrics.AUDIT_HELD.set(self.held_bytes)
        if began:
            self._outage = (time.monotonic(), self.dropped)
            metrics.AUDIT_UP.set(0)
            log.error("audit lines cannot be written: %s; %s", problem,
                      "new exchanges are refused 503 audit_unavailable until they can be "
                      "(audit.on_failure: refuse)" if self.on_failure == "refuse" else
                      "serving on, lines beyond audit.buffer are dropped "
                      "(audit.on_failure: continue)")
        elif ended:
            since, dropped = self._outage or (time.monotonic(), self.dropped)
            self._outage = None
            metrics.AUDIT_UP.set(1)
            log.warning("audit lines are written again to %s after %.1fs (held lines "
                        "written in order; %d dropped)", self.out.name,
                        time.monotonic() - since, self.dropped - dropped)
            self._drops_ended()

    # -- end ------------------------------------------------------------------------------

    async def aclose(self, wait: float = CLOSE_WAIT) -> None:
        """Write what is held and release the target. A blocked pipe is waited for at
        most `wait` seconds, a failing target is tried once: the stop is never held up.
        What is still held then is logged as lost."""
        if self.closed:
            return
        deadline = time.monotonic() + wait
        while True:
            self._flush()
            if not self._held or self.error is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        self.close()

    def close(self) -> None:
        """Release the target after one last attempt to write what is held; what it does
        not take goes to the spill journal (written first at the next start), and only
        what does not fit there is dropped. Lines written after this are counted as
        dropped (the target is never touched again)."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held and self.error is None:
            self._flush()
        self._unwatch()
        for timer in (self._timer, self._sync_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._sync_timer = None
        if self._held:
            self._keep_held()
        if self.spill is not None:
            try:
                self.spill.close()
            except OSError as exc:
                log.error("audit: the spill journal %s could not be closed cleanly: %s",
                          self.spill.directory, exc.strerror or exc)
        self._drops_ended()
        self._released = True
        self.out.close()

    def _keep_held(self) -> None:
        """The lines still held at the stop: to the spill journal, oldest first, as many
        as fit; the rest dropped (counted, logged with their times)."""
        held = list(self._held)
        held[0] = held[0][self._offset:]  # (the rest of a line a pipe took a part of)
        self._held.clear()
        self.held_bytes = self._offset = 0
        metrics.AUDIT_HELD.set(0)
        why = self.problem or self.error or "the target did not take them"
        kept = 0
        spill = self.spill
        if spill is not None:
            room = spill.room()
            while kept < len(held) and len(held[kept]) <= room:
                room -= len(held[kept])
                kept += 1
            if kept:
                try:
                    spill.prepend(b"".join(held[:kept]))
                except OSError as exc:
                    self._spill_error = f"cannot be written: {exc.strerror or exc}"
                    kept = 0
            if kept:
                metrics.AUDIT_SPILLED.set(spill.bytes)
                log.error("%d audit line(s) could not be written to %s before the gateway "
                          "stopped (%s); they are kept in the spill journal %s and written "
                          "first at the next start", kept, self.out.name, why,
                          spill.directory)
        lost = held[kept:]
        if lost:
            self._drop(len(lost), _time_of(lost[0]), _time_of(lost[-1]))
            log.error("%d audit line(s) could not be written to %s before the gateway "
                      "stopped (%s); they are lost", len(lost), self.out.name, why)


def _time_of(line: bytes) -> str:
    """An audit line's time (for naming dropped lines)."""
    try:
        return str(json.loads(line).get("time", "?"))
    except (ValueError, AttributeError):
        return "?"
