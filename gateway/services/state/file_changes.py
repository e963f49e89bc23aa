"""Writes to a file by any process, heard from the kernel (inotify) instead of asked for.

The record watcher (services/approvals/watch.py) wants to know at once when another
process wrote a record to the state file. Asking SQLite every 50 ms cost an idle worker
twenty wake-ups a second; inotify wakes it only when the file (or its WAL or journal)
is written. Linux only, through libc with ctypes (no kept library offers it without a
thread or a compiled piece); `FileChanges.open` returns None where it is not available
(another OS, a file system without inotify, no watches left), and the caller polls.

SQLite's own shared memory index (`-shm`) is written through a mapping, which inotify
does not report: a change is heard from the WAL write that precedes it, so the caller
looks again a little later too (`watch.py`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
from pathlib import Path

__all__ = ["FileChanges"]

log = logging.getLogger("sandbox_gateway")

_IN_MODIFY = 0x002
_IN_CLOSE_WRITE = 0x008
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_Q_OVERFLOW = 0x4000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_MASK = _IN_MODIFY | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_CREATE
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then the name, len bytes)


def _libc() -> ctypes.CDLL | None:
    try:  # (the process's own symbols: libc's, without find_library's subprocesses)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1, libc.inotify_add_watch  # noqa: B018 (present?)
    except (OSError, AttributeError, TypeError):
        return None
    return libc


class FileChanges:
    """A descriptor that becomes readable when `path` (or a file named like it plus a
    suffix: `-wal`, `-journal`) is written, created or moved into its directory."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name.encode()

    @classmethod
    def open(cls, path: Path) -> FileChanges | None:
        """Watch `path`'s directory for writes to it; None where inotify cannot."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.info("state file changes: inotify unavailable (%s); polling",
                     os.strerror(ctypes.get_errno()))
            return None
        wd = libc.inotify_add_watch(fd, os.fsencode(path.parent), _MASK)
        if wd < 0:
            log.info("state file changes: cannot watch %s (%s); polling", path.parent,
                     os.strerror(ctypes.get_errno()))
            os.close(fd)
            return None
        return cls(fd, path.name)

    def fileno(self) -> int:
        return self.fd

    def read(self) -> bool:
        """Take the pending events: True if one was of the file (or the queue
        overflowed: events were lost, so any of them might have been)."""
        hit = False
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return hit
            except OSError:
                return True
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, mask, _, size = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size:offset + _EVENT.size + size].rstrip(b"\0")
                offset += _EVENT.size + size
                if mask & _IN_Q_OVERFLOW or name == self.name or (
                        name.startswith(self.name + b"-")):
                    hit = True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
