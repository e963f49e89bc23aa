"""Where an asyncio transport was made, said when it is garbage-collected unclosed.

A gateway run in the test process (`helpers/gateway.py`) makes its connections there, so
a transport one test leaks can be collected - and fail, warnings being errors - in a later
test on the same xdist worker, with nothing in the warning saying whose it was (tracemalloc
would say, at a cost the whole suite cannot pay). `record_origins` keeps the creating
frames (file, line, function: cheap) on each socket transport and puts them into the
`unclosed transport` ResourceWarning asyncio gives, which it otherwise words the same.
A TLS transport (`asyncio.sslproto._SSLProtocolTransport`: aiohttp's and asyncio's own
TLS, in the gateway or a fake server) is followed too: asyncio's warning for it says only
"unclosed transport <asyncio._SSLProtocolTransport object>", no socket, no origin; here it
names the socket transport under it and where it was made."""

from __future__ import annotations

import asyncio
import sys
import threading
import warnings
import weakref
from asyncio import selector_events, sslproto
from typing import Any

FRAMES = 16
_MADE: weakref.WeakSet[Any] = weakref.WeakSet()  # the socket transports made (recorded)


def abort_left(loop: asyncio.AbstractEventLoop) -> int:
    """Abort the socket transports of ``loop`` still holding a socket: what a loop
    stopped while a connection was being accepted would drop, unclosed (a handler
    cancelled before it ran closes nothing). How many there were."""
    left = [t for t in list(_MADE) if t._loop is loop and t._sock is not None]
    for transport in left:
        transport.abort()
    return len(left)


def _origin() -> tuple[tuple[str, int, str], ...]:
    """The creating frames, the thread first (a listener's loop in a test thread: the
    gateway's `GatewayThread`, a fake server's, is named by it)."""
    frame = sys._getframe(2)
    found = [(f"thread {threading.current_thread().name!r}", 0, "")]
    while frame is not None and len(found) <= FRAMES:
        code = frame.f_code
        found.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(found)


def _where(transport: Any) -> str:
    return "".join(f"\n  {f}:{n} in {name}" if n else f"\n  {f}"
                   for f, n, name in getattr(transport, "_made_at", ()))


def record_origins() -> None:
    """Patch asyncio's socket and TLS transports (once a process)."""
    _record_tls_origins()
    cls: Any = selector_events._SelectorSocketTransport
    if getattr(cls, "_origin_recorded", False):
        return
    made = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._made_at = _origin()
        made(self, *args, **kwargs)
        _MADE.add(self)

    def __del__(self: Any, _warn: Any = warnings.warn) -> None:
        if self._sock is not None:
            extra = getattr(self, "_extra", None) or {}
            names = f" (local {extra.get('sockname')}, peer {extra.get('peername')})"
            _warn(f"unclosed transport {self!r}{names}, made at (innermost first):"
                  f"{_where(self)}", ResourceWarning, source=self)
            self._sock.close()

    cls.__init__ = __init__
    cls.__del__ = __del__
    cls._origin_recorded = True


def _record_tls_origins() -> None:
    cls: Any = sslproto._SSLProtocolTransport
    if getattr(cls, "_origin_recorded", False):
        return
    made = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._made_at = _origin()
        made(self, *args, **kwargs)

    def __del__(self: Any, _warn: Any = warnings.warn) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            under = getattr(getattr(self, "_ssl_protocol", None), "_transport", None)
            _warn(f"unclosed transport <asyncio._SSLProtocolTransport object> over "
                  f"{under!r}, made at (innermost first):{_where(self)}", ResourceWarning)

    cls.__init__ = __init__
    cls.__del__ = __del__
    cls._origin_recorded = True
