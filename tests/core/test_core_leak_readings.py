"""What the leak guard reads beyond data's bytes (`core/leak_readings.py`, through
`LeakScan`): base64 written in lines, joined (a token or key in `base64 .env`'s output,
cut by a break, passed about half the time before the twentieth session), and a base64
or hex run that is a compressed file, unpacked (a gzipped `.env` base64'd into a JSON
string passed always); a bomb in a run is `unreadable`, bounded by one allowance."""

from __future__ import annotations

import base64
import bz2
import gzip
import json
import lzma
import random
import textwrap
from urllib.parse import quote

import pytest
from helpers.archives import deflated_zip, tar_gz
from helpers.lines import random_lines

from gateway.core import archives, leak_readings
from gateway.core.leak_forms import sensitive_markers, token_markers
from gateway.core.leaks import LeakScan
from gateway.services.identity.tokens import SigningKeys, TokenService
from gateway.services.state.base import MemoryState

KEY = "sk-live-0123456789abcdefghijklmnop"


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> tuple[LeakScan, str]:
    keys = SigningKeys.load(tmp_path_factory.mktemp("keys"))
    token = TokenService(keys, MemoryState(), lambda name: []).mint("sandbox-1", "agent").token
    return LeakScan(token_markers(token, "sandbox-gateway"), sensitive_markers(KEY.encode())), \
        token


def _lines(data: bytes, width: int = 76, newline: str = "\n") -> str:
    return newline.join(textwrap.wrap(base64.b64encode(data).decode(), width))


@pytest.mark.parametrize("width", [20, 64, 76])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("padding", [0, 4000], ids=["small", "large"])
def test_a_token_or_key_in_base64_lines_is_found_at_every_cut(
        scan: tuple[LeakScan, str], width: int, newline: str, padding: int) -> None:
    """At every cut of the value by a break; in a small text (read for blocks always)
    and a large one (where a tile of a marker says to: `_Markers.kind`)."""
    leaks, token = scan
    for secret, kind in ((token, "token"), (KEY, "secret")):
        for before in range(0, 80, 3):
            data = b"# notes\n" * (padding // 8) + b"#" * before + b"VALUE=" + \
                secret.encode() + b"\n"
            lines = _lines(data, width, newline)
            for sent in (lines.encode(), json.dumps({"content": lines}).encode(),
                         f"content={quote(lines)}".encode()):
                assert leaks.find(sent) == kind, (kind, before, sent[:20])


PACKED = {
    "gzip": lambda d: gzip.compress(d, mtime=0),
    "bzip2": bz2.compress,
    "xz": lzma.compress,
    "zip": lambda d: deflated_zip({"README": b"notes\n", ".env": d}),
    "tar.gz": lambda d: tar_gz({".env": d}),
}
ENCODED = {
    "base64": lambda d: base64.b64encode(d).decode(),
    "base64url": lambda d: base64.urlsafe_b64encode(d).decode().rstrip("="),
    "hex": lambda d: d.hex(), "HEX": lambda d: d.hex().upper(),
    "base64 lines": _lines,
}


@pytest.mark.parametrize("encoding", sorted(ENCODED))
@pytest.mark.parametrize("kind", sorted(PACKED))
def test_a_token_or_key_in_a_compressed_run_is_found(
        scan: tuple[LeakScan, str], kind: str, encoding: str) -> None:
    leaks, token = scan
    for secret, found in ((token, "token"), (KEY, "secret")):
        run = ENCODED[encoding](PACKED[kind](b"VALUE=" + secret.encode() + b"\n"))
        for sent in (json.dumps({"path": "x.gz", "content": run}).encode(),
                     f"file={quote(run)}".encode(), f"data:;base64,{run}".encode()):
            assert leaks.find(sent) == found, (kind, encoding, sent[:30])
        # (and as it streams in pieces: the run whole in a window)
        stream = leaks.stream()
        body = json.dumps({"content": run}).encode()
        assert found in [stream.feed(body[i:i + 100]) for i in range(0, len(body), 100)]


def test_ordinary_runs_and_lines_find_nothing(scan: tuple[LeakScan, str]) -> None:
    leaks, _ = scan
    r = random.Random(20)
    noise = bytes(r.getrandbits(8) for _ in range(3000))
    for data in (gzip.compress(b"def main():\n    return 0\n" * 40, mtime=0), noise):
        for encode in ENCODED.values():
            assert leaks.find(json.dumps({"content": encode(data)}).encode()) is None
    ids = "\\n".join(f"call_{i:02d}Xy7Qz3abCDef12Gh34Ijkl" for i in range(50))
    assert leaks.find(f'{{"content": "{ids}"}}'.encode()) is None


def test_a_bomb_in_a_run_is_unreadable(scan: tuple[LeakScan, str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    leaks, _ = scan
    monkeypatch.setattr(archives, "FLOOR", 100_000)
    bomb = base64.b64encode(gzip.compress(b"\0" * 60_000, mtime=0)).decode()
    assert leaks.find(json.dumps({"a": bomb}).encode()) is None
    assert leaks.find(json.dumps({"a": [bomb] * 4}).encode()) == "unreadable"


def test_the_c_blocks_are_the_expressions_blocks() -> None:
    """`_gate.wrapped_blocks` (C) and the expressions it stands for find the same
    blocks, on lines of every width around the line bound and every break."""
    if leak_readings._wrapped_blocks is None:
        pytest.skip("the C gate is not built")
    r = random.Random(43)
    for _ in range(3000):
        data = random_lines(r, (0, 3, 19, 20, 21, 24, 40)).encode()
        native = leak_readings._blocks(data)
        monkey = leak_readings._wrapped_blocks
        leak_readings._wrapped_blocks = None
        try:
            assert leak_readings._blocks(data) == native, repr(data)
        finally:
            leak_readings._wrapped_blocks = monkey


@pytest.mark.parametrize("lines", [False, True], ids=["one run", "in lines"])
def test_a_compressed_run_longer_than_a_window_is_read_whole_as_it_streams(
        scan: tuple[LeakScan, str], lines: bool) -> None:
    """The run goes on past each window: it is kept whole into the next (up to
    HELD_RUN bytes: past it, unreadable), and the token at the end of its file found."""
    leaks, token = scan
    r = random.Random(5)
    words = b" ".join(r.choice([b"alpha", b"beta", b"gamma", b"delta"]) + str(i).encode()
                      for i in range(60_000))
    packed = gzip.compress(words + b"\nTOKEN=" + token.encode() + b"\n", mtime=0)
    run = _lines(packed) if lines else base64.b64encode(packed).decode()
    body = json.dumps({"path": "log.gz", "content": run}).encode()
    assert len(body) > 100_000 and leaks.find(body) == "token"
    stream = leaks.stream()
    found = [stream.feed(body[i:i + 16384]) for i in range(0, len(body), 16384)]
    assert "token" in found and set(found[:found.index("token")]) == {None}
    # (the same file without the token: nothing, and nothing kept past the run's end)
    clean = gzip.compress(words, mtime=0)
    body = json.dumps({"content": base64.b64encode(clean).decode(), "more": "x" * 50_000})
    stream = leaks.stream()
    assert {stream.feed(body.encode()[i:i + 16384])
            for i in range(0, len(body), 16384)} == {None}
    assert len(stream._tail) < 20_000


def test_a_compressed_run_past_the_held_bound_is_unreadable_as_it_streams(
        scan: tuple[LeakScan, str], monkeypatch: pytest.MonkeyPatch) -> None:
    leaks, _ = scan
    monkeypatch.setattr(leak_readings, "HELD_RUN", 50_000)
    r = random.Random(6)
    data = bytes(r.getrandbits(8) for _ in range(60_000))
    body = json.dumps({"content": base64.b64encode(gzip.compress(data, mtime=0)).decode()})
    stream = leaks.stream()
    assert "unreadable" in [stream.feed(body.encode()[i:i + 16384])
                            for i in range(0, len(body), 16384)]
    # (random base64 of the same length, no compressed file's start: read as it goes)
    body = json.dumps({"content": base64.b64encode(b"\1" + data).decode()})
    stream = leaks.stream()
    assert {stream.feed(body.encode()[i:i + 16384]) for i in range(0, len(body), 16384)} \
        == {None}


def test_a_streams_runs_share_one_bound_grown_as_it_comes(
        scan: tuple[LeakScan, str], monkeypatch: pytest.MonkeyPatch) -> None:
    leaks, _ = scan
    sparse = base64.b64encode(gzip.compress(b"\0" * 200_000, mtime=0)).decode()
    monkeypatch.setattr(archives, "FLOOR", 500_000)
    monkeypatch.setattr(archives, "RATIO", 1)  # (12 x 200 kB: past 0.5 MB + the stream)
    bombs = json.dumps({"pad": ["z" * 70_000 + " " + sparse for _ in range(12)]}).encode()
    stream = leaks.stream()
    found = [stream.feed(bombs[i:i + 16_384]) for i in range(0, len(bombs), 16_384)]
    assert "unreadable" in found  # (a floor each window: 12 x 200 kB read, never refused)
    stream = leaks.stream()
    one = json.dumps({"pad": "z" * 70_000 + " " + sparse}).encode()
    assert {stream.feed(one[i:i + 16_384]) for i in range(0, len(one), 16_384)} == {None}


def test_a_kept_run_is_held_back_until_it_is_read(scan: tuple[LeakScan, str]) -> None:
    """What of a compressed run a stream keeps is held back (`StreamScan.held_back`: the
    request side does not send it on) until the run ends and is read whole: a token at
    the end of its file is found before any of the run goes upstream."""
    leaks, token = scan
    r = random.Random(7)
    words = b" ".join(r.choice([b"alpha", b"beta", b"gamma"]) + str(i).encode()
                      for i in range(40_000))
    run = base64.b64encode(gzip.compress(words + b"\nT=" + token.encode(), mtime=0))
    body = b'{"content": "' + run + b'"}'
    stream = leaks.stream()
    sent = 0
    for i in range(0, len(body), 4096):
        found = stream.feed(body[i:i + 4096])
        if found is not None:
            break
        sent = max(sent, i + 4096 - max(leaks.keep, stream.held_back))
    assert found == "token" and sent <= body.index(b"H4sI")
