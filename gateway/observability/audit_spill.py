"""The audit spill journal: audit lines the output cannot take, kept on disk until it can.

The audit sink (`audit.py`) holds lines in memory up to `audit.buffer` while its output
does not take them. Past that, and for what is still held when the gateway stops, the
lines go here: files in `audit.spill.path` (on another volume than `audit.path`, by
default next to the state file), at most `audit.spill.max` bytes in all. They are
written to the output before any newer line, as soon as it takes lines again, or at the
next start. Only what exceeds both bounds is dropped (the sink counts and logs it).

The journal is a directory of *segments*, `<owner>-<run>-<seq>.jsonl`: `owner` the
worker index (0 for a single process), `run` the start time of the process that wrote
it (nanoseconds), `seq` its order within that run (0 is the memory-held lines written at
the stop, which are older than any line spilled while running). A segment holds whole
lines, appended (`O_APPEND`), and is at most `SEGMENT` bytes (then the next one starts);
segments are read oldest first, a written one is deleted, and the unwritten rest of a
half-written one is rewritten in its place at the stop (a temporary file renamed over
it). What is appended is fsync'd once a second (the sink's timer) and at the stop, and
the directory when a segment is created, so a stop — or a power loss, but for the last
second — loses nothing. A crash between writing lines to the output and deleting their
segment writes them twice on the next start: the journal delivers at least once.

A single process takes every owner's segments (the worker count may have changed); a
supervisor gives the segments of workers it no longer runs to worker 0 before starting
them (`adopt`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from collections import deque
from pathlib import Path

__all__ = ["SEGMENT", "Spill", "adopt"]

log = logging.getLogger("sandbox_gateway")

SEGMENT = 1 << 20  # bytes a segment grows to before the next one starts
_NAME = re.compile(r"(\d+)-(\d{20})-(\d{9})\.jsonl")


def _segments(directory: Path) -> list[tuple[int, int, int, Path]]:
    """(owner, run, seq, path) of every segment in `directory`, oldest first per owner."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _NAME.fullmatch(entry.name)
            if match and entry.is_file(follow_symlinks=False):
                owner, run, seq = (int(g) for g in match.groups())
                found.append((owner, run, seq, Path(entry.path)))
    return sorted(found, key=lambda s: (s[1], s[2], s[0]))


def adopt(directory: Path, workers: int) -> int:
    """Give the segments of owners `workers` and above (workers a previous run had and
    this one has not) to worker 0, keeping their order; returns how many were moved."""
    moved = 0
    for owner, run, seq, path in _segments(directory):
        if owner >= workers:
            target = directory / f"0-{run:020d}-{seq:09d}.jsonl"
            if not target.exists():  # (two processes of one start time: left as it is)
                os.rename(path, target)
                moved += 1
    return moved


class Spill:
    """One process's spill journal (see the module docstring). `append` and the reads
    raise OSError; the sink decides what that means."""

    def __init__(self, directory: Path, limit: int, *, owner: int = 0,
                 adopt_all: bool = False) -> None:
        self.directory = directory
        self.limit = limit
        self.owner = owner
        self.run = time.time_ns()
        self._seq = 0
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(directory))
        self.segments: deque[Path] = deque()  # oldest first
        self.bytes = 0  # in every segment, the read part of the first included
        self.cut = 0  # lines cut short by a crash, dropped when found (at start)
        for seg_owner, _, _, path in _segments(directory):
            if adopt_all or seg_owner == owner:
                size = self._whole(path)
                if size:
                    self.segments.append(path)
                    self.bytes += size
                else:
                    path.unlink()
        self.found = self.bytes  # what a previous run left (written first)
        self._offset = 0  # bytes of the first segment already written to the output
        self._reader: int | None = None  # the first segment, open for reading
        self._writer: int | None = None  # the last segment, open for appending
        self._written = 0  # its size
        self._unsynced = False
        self._new_file = False  # a segment was created since the last sync

    @staticmethod
    def _whole(path: Path) -> int:
        """The segment's size, a last line cut short by a crash truncated away."""
        size = path.stat().st_size
        if size == 0:
            return 0
        with path.open("rb+") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return size
            f.seek(max(0, size - SEGMENT))
            tail = f.read()
            keep = size - len(tail) + tail.rfind(b"\n") + 1
            f.truncate(keep)
        log.error("audit spill journal: %s ended in a line cut short (the gateway did not "
                  "stop cleanly); that line is dropped", path)
        return keep

    @property
    def pending(self) -> bool:
        return bool(self.segments)

    # -- in ----------------------------------------------------------------------------

    def room(self) -> int:
        return max(0, self.limit - self.bytes)

    def append(self, data: bytes) -> None:
        """Append whole lines `data` (the caller checked `room()`)."""
        if self._writer is None or self._written >= SEGMENT:
            self._open_segment(self._next_name())
        assert self._writer is not None
        try:
            self._write_all(self._writer, data)
        except OSError:  # (a part written: cut back, so the file holds whole lines only)
            with contextlib.suppress(OSError):
                os.ftruncate(self._writer, self._written)
            raise
        self._written += len(data)
        self.bytes += len(data)
        self._unsynced = True

    def prepend(self, data: bytes) -> None:
        """Whole lines older than every line spilled by this run (the lines still held in
        memory at the stop): a segment that sorts before this run's others."""
        if self._offset:  # (none while memory holds lines; kept exact regardless)
            self._close_reader()
            self._keep_rest(self.segments[0])
        path = self.directory / f"{self.owner}-{self.run:020d}-{0:09d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            self._write_all(fd, data)
            os.fsync(fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        self._new_file = True
        self.bytes += len(data)
        own = [p for p in self.segments if p.name.startswith(f"{self.owner}-{self.run:020d}-")]
        index = self.segments.index(own[0]) if own else len(self.segments)
        self.segments.insert(index, path)

    def _next_name(self) -> Path:
        self._seq += 1
        return self.directory / f"{self.owner}-{self.run:020d}-{self._seq:09d}.jsonl"

    def _open_segment(self, path: Path) -> None:
        if self._writer is not None:
            self._sync_writer()
            os.close(self._writer)
            self._writer = None
        self._writer = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL
                               | os.O_CLOEXEC, 0o600)
        self._written = 0
        self._new_file = True
        self.segments.append(path)

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            taken = os.write(fd, view)
            if taken <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[taken:]

    def sync(self) -> None:
        """fsync what was appended since the last call (and the directory after a new
        segment)."""
        if self._unsynced and self._writer is not None:
            self._sync_writer()
        if self._new_file:
            self._new_file = False
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _sync_writer(self) -> None:
        assert self._writer is not None
        os.fsync(self._writer)
        self._unsynced = False

    # -- out ---------------------------------------------------------------------------

    def peek(self, limit: int) -> bytes:
        """The next unwritten bytes, whole lines up to `limit` (at least one line, or the
        rest of one a previous write took a part of), from the oldest segment."""
        while self.segments:
            if self._reader is None:
                self._reader = os.open(self.segments[0], os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(self._reader, limit, self._offset)
            if not data:  # this segment is written out
                self._drop_first()
                continue
            end = data.rfind(b"\n") + 1
            while end == 0:  # a line longer than `limit`: read to its end
                more = os.pread(self._reader, SEGMENT, self._offset + len(data))
                if not more:
                    return data  # (a cut line: written as it is)
                data += more
                end = data.find(b"\n") + 1
            return data[:end]
        return b""

    def consume(self, taken: int) -> None:
        """`taken` bytes of what `peek` returned were written."""
        self._offset += taken
        self.bytes -= taken

    def _close_reader(self) -> None:
        if self._reader is not None:
            os.close(self._reader)
            self._reader = None

    def _drop_first(self) -> None:
        path = self.segments.popleft()
        self._close_reader()
        if self._writer is not None and not self.segments:  # (it was the one appended to)
            os.close(self._writer)
            self._writer = None
        self._offset = 0
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if not self.segments:
            self.bytes = 0

    def abandon(self) -> None:
        """Stop reading the journal (a segment cannot be read): its files stay as they
        are, the sink holds new lines again."""
        self._close_reader()
        self.segments.clear()
        self.bytes = self._offset = 0
        if self._writer is not None:
            os.close(self._writer)
            self._writer = None

    # -- end -----------------------------------------------------------------------------

    def close(self) -> None:
        """fsync what was appended, keep only the unwritten rest of a half-written
        segment, release the files. Raises OSError (the caller logs it)."""
        try:
            if self._writer is not None:
                if self._unsynced:
                    self._sync_writer()
                os.close(self._writer)
                self._writer = None
            self._close_reader()
            if self._offset and self.segments:
                self._keep_rest(self.segments[0])
            self.sync()
        finally:
            for fd in (self._writer, self._reader):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._writer = self._reader = None

    def _keep_rest(self, path: Path) -> None:
        """Rewrite `path` without its first `_offset` bytes (written to the output)."""
        rest = path.read_bytes()[self._offset:]
        self._offset = 0
        if not rest:
            path.unlink()
            self.segments.popleft()
            return
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self._write_all(fd, rest)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._new_file = True
