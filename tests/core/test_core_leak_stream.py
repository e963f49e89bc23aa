"""The leak guard over a stream (`core/leak_stream.py`): a marker cut across chunks is
found; a compressed run is followed to its end and let go; nothing is held where no run
is followed. (Its compressed runs at length: tests/core/test_core_leak_readings.py.)"""

from __future__ import annotations

import base64
import gzip

import pytest
from helpers.archives import deflated_zip

from gateway.core.archives import Allowance
from gateway.core.dlp.fastscan import RUN, ChunkPass, Gate
from gateway.core.leak_forms import sensitive_markers
from gateway.core.leak_stream import StreamScan, plain
from gateway.core.leaks import LeakScan

KEY = "sk-live-0123456789abcdefghijklmnop"
LEAKS = LeakScan((), sensitive_markers(KEY.encode()))


@pytest.mark.parametrize(("data", "expected"), [
    (b"plain text", True), (b"100%", False), (b"a\\u0041", False), (b"a\\/b", False),
    (b"a\\nb", True), (b"C:\\\\dir", True)])
def test_plain_says_whether_canonical_form_undoes_an_escape(data: bytes, expected: bool) -> None:
    assert plain(data) is expected


@pytest.mark.parametrize("cut", [1, 5, 17, len(KEY) - 1])
def test_a_key_cut_across_two_chunks_is_found(cut: int) -> None:
    stream = LEAKS.stream()
    body = b"x" * 3000 + KEY.encode() + b"y" * 3000
    at = 3000 + cut
    assert stream.feed(body[:at]) is None
    assert stream.feed(body[at:]) == "secret"


def test_a_followed_run_is_let_go_where_it_ends() -> None:
    """Nothing is held back outside a run; a run followed is held back while it goes
    on, let go at its end; a key in a zip's second entry is found."""
    stream = StreamScan(LEAKS)
    assert stream.feed(b"{" * 10_000) is None and stream.held_back == 0
    zipped = deflated_zip({"a.txt": b"word " * 100_000, ".env": KEY.encode()})
    run = base64.b64encode(zipped)
    half = len(run) // 2
    assert stream.feed(b'{"content": "' + run[:half]) is None
    assert stream.held_back > 0
    assert stream.feed(run[half:] + b'"}') == "secret"
    clean = LEAKS.stream()
    run = base64.b64encode(gzip.compress(b"word " * 200_000, mtime=0))
    for piece in (b'{"c": "' + run[:3000], run[3000:], b'"}'):
        assert clean.feed(piece) is None
    assert clean.held_back == 0 and clean.end() is None


class _Counted:
    """The markers, counting the windows searched."""

    def __init__(self) -> None:
        self.keep, self.marker_runs, self.searched = LEAKS.keep, LEAKS.marker_runs, 0

    def find(self, data: bytes, gate: Gate | None = None, allowance: Allowance | None = None,
             deeper: bool = True, run: bool = False) -> str | None:
        self.searched += 1
        return LEAKS.find(data, gate, allowance, deeper, run)


def test_a_stream_fed_no_answer_makes_its_own_pass() -> None:
    """A stream no other check's pass answers for (no `dlp:`) makes its own: a window
    no run ends in is neither made nor searched (each 64 KiB piece of a 4 MiB upload
    was copied into a window before the twenty-second session), and a key cut across
    two pieces is still found, also where answers start coming part-way."""
    counted = _Counted()
    stream = StreamScan(counted)
    prose = b"the build passed and the tests ran " * 2000
    for _ in range(20):
        assert stream.feed(prose) is None
    assert counted.searched == 0
    for cut in (1, 10, len(KEY) - 1):
        body = prose + KEY.encode() + prose
        at = len(prose) + cut
        own = StreamScan(counted)
        assert own.feed(body[:at]) is None and own.feed(body[at:]) == "secret"
        mixed, passing = StreamScan(counted), ChunkPass(Gate())
        assert mixed.feed(body[:at]) is None  # (its own pass, then the answers fed)
        flags = passing.flags(body[:at], escapes=True)
        flags = passing.flags(body[at:], escapes=True)
        assert mixed.feed(body[at:], run=bool(flags & RUN), flags=flags) == "secret"
