"""Where an asyncio socket transport was made, said when it is garbage-collected unclosed.

A gateway run in the test process (`helpers/gateway.py`) makes its connections there, so
a transport one test leaks can be collected - and fail, warnings being errors - in a later
test on the same xdist worker, with nothing in the warning saying whose it was (tracemalloc
would say, at a cost the whole suite cannot pay). `record_origins` keeps the creating
frames (file, line, function: cheap) on each socket transport and puts them into the
`unclosed transport` ResourceWarning asyncio gives, which it otherwise words the same."""

from __future__ import annotations

import sys
import warnings
from asyncio import selector_events
from typing import Any

FRAMES = 16


def _origin() -> tuple[tuple[str, int, str], ...]:
    frame = sys._getframe(2)
    found = []
    while frame is not None and len(found) < FRAMES:
        code = frame.f_code
        found.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back  # type: ignore[assignment]
    return tuple(found)


def record_origins() -> None:
    """Patch asyncio's socket transports (once a process)."""
    cls: Any = selector_events._SelectorSocketTransport
    if getattr(cls, "_origin_recorded", False):
        return
    made = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._made_at = _origin()
        made(self, *args, **kwargs)

    def __del__(self: Any, _warn: Any = warnings.warn) -> None:
        if self._sock is not None:
            where = "".join(f"\n  {f}:{n} in {name}" for f, n, name in
                            getattr(self, "_made_at", ()))
            _warn(f"unclosed transport {self!r}, made at (innermost first):{where}",
                  ResourceWarning, source=self)
            self._sock.close()

    cls.__init__ = __init__
    cls.__del__ = __del__
    cls._origin_recorded = True
