"""The exporter process (`python -m gateway.observability.otel_export FD`): reads its
worker's frames (`otel_feed.py`) from the inherited socket FD and exports them with the
OpenTelemetry SDK (`otel.py`) until the socket ends, then exports what it holds (at
most 5 s) and exits. Started by `otel_process.ExporterProcess`; its first datagram is
the settings (`OtelExport`'s keyword arguments). What it drops goes back to the worker
on the same socket (`Reporter`), for the worker's /metrics."""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import msgspec

__all__ = ["REPORT", "Many", "Reporter", "columns", "main", "parse", "serve", "take"]

log = logging.getLogger("sandbox_gateway")

RECV = 1 << 20  # larger than any datagram the worker sends (otel_feed.MAX_DATAGRAM)
TICK = 0.25  # seconds between looks at waiting batches when no frame comes
SEP = b"\x1f"  # (otel_feed.SEP; not imported: this process never loads the worker's side)
REPORT = 0.5  # seconds between two reports of the drops to the worker (when they changed)
DROPS = b"D"  # a report's first byte; then the JSON of the totals
_decode = msgspec.json.Decoder().decode  # (as json.loads, 3x faster)
_ints = msgspec.json.Decoder(list[int]).decode
# `OtelExport.emit_many`: (lines, ends, flags, extras, other) -> None
Many = Callable[[Sequence[bytes], list[int], Sequence[bytes], list[bytes],
                 Callable[[int], None]], None]


class Reporter:
    """Sends the exporter's drop totals (``{"traces/unreachable": n, ...}``, since it
    started) to its worker when they changed, at most every REPORT seconds, never
    waiting: a report the socket does not take now goes with the next (totals, not
    increments, so none is lost or counted twice)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: dict[str, int] = {}
        self._last = 0.0

    def __call__(self, totals: dict[str, int]) -> None:
        now = time.monotonic()
        if totals == self.sent or now - self._last < REPORT:
            return
        self._last = now
        try:
            self.sock.send(DROPS + json.dumps(totals).encode(), socket.MSG_DONTWAIT)
        except OSError:  # (full: the next report; gone: the worker is stopping)
            return
        self.sent = dict(totals)


def parse(frame: bytes) -> tuple[bool, int, str | None, dict[str, Any] | None,
                                 dict[str, Any], bytes]:
    """A frame (`otel_feed`'s, without its newline) as (traced, end_ns, provider,
    content, line, the line's JSON text); raises ValueError on one that is not a
    frame. The line is parsed once, here."""
    traced, end, provider, content, line = read(frame)
    try:
        return traced, end, provider, content, _decode(line), line
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None


def read(frame: bytes) -> tuple[bool, int, str | None, dict[str, Any] | None, bytes]:
    """`parse` but the line left as its JSON text (`OtelExport.emit_json` reads it)."""
    flags, end, provider, content, line = frame.split(SEP, 4)
    return _fields(flags, end, provider, content, line)


def _fields(flags: bytes, end: bytes, provider: bytes, content: bytes,
            line: bytes) -> tuple[bool, int, str | None, dict[str, Any] | None, bytes]:
    try:
        return (flags == b"T", int(end), provider.decode() or None,
                _decode(content) if content else None, line)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None


def columns(data: bytes) -> list[Sequence[bytes]] | None:
    """A datagram's frames field by field: [flags, ends, providers, contents, lines],
    each in the frames' order (frames cut as `_frames` cuts them, each split at its
    header only); None when a frame is not five fields. (Neither `split` on the whole
    datagram nor `count`: CPython runs those a byte at a time, a few instructions a
    byte of every line; `find` is memchr.)"""
    cut = [frame.split(SEP, 4) for frame in _frames(data)]
    if set(map(len, cut)) != {5}:
        return None
    return list(zip(*cut, strict=True))


def take(data: bytes, emit: Callable[..., None], bad: list[int],
         many: Many | None = None) -> None:
    """One datagram's frames emitted in order (`serve`'s step), each as `read` gives it
    to `emit`; with `many` (`OtelExport.emit_many`), the datagram's lines are handed over
    at once and `emit` has only those `many` leaves (a datagram it cannot read at once
    goes frame by frame). A frame that cannot be read or exported is counted in `bad[0]`
    and logged, the first with its traceback."""
    cut = columns(data) if many is not None else None
    if cut is not None and many is not None:
        flags, ends, providers, contents, lines = cut

        def one(i: int) -> None:
            _one(emit, bad, lambda: _fields(flags[i], ends[i], providers[i], contents[i],
                                            lines[i]))
        try:  # (the ends as one JSON array: fewer instructions than `int` a frame)
            numbers: list[int] | None = _ints(b"[" + b",".join(ends) + b"]")
        except msgspec.DecodeError:
            numbers = None
        if numbers is not None and len(numbers) == len(ends):  # (each end one integer)
            extras = [p or c for p, c in zip(providers, contents, strict=True)]
            try:
                many(lines, numbers, flags, extras, one)
                return
            except ValueError:  # (nothing emitted: one of the lines is not as it should be)
                pass
            except Exception:  # (some emitted: not again; counted once)
                _bad(bad)
                return
    for frame in _frames(data):
        _one(emit, bad, lambda frame=frame: read(frame))  # type: ignore[misc]


def _one(emit: Callable[..., None], bad: list[int],
         fields: Callable[[], tuple[bool, int, str | None, dict[str, Any] | None,
                                    bytes]]) -> None:
    """One frame's line emitted (`fields`: the frame read), or counted as bad."""
    try:
        traced, end, provider, content, raw = fields()
        emit(raw, end, traced, provider, content)
    except Exception:  # (one bad line never stops the export)
        _bad(bad)


def _bad(bad: list[int]) -> None:
    bad[0] += 1
    if bad[0] == 1:
        log.exception("telemetry: an audit line could not be exported")
    else:
        log.warning("telemetry: an audit line could not be exported")


def serve(sock: socket.socket, emit: Callable[..., None],
          tick: Callable[[], None] | None = None, bad: list[int] | None = None,
          text: bool = False, many: Many | None = None) -> int:
    """Emit every frame read from `sock` until it ends, calling `tick` after each datagram
    and every TICK seconds without one (batches that waited go); returns how many frames
    could not be read or exported (each logged, the first with its traceback), also
    counted as they come in `bad[0]` when given. `emit` takes a frame's line parsed and
    its text (`parse`), or with `text` its text alone (`read`: `OtelExport.emit_json`,
    which parses it its own way), and then with `many` (`OtelExport.emit_many`) a
    datagram's lines go to `many` at once (`take`)."""
    bad = bad if bad is not None else [0]
    sock.settimeout(TICK if tick is not None else None)
    while True:
        try:
            data = sock.recv(RECV)
        except TimeoutError:
            data = None
        if data == b"":
            return bad[0]
        if data and text:
            take(data, emit, bad, many)
        elif data:
            for frame in _frames(data):
                try:
                    traced, end, provider, content, line, raw = parse(frame)
                    emit(line, end, traced, provider, content, raw)
                except Exception:  # (one bad line never stops the export)
                    _bad(bad)
        if tick is not None:
            tick()


def _frames(data: bytes) -> Iterator[bytes]:
    """The frames of a datagram (each ends in its line's newline, which is left out), found
    with `bytes.find` (memchr): `split` on one byte compares every byte in a loop."""
    start = 0
    while (end := data.find(b"\n", start)) >= 0:
        if end > start:
            yield data[start:end]
        start = end + 1
    if start < len(data):
        yield data[start:]


def _stop(_signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)  # (the finally below exports what is held)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the worker stops it: its socket ends)
    signal.signal(signal.SIGTERM, _stop)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="sandbox-gateway telemetry exporter: %(message)s")
    sock = socket.socket(fileno=int(argv[1]))
    settings = json.loads(sock.recv(RECV))
    from gateway.observability.otel import OtelExport  # (the SDK: only here)

    export = OtelExport(**settings)
    report, bad = Reporter(sock), [0]

    def tick() -> None:
        export.tick()
        drops = export.drops()
        if bad[0]:
            drops["lines/unreadable"] = bad[0]
        report(drops)

    try:
        serve(sock, export.emit_json, tick, bad, text=True, many=export.emit_many)
    finally:
        sock.close()
        export.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
