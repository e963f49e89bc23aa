"""The exporter process's loop (observability/otel_export.py `serve`) over a real
SEQPACKET socketpair: every frame of every datagram emitted in order until the socket
ends; a frame that cannot be read or exported is logged and counted, and the loop goes
on; the drop reports sent back to the worker. (`main`, the process itself, runs in
tests/observability/test_otel_process.py.)"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from gateway.observability import otel_export
from gateway.observability.otel_export import Reporter, serve


def _frame(host: str, traced: bool = True, content: str = "") -> bytes:
    line = json.dumps({"host": host}).encode()
    return b"\x1f".join((b"T" if traced else b"-", b"5", b"openai", content.encode(),
                         line)) + b"\n"


def test_frames_are_emitted_until_the_socket_ends(caplog: pytest.LogCaptureFixture) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    emitted: list[tuple[Any, ...]] = []

    def emit(line: dict[str, Any], end: int, traced: bool, provider: str | None,
             content: dict[str, Any] | None, raw: bytes) -> None:
        if line["host"] == "raises.test":
            raise ValueError("cannot")
        assert json.loads(raw) == line  # (the line's text as the worker sent it)
        emitted.append((line["host"], end, traced, provider, content))

    with ours, theirs:
        ours.send(_frame("a.test") + _frame("b.test", traced=False, content='{"input":"x"}'))
        ours.send(b"not a frame\n" + _frame("raises.test") + _frame("c.test"))
        ours.shutdown(socket.SHUT_WR)
        bad = serve(theirs, emit)
    assert emitted == [("a.test", 5, True, "openai", None),
                       ("b.test", 5, False, "openai", {"input": "x"}),
                       ("c.test", 5, True, "openai", None)]
    assert bad == 2
    assert caplog.text.count("could not be exported") == 2


def test_the_reporter_sends_changed_totals_at_most_every_report_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Totals, sent when they changed and REPORT seconds passed, never waiting: a report
    the socket did not take goes with the next call."""
    monkeypatch.setattr(otel_export, "REPORT", 0.0)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        report = Reporter(theirs)
        report({})  # (nothing dropped: nothing sent)
        report({"traces/unreachable": 3})
        report({"traces/unreachable": 3})  # (unchanged)
        report({"traces/unreachable": 5, "logs/queue_full": 1})
        ours.setblocking(False)
        got = []
        while True:
            try:
                got.append(ours.recv(1024))
            except BlockingIOError:
                break
        assert got == [b'D{"traces/unreachable": 3}',
                       b'D{"traces/unreachable": 5, "logs/queue_full": 1}']
        monkeypatch.setattr(otel_export, "REPORT", 60.0)
        report({"traces/unreachable": 6})  # (too soon after the last)
        assert report.sent == {"traces/unreachable": 5, "logs/queue_full": 1}


@pytest.mark.parametrize("data", [
    b"", b"\n", b"a\n", b"a\nb\n", b"a\n\nb\n", b"a\nb", b"\n\na", b"abc\x1fdef\n" * 3])
def test_a_datagram_is_cut_into_its_frames_as_split_would(data: bytes) -> None:
    """`_frames` (memchr) gives what ``split(b"\\n")`` without the empty parts gives."""
    assert list(otel_export._frames(data)) == [f for f in data.split(b"\n") if f]
