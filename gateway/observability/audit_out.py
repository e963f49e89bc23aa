"""Where audit bytes go: a file, stdout (a pipe, a socket, a terminal, a file) or a text
stream, written without ever blocking the event loop.

`Out.write(data)` takes whole lines and returns how many bytes the target took (0: it
would block, try again when `fd` is writable), or raises OSError (disk full, broken
pipe, read-only file system, ...). The audit sink (`gateway/observability/audit.py`) holds whatever
was not taken and decides what to do about it.

- a regular file is written with `O_APPEND` (one write is one atomic append, even with
  several worker processes on the same file). A short write (the disk filled during
  it) would leave a cut line at the end of the file: the cut part is truncated away at
  once, so the file only ever holds complete lines and the line is written whole later;
- a pipe, a terminal or another character device is reopened non-blocking through
  `/proc/self/fd` (a new open file description: stdout's own, shared with the
  supervisor and the shell, stays blocking), and written at most `PIPE_BUF` bytes at a
  time, so lines of worker processes sharing the pipe never interleave;
- a socket (journald's stdout stream) is sent to with `MSG_DONTWAIT`;
- a Python text stream (an embedding program's or a test's) is written and flushed at
  once (`immediate`): it costs no system call, and its reader sees each line as soon
  as it is written.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import select
import socket
import stat
from pathlib import Path
from typing import IO

__all__ = ["FdOut", "Out", "StreamOut", "open_file", "open_stdout"]

PIPE_BUF = select.PIPE_BUF
FILE_WRITE = 1 << 20  # the most one write to a file takes (a held backlog goes in slices)


class Out(abc.ABC):
    """A target for audit lines (see the module docstring)."""

    name = "?"
    fd: int | None = None  # pollable for writability (a pipe, a socket), else None
    max_write = FILE_WRITE
    immediate = False

    @abc.abstractmethod
    def write(self, data: bytes) -> int:
        """Write what the target takes now; the bytes written (raises OSError)."""

    def close(self) -> None:
        """Release the target (never raises); by default there is nothing to release."""
        return None


class FdOut(Out):
    """A file descriptor: a regular file, a pipe, a character device or a socket."""

    def __init__(self, fd: int, name: str) -> None:
        self.name = name
        self._fd = fd
        mode = os.fstat(fd).st_mode
        self.regular = stat.S_ISREG(mode)
        self._sock: socket.socket | None = None
        if stat.S_ISSOCK(mode):
            self._sock = socket.socket(fileno=fd)
            self.fd, self.max_write = fd, PIPE_BUF
        elif not self.regular:
            self.fd, self.max_write = fd, PIPE_BUF

    def write(self, data: bytes) -> int:
        try:
            if self._sock is not None:
                return self._sock.send(data, socket.MSG_DONTWAIT)
            taken = os.write(self._fd, data)
        except BlockingIOError:
            return 0
        if self.regular and taken < len(data):
            taken = self._cut_partial(data, taken)
        return taken

    def _cut_partial(self, data: bytes, taken: int) -> int:
        """A short append (the disk filled during it): truncate the cut line away, so the
        file never holds part of a line; returns the bytes of whole lines taken (none:
        the disk is full, raised as ENOSPC)."""
        whole = data.rfind(b"\n", 0, taken) + 1
        if whole < taken:
            try:  # after an O_APPEND write the offset is the end of what it wrote
                end = os.lseek(self._fd, 0, os.SEEK_CUR)
                os.ftruncate(self._fd, end - (taken - whole))
            except OSError:
                return taken  # the cut line stays; its rest is written next (completing it)
        if whole == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return whole

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self._sock is not None:
                self._sock.close()
            else:
                os.close(self._fd)


class StreamOut(Out):
    """A Python text stream (tests, an embedding program): written at once."""

    immediate = True

    def __init__(self, stream: IO[str]) -> None:
        self.name = getattr(stream, "name", None) or type(stream).__name__
        self._stream = stream

    def write(self, data: bytes) -> int:
        self._stream.write(data.decode("utf-8"))
        self._stream.flush()
        return len(data)


def open_file(path: Path) -> FdOut:
    """The audit file, created if missing, opened for appending. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    return FdOut(fd, str(path))


def open_stdout(fd: int = 1) -> FdOut:
    """Stdout as an audit target. A pipe or a device is reopened through /proc/self/fd
    so that only the gateway's own description is non-blocking; a file or a socket is
    duplicated (a socket is sent to with MSG_DONTWAIT, a file never blocks)."""
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISSOCK(mode)):
        try:
            return FdOut(os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK
                                 | os.O_CLOEXEC), "stdout")
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENXIO, errno.EACCES, errno.EPERM):
                raise
    return FdOut(os.dup(fd), "stdout")  # (no /proc: a pipe is then written blocking)
