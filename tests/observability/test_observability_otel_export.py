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


@pytest.mark.parametrize("data", [
    _frame("a.test"), _frame("a.test") + _frame("b.test", traced=False, content='{"i":"x"}'),
    _frame("a.test")[:-1], b"\n" + _frame("a.test") + b"\n\n" + _frame("b.test")])
def test_columns_hold_each_frame_as_read_gives_it(data: bytes) -> None:
    """`columns` (a datagram's frames field by field) against `read` frame by frame."""
    cut = otel_export.columns(data)
    assert cut is not None
    frames = [otel_export.read(f) for f in otel_export._frames(data)]
    assert [otel_export._fields(*fields) for fields in zip(*cut, strict=True)] == frames


@pytest.mark.parametrize("data", [b"", b"\n", b"not a frame\n", _frame("a.test") + b"x\x1fy\n"])
def test_columns_refuse_a_datagram_with_a_frame_not_of_five_fields(data: bytes) -> None:
    assert otel_export.columns(data) is None


def test_take_hands_a_datagram_over_at_once_and_goes_frame_by_frame_when_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    """`take` with `many`: the datagram's lines at once, what `many` leaves through
    `emit`, in place; a datagram `many` refuses (ValueError: nothing emitted) frame by
    frame, each once; one `many` fails part-way is counted once, not emitted again."""
    emitted: list[Any] = []

    def emit(raw: bytes, end: int, traced: bool, provider: str | None,
             content: dict[str, Any] | None) -> None:
        if json.loads(raw)["host"] == "raises.test":
            raise ValueError("cannot")
        emitted.append(("one", json.loads(raw)["host"], end, traced, provider, content))

    def many(lines: Any, ends: list[int], flags: Any, extras: list[bytes],
             other: Any) -> None:
        hosts = [json.loads(line)["host"] for line in lines]
        if "refuse.test" in hosts:
            raise ValueError("not as the sink writes it")
        for i, host in enumerate(hosts):
            if host == "fails.test":
                raise RuntimeError("part-way")
            if extras[i] or host == "raises.test":
                other(i)
            else:
                emitted.append(("many", host, ends[i], flags[i]))

    def frame(host: str, end: int, provider: bytes = b"", content: bytes = b"") -> bytes:
        return b"\x1f".join((b"T", b"%d" % end, provider, content,
                              json.dumps({"host": host}).encode())) + b"\n"

    bad = [0]
    otel_export.take(frame("a.test", 1) + frame("b.test", 2, content=b'{"input":"x"}') +
                     frame("raises.test", 3) + frame("c.test", 4, b"openai") +
                     frame("d.test", 5).replace(b"T", b"-", 1), emit, bad, many)
    assert bad == [1]
    otel_export.take(frame("e.test", 6) + frame("refuse.test", 7), emit, bad, many)
    otel_export.take(frame("f.test", 8) + frame("fails.test", 9), emit, bad, many)
    # ends that are not one JSON integer each: the datagram goes frame by frame, as `int`
    # reads them (a leading zero; a comma: two numbers for one frame, then not read)
    odd = frame("g.test", 10).replace(b"10", b"010") + frame("h.test", 11)
    otel_export.take(odd + frame("i.test", 12).replace(b"12", b"1,2"), emit, bad, many)
    assert emitted[7:] == [("one", "g.test", 10, True, None, None),
                           ("one", "h.test", 11, True, None, None)]
    del emitted[7:]
    assert bad == [3]
    assert emitted == [("many", "a.test", 1, b"T"),
                       ("one", "b.test", 2, True, None, {"input": "x"}),
                       ("one", "c.test", 4, True, "openai", None),
                       ("many", "d.test", 5, b"-"),
                       ("one", "e.test", 6, True, None, None),
                       ("one", "refuse.test", 7, True, None, None),
                       ("many", "f.test", 8, b"T")]
    assert caplog.text.count("could not be exported") == 3
