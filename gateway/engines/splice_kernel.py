"""Passthrough bytes moved by the kernel: splice(2) through a pipe, never copied into Python.

A direct passthrough tunnel (a plain client socket, no upstream proxy) relays each
direction socket -> pipe -> socket with `os.splice`: the bytes stay in the kernel, and
Python handles one readiness event per pipe-full instead of copying every chunk in and
out of a buffer (two copies and a transport's bookkeeping per read). Measured in `make
bench`'s passthrough download (same-run pairs against the transports' relay): 0.31-0.46
ms of proxy CPU per MB against 0.51-0.72 (docs/performance.md, "passthrough relayed by
the kernel").

Back-pressure is the pipe: a direction reads while its pipe has room, also while the
destination takes no more (EAGAIN), and a full pipe stops the reading until the
destination has taken it all: at most one pipe (`PIPE_SIZE`, what `fs.pipe-max-size`
allows by default) is held per direction, and only while it holds bytes (`Pipes`). An
EOF is passed on as a half-close (`shutdown(SHUT_WR)`) once the pipe is drained; when
both directions have ended, or either socket fails, the relay is `done` and its owner
closes the tunnel.

Small exchanges (an HTTP/1 request and its answer on a kept-alive tunnel) cost less
through a buffer than through a pipe: a read of a few hundred bytes spliced in and out
takes more of the kernel's time than `recv_into` and `send` (measured in-process: 15.9-17.2
against 13.8-15.0 µs of CPU per relayed round trip). So a direction starts reading
into a buffer shared by the loop's relays (`Pipes.scratch`: its bytes are sent on in the
same callback), and turns to splicing when a read fills that buffer (a bulk transfer);
a spliced read of fewer than `SMALL` bytes turns it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable

__all__ = ["AVAILABLE", "PIPE_SIZE", "KernelRelay", "Pipes"]

AVAILABLE = hasattr(os, "splice") and hasattr(os, "SPLICE_F_NONBLOCK")
PIPE_SIZE = 1024 * 1024
SCRATCH = 64 * 1024  # the buffer of a direction's small reads (`Pipes.scratch`)
SMALL = 4096  # a spliced read shorter than this turns the direction back to the buffer
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
Pipe = tuple[int, int, int]  # read end, write end, capacity in bytes
_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
log = logging.getLogger("sandbox_gateway")


class Pipes:
    """Pipes lent to a direction only while it holds bytes: an idle tunnel holds none. A
    pipe costs two descriptors and counts its capacity against the user's pipe quota
    (`fs.pipe-user-pages-soft`, 64 MiB by default), so one per tunnel would not scale to
    thousands of idle tunnels; a few empty ones are kept for the next reads, until
    `clear` (the owner's last tunnel closed)."""

    KEEP = 8

    def __init__(self) -> None:
        self.free: list[Pipe] = []
        # the small reads' buffer: a read is sent on (or what is left of it copied out)
        # within the callback that read it, so the loop's relays share one
        self.scratch = bytearray(SCRATCH)
        self.view = memoryview(self.scratch)

    def take(self) -> Pipe:
        try:
            return self.free.pop()
        except IndexError:
            pass
        rp, wp = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # (over fs.pipe-max-size: 64 KiB then)
            fcntl.fcntl(wp, _F_SETPIPE_SZ, PIPE_SIZE)
        return rp, wp, fcntl.fcntl(wp, _F_GETPIPE_SZ)

    def give(self, pipe: Pipe) -> None:
        """Take back an empty pipe."""
        if len(self.free) < self.KEEP:
            self.free.append(pipe)
        else:
            os.close(pipe[0])
            os.close(pipe[1])

    def clear(self) -> None:
        """Close the kept pipes."""
        while self.free:
            rp, wp, _ = self.free.pop()
            os.close(rp)
            os.close(wp)


class _Way:
    """One direction, `src` -> pipe -> `dst`."""

    __slots__ = ("dst", "ended", "held", "loop", "moved", "pipe", "reading", "relay", "rest",
                 "small", "src", "writing")

    def __init__(self, relay: KernelRelay, src: socket.socket, dst: socket.socket) -> None:
        self.relay = relay
        self.loop = relay.loop
        self.src = src
        self.dst = dst
        self.pipe: Pipe | None = None  # lent while bytes are held in it
        self.held = 0  # bytes in the pipe, not yet taken by dst
        self.moved = 0  # bytes read from src
        self.ended = False
        self.reading = False
        self.writing = False
        self.small = True  # reads go through `Pipes.scratch`, not a pipe
        self.rest = b""  # of a small read, what dst did not take at once

    def start(self) -> None:
        self.reading = True
        self.loop.add_reader(self.src.fileno(), self._readable)

    def end_now(self) -> None:
        """src had already ended before the relay began: pass the EOF on at once."""
        self.ended = True
        self._pass_eof()

    def _readable(self) -> None:
        """The loop's reader callback: any failure ends the tunnel (a callback that
        raised would stay registered and be called again and again)."""
        try:
            self._read()
        except Exception:
            log.exception("the kernel relay failed; closing the tunnel")
            self.relay.fail()

    def _writable(self) -> None:
        try:
            if self.rest:
                self._send_rest()
            else:
                self._flush()
        except Exception:
            log.exception("the kernel relay failed; closing the tunnel")
            self.relay.fail()

    def _read(self) -> None:
        pipe = self.pipe
        if pipe is None and self.small:
            self._read_small()
            return
        if pipe is None:
            try:
                pipe = self.pipe = self.relay.pipes.take()
            except OSError:  # no descriptors left
                self.relay.fail()
                return
        try:
            n = os.splice(self.src.fileno(), pipe[1], pipe[2] - self.held, flags=_FLAGS)
        except BlockingIOError:
            if self.held:
                # The pipe has no slot left (each spliced segment takes one, however
                # short) while dst takes no more: read again once it has taken the
                # pipe's bytes (`_flush`), not on every readiness of src until then.
                self._stop_reading()
            else:
                self._return_pipe()  # (nothing to read after all)
            return
        except OSError:
            self.relay.fail()
            return
        if n == 0:
            self._return_pipe()
            self._stop_reading()
            self.ended = True
            self._pass_eof()  # (once the pipe is drained, if it holds bytes)
            return
        self.held += n
        self.moved += n
        self.relay.last = time.monotonic()
        if n < SMALL:
            self.small = True  # (from the next read on, once this pipe is drained)
        if self.writing:  # (dst takes no more yet: its writer flushes)
            if self.held >= pipe[2]:
                self._stop_reading()
            return
        self._flush()

    def _read_small(self) -> None:
        """A read into the loop's buffer, sent on at once; a read that fills the buffer
        turns the direction to splicing."""
        pipes = self.relay.pipes
        try:
            n = self.src.recv_into(pipes.scratch)
        except BlockingIOError:
            return
        except OSError:
            self.relay.fail()
            return
        if n == 0:
            self._stop_reading()
            self.ended = True
            self._pass_eof()
            return
        self.moved += n
        self.relay.last = time.monotonic()
        if n == SCRATCH:
            self.small = False
        try:
            sent = self.dst.send(pipes.view[:n])
        except BlockingIOError:
            sent = 0
        except OSError:
            self.relay.fail()
            return
        if sent < n:  # dst takes no more yet: keep the rest, read again once it is sent
            self.rest = bytes(pipes.view[sent:n])
            self._stop_reading()
            self.writing = True
            self.loop.add_writer(self.dst.fileno(), self._writable)

    def _send_rest(self) -> None:
        """dst can take more: send what a small read left, then read again."""
        try:
            sent = self.dst.send(self.rest)
        except BlockingIOError:
            return
        except OSError:
            self.relay.fail()
            return
        self.rest = self.rest[sent:]
        if self.rest:
            return
        self.writing = False
        self.loop.remove_writer(self.dst.fileno())
        self.start()

    def _flush(self) -> None:
        dst = self.dst.fileno()
        pipe = self.pipe
        assert pipe is not None
        while self.held:
            try:
                self.held -= os.splice(pipe[0], dst, self.held, flags=_FLAGS)
            except BlockingIOError:
                # Reading goes on into the pipe while it has room (the transfer and the
                # wait for dst overlap, as the transports' buffer let them); a full pipe
                # stops it until dst has taken every byte.
                if self.reading and self.held >= pipe[2]:
                    self._stop_reading()
                if not self.writing:
                    self.writing = True
                    self.loop.add_writer(dst, self._writable)
                return
            except OSError:
                self.relay.fail()
                return
        self._return_pipe()
        if self.writing:
            self.writing = False
            self.loop.remove_writer(dst)
        if self.ended:
            self._pass_eof()
        elif not self.reading:
            self.start()

    def _return_pipe(self) -> None:
        if self.pipe is not None and not self.held:
            self.relay.pipes.give(self.pipe)
            self.pipe = None

    def _stop_reading(self) -> None:
        self.reading = False
        self.loop.remove_reader(self.src.fileno())

    def _pass_eof(self) -> None:
        if self.held:
            return  # (sent once the pipe is drained: _flush comes back here)
        try:
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            self.relay.fail()
            return
        self.relay.way_ended()

    def close(self) -> None:
        if self.reading:
            self._stop_reading()
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.dst.fileno())
        if self.pipe is not None:  # bytes never delivered: not a pipe to lend again
            os.close(self.pipe[0])
            os.close(self.pipe[1])
            self.pipe = None


class KernelRelay:
    """Relays `client` <-> `upstream` (connected non-blocking sockets the relay owns and
    closes from `start` on) until both directions end or either fails; then `on_done()`
    is called once. `last` is the monotonic time of the last bytes read (the owner's idle
    timeout)."""

    def __init__(self, client: socket.socket, upstream: socket.socket, pipes: Pipes,
                 on_done: Callable[[], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.pipes = pipes
        self.client = client
        self.upstream = upstream
        self.on_done = on_done
        self.last = time.monotonic()
        self.closed = False
        self._ended = 0
        self.out = _Way(self, client, upstream)  # the sandbox's bytes
        self.into = _Way(self, upstream, client)  # the upstream's answer

    def start(self, *, client_ended: bool = False) -> None:
        """Begin relaying (`client_ended`: the client had sent its EOF already)."""
        if client_ended:
            self.out.end_now()
        else:
            self.out.start()
        if not self.closed:
            self.into.start()

    @property
    def bytes_out(self) -> int:
        return self.out.moved

    @property
    def bytes_in(self) -> int:
        return self.into.moved

    def way_ended(self) -> None:
        self._ended += 1
        if self._ended == 2:
            self._finish()

    def fail(self) -> None:
        """A socket failed (reset, broken pipe): the tunnel is over."""
        self._finish()

    def _finish(self) -> None:
        if not self.closed:
            self.close()
            self.on_done()

    def close(self) -> None:
        """Stop relaying and close both sockets and the pipes (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.out.close()
        self.into.close()
        self.client.close()
        self.upstream.close()
