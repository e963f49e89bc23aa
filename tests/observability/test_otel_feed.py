"""The worker's side of the export (observability/otel_feed.py) over a real unix
SOCK_SEQPACKET socketpair: the frame of an audit line, sampling and the provider decided
in the worker, batching on the loop, content only in the frame, and a request never
waiting: what does not fit, is too large, or has no exporter is dropped and counted."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.observability import metrics
from gateway.observability.otel_export import parse
from gateway.observability.otel_feed import FLUSH, MAX_DATAGRAM, OtelFeed

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
USAGE = {"model": "gpt-4o", "input_tokens": 1, "output_tokens": 2}


def _line(**over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"method": "POST", "host": "api.openai.com",
                            "path": "/v1/chat/completions", "decision": "allow",
                            "credential": "openai", "usage": None, "mcp": None,
                            "trace": None}
    line.update(over)
    return line


def _tap(feed: OtelFeed, record: dict[str, Any], now: float = 1700000000.5) -> None:
    feed.tap(record, now, (json.dumps(record) + "\n").encode())


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    theirs.settimeout(5)
    yield ours, theirs
    ours.close()
    theirs.close()


def _frames(sock: socket.socket) -> list[tuple[Any, ...]]:
    """Every frame waiting on `sock` (parsed; without the line's raw text)."""
    out: list[tuple[Any, ...]] = []
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(1 << 20)
            out.extend(parse(f)[:5] for f in data.split(b"\n") if f)
    except BlockingIOError:
        return out


def _feed(sock: socket.socket | None, **kw: Any) -> OtelFeed:
    feed = OtelFeed(preset_of=lambda c: "openai" if c == "openai" else None, **kw)
    feed.sock = sock
    return feed


def test_a_frame_carries_the_line_its_end_its_provider_and_whether_traced(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    feed = _feed(ours)
    _tap(feed, _line(usage=USAGE))  # (no loop: sent at once)
    _tap(feed, _line(host="other.test", credential=None, path="/x"))
    (traced, end, provider, content, line), second = _frames(theirs)
    assert (traced, end, provider, content) == (True, 1700000000500000000, "openai", None)
    assert line == _line(usage=USAGE)
    assert second[2] is None and second[4]["host"] == "other.test"  # (not inference)
    assert feed.sent == 2 and feed.dropped == 0


@pytest.mark.parametrize(("line", "logs", "sent", "traced"), [
    (_line(), False, False, None),  # sampled out, no log record, no metric point
    (_line(), True, True, False),  # the log record still goes: never sampled
    (_line(usage=USAGE), False, True, True),  # inference: always traced
    (_line(decision="deny"), False, True, True),  # a refusal: always traced
    (_line(trace=f"00-{TRACE}-00f067aa0ba902b7-01"), False, True, True),  # sandbox sampled
])
def test_sampling_is_decided_in_the_worker(pair: tuple[socket.socket, socket.socket],
                                           line: dict[str, Any], logs: bool, sent: bool,
                                           traced: bool | None) -> None:
    ours, theirs = pair
    feed = _feed(ours, sample=0.0, logs=logs)
    _tap(feed, line)
    frames = _frames(theirs)
    assert len(frames) == int(sent)
    if sent:
        assert frames[0][0] is traced


def test_content_goes_in_the_frame_redacted_never_in_the_line(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """`with_content` (the trail's content sink) writes the line with the JSON sink's
    write, whose tap frames it with the content, redacted by the log's redaction."""
    ours, theirs = pair
    feed = _feed(ours)
    written: list[dict[str, Any]] = []

    def write(record: dict[str, Any]) -> None:
        written.append(record)
        _tap(feed, record)

    feed.with_content(write, lambda text: text.replace("sk-key", "[REDACTED]"),
                      _line(usage=USAGE), {"input": "prompt sk-key", "output": "answer"})
    _tap(feed, _line(host="after.test"))  # (the next line carries none)
    (_, _, _, content, line), (_, _, _, after, _) = _frames(theirs)
    assert content == {"input": "prompt [REDACTED]", "output": "answer"}
    assert "prompt" not in json.dumps(line) and written == [line]
    assert after is None and feed.content is None


def test_no_exporter_drops_and_counts(pair: tuple[socket.socket, socket.socket]) -> None:
    feed = _feed(None)
    counter = metrics.TELEMETRY_DROPPED.labels("exporter_down")
    before = counter._value.get()
    _tap(feed, _line())
    assert feed.dropped == 1
    assert counter._value.get() == before + 1
    assert b'sandbox_gateway_telemetry_dropped_total{reason="exporter_down"}' in \
        metrics.exposition()  # (in the registry /metrics shows)


def test_an_exporter_gone_detaches_and_drops(pair: tuple[socket.socket, socket.socket]
                                            ) -> None:
    ours, theirs = pair
    feed = _feed(ours)
    theirs.close()
    _tap(feed, _line())
    assert feed.sock is None and feed.dropped == 1
    _tap(feed, _line())
    assert feed.dropped == 2


def test_a_full_socket_never_blocks_and_the_queue_is_bounded(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """An exporter that reads nothing: the socket buffer fills, then `queue` frames wait,
    then every further line is dropped and counted, each tap returning at once."""
    ours, theirs = pair
    feed = _feed(ours, queue=100)
    big = _line(path="/" + "p" * 4000)
    started = time.monotonic()
    for _ in range(2000):
        _tap(feed, big)
    assert time.monotonic() - started < 2.0
    assert feed.sent > 0 and feed.dropped > 0
    assert feed.sent + feed.dropped + feed.waiting == 2000
    assert feed.waiting <= 100
    received = len(_frames(theirs))
    assert received == feed.sent
    feed.flush()  # (room again: what waited goes now)
    assert len(_frames(theirs)) > 0


def test_a_frame_larger_than_a_datagram_is_dropped_alone(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    feed = _feed(ours)
    _tap(feed, _line(path="/" + "x" * (MAX_DATAGRAM * 3)))
    _tap(feed, _line(host="small.test"))
    frames = _frames(theirs)
    assert [f[4]["host"] for f in frames] == ["small.test"]
    assert feed.dropped == 1


def test_lines_on_a_loop_go_as_one_datagram_per_flush(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    feed = _feed(ours)

    async def run() -> list[bytes]:
        for n in range(50):
            _tap(feed, _line(host=f"h{n}.test"))
        assert feed.sent == 0  # (queued: one send per FLUSH, not per line)
        await asyncio.sleep(FLUSH * 3)
        theirs.setblocking(False)
        out = []
        with pytest.raises(BlockingIOError):
            while True:
                out.append(theirs.recv(1 << 20))
        return out

    datagrams = asyncio.run(run())
    assert len(datagrams) == 1 and datagrams[0].count(b"\n") == 50
    assert feed.sent == 50


def _datagrams(sock: socket.socket) -> list[bytes]:
    out: list[bytes] = []
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        while True:
            out.append(sock.recv(1 << 20))
    return out


@pytest.mark.parametrize(("kw", "flag"), [({}, b"T"), ({"traces": False, "logs": True}, b"-")])
def test_a_common_line_is_framed_as_the_general_path_frames_it(
        pair: tuple[socket.socket, socket.socket], kw: dict[str, Any], flag: bytes) -> None:
    """A common line (no usage, no content, its flag fixed by the settings) takes the
    tap's two appends; the bytes are those `_frame` (sampling, provider, content) makes."""
    ours, theirs = pair
    fast, general = _feed(ours, **kw), _feed(ours, **kw)
    general._head = None  # (every line through `_frame`)
    for feed in (fast, general):
        _tap(feed, _line(host="common.test", credential=None), now=1700000000.25)
    first, second = _datagrams(theirs)
    assert first == second
    assert first.startswith(flag + b"\x1f%d\x1f\x1f\x1f{" % int(1700000000.25 * 1e9))
    assert fast.sent == general.sent == 1


def test_sampling_below_one_and_usage_still_take_the_general_path(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    sampled, full = _feed(ours, sample=0.5), _feed(ours)
    assert sampled._head is None and full._head is not None
    _tap(full, _line(usage=USAGE))  # (its provider is looked up)
    (_, _, provider, _, _), = _frames(theirs)
    assert provider == "openai"


def test_a_backlog_goes_in_datagrams_cut_at_frames(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """Lines queued past one datagram's size (the exporter was behind) go as several
    datagrams of whole frames, each at most MAX_DATAGRAM bytes, in order, all counted."""
    ours, theirs = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    feed = _feed(ours)
    lines = [_line(host=f"h{n}.test", credential=None, path="/" + "p" * 2000)
             for n in range(300)]  # (about 620 KB)

    async def queue() -> None:  # (on a loop: queued until the flush)
        feed.sock = None
        for line in lines:
            feed._parts.append(b"T\x1f1\x1f\x1f\x1f" + (json.dumps(line) + "\n").encode())
            feed.waiting += 1
        feed.sock = ours
        feed.flush()

    asyncio.run(queue())
    datagrams = _datagrams(theirs)
    assert len(datagrams) >= 4
    assert all(len(d) <= MAX_DATAGRAM and d.endswith(b"\n") for d in datagrams)
    hosts = [parse(f)[4]["host"] for d in datagrams for f in d.split(b"\n") if f]
    assert hosts == [f"h{n}.test" for n in range(300)]
    assert feed.sent == 300 and feed.waiting == 0 and feed.dropped == 0
