"""What the leak guard reads beyond data's bytes (`core/leak_readings.py`, through
`LeakScan`): base64 written in lines, joined (a token or key in `base64 .env`'s output,
cut by a break, passed about half the time before the twentieth session), and a base64
or hex run that is a compressed file, unpacked (a gzipped `.env` base64'd into a JSON
string passed always); a bomb in a run is `unreadable`, bounded by one allowance."""

from __future__ import annotations

import base64
import bz2
import functools
import gzip
import json
import lzma
import random
import textwrap
import zlib
from urllib.parse import quote

import pytest
from backports import zstd
from helpers.archives import deflated_zip, packed_words, spaced_gzip, tar_gz
from helpers.lines import random_lines

from gateway.core import archives, leak_readings
from gateway.core.leak_forms import sensitive_markers, token_markers
from gateway.core.leaks import LeakScan
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.state.base import MemoryState

KEY = "sk-live-0123456789abcdefghijklmnop"


@pytest.fixture(scope="module")
def scan(tmp_path_factory: pytest.TempPathFactory) -> tuple[LeakScan, str]:
    keys = SigningKeys.load(tmp_path_factory.mktemp("keys"))
    token = TokenService(keys, MemoryState(), lambda name: []).mint("sandbox-1", "agent").token
    return LeakScan(token_markers(token, "sandbox-gateway"), sensitive_markers(KEY.encode())), \
        token


def _image(size: int) -> bytes:
    """A PNG's first bytes and `size` more, random (a run no compressor shortens)."""
    return b"\x89PNG\r\n\x1a\n" + random.Random(size).randbytes(size)


def _image_zip(size: int, data: bytes) -> bytes:
    return _image(size) + deflated_zip({"README": b"notes\n", ".env": data})


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
    "zstd": zstd.compress,
    # (a skippable frame first: pzstd's of 4 bytes; of 5, the frame's base64 at no
    # group's start: not read before the twenty-second session)
    "pzstd": lambda d: b"\x50\x2a\x4d\x18\x04\0\0\0\0\0\0\0" + zstd.compress(d),
    "zstd, skippable 5": lambda d: b"\x5b\x2a\x4d\x18\x05\0\0\0hello" + zstd.compress(d),
    "zip": lambda d: deflated_zip({"README": b"notes\n", ".env": d}),
    "tar.gz": lambda d: tar_gz({".env": d}),
    # (an image that is also a zip: the zip's signature at byte 0, 1 or 2 of a base64
    # group, `streamed_runs.signed_start`; not read before the twenty-fourth session)
    **{f"zip after an image, at {at}": functools.partial(_image_zip, 1000 + at)
       for at in range(3)},
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


@pytest.mark.parametrize("how", ["base64", "lines", "escaped lines", "hex", "url-safe",
                                 "escaped slashes"])
@pytest.mark.parametrize("kind", ["gzip", "zip", "bzip2", "xz", "zstd"])
def test_a_compressed_run_of_megabytes_is_followed_as_it_streams(
        scan: tuple[LeakScan, str], kind: str, how: str) -> None:
    """A run of a 1 MB compressed file (1.3-2 MB of characters: refused as unreadable
    before the twenty-first session, past 1 MiB) is read as it streams, once, from its
    start (`streamed_runs.FollowedRun`): the token at its file's end is found, a file
    without it passes, the run's bytes are not kept."""
    leaks, token = scan
    for tail, expect in ((b"\nT=" + token.encode() + b"\n", "token"), (b"\n", None)):
        packed = packed_words(kind, tail)
        assert token.encode()[-40:] not in packed  # (read only unpacked)
        if how in ("base64", "url-safe", "escaped slashes"):
            run = (base64.b64encode if how != "url-safe" else base64.urlsafe_b64encode)(
                packed).decode()
        elif how == "hex":
            run = packed.hex()
        else:  # (lines of 76: JSON escapes the breaks, `\\n`; as sent in a text body)
            run = _lines(packed)
        body = (json.dumps({"content": run}) if how != "lines" else run + "\n--\n").encode()
        if how == "escaped slashes":  # (PHP's json_encode, Java's writers: every `/` as
            body = body.replace(b"/", b"\\/")  # `\/`; the run was read up to the first)
        assert len(body) > 1_100_000  # (past 1 MiB)
        stream = leaks.stream()
        found = [stream.feed(body[i:i + 65_536]) for i in range(0, len(body), 65_536)]
        found.append(stream.end())
        assert set(found) <= {expect, None} and (expect in found), (kind, how)
        assert len(stream._tail) <= leaks.keep


@pytest.mark.parametrize("at", [0, 1, 2])
@pytest.mark.parametrize("how", ["base64", "lines", "hex"])
def test_a_run_of_an_image_that_is_also_a_zip_is_followed_from_its_zip(
        scan: tuple[LeakScan, str], at: int, how: str) -> None:
    """1.5 MB of an image, then a zip with the token in a file: the run's start says no
    compressed file, but its zip's local header, encoded where it falls in a base64
    group (or in hex), is where the stream follows it from (`open_run`)."""
    leaks, token = scan
    image = _image(1_500_000 + at)
    for tail, expect in ((b"T=" + token.encode() + b"\n", "token"), (b"T=none\n", None)):
        packed = image + deflated_zip({"README": b"notes\n", ".env": tail})
        run = packed.hex() if how == "hex" else _lines(packed) if how == "lines" else \
            base64.b64encode(packed).decode()
        body = json.dumps({"content": run}).encode()
        stream = leaks.stream()
        found = [stream.feed(body[i:i + 65_536]) for i in range(0, len(body), 65_536)]
        found.append(stream.end())
        assert set(found) <= {expect, None} and (expect in found), (at, how)
        assert leaks.find(body) == expect  # (held whole: the markers' pass)


def _packed(kind: str, data: bytes) -> bytes:
    if kind == "zip":
        return deflated_zip({"a/b.bin": data})
    return {"gzip": lambda d: gzip.compress(d, mtime=0), "bzip2": bz2.compress,
            "zstd": zstd.compress, "xz": lzma.compress}[kind](data)


def test_a_run_that_gives_nothing_for_long_is_unreadable(
        scan: tuple[LeakScan, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose bytes give nothing for `HELD` bytes (empty deflate blocks spacing a
    token's halves apart) is unreadable: its bytes would be held back without bound."""
    leaks, _ = scan
    monkeypatch.setattr("gateway.core.leak_stream.HELD", 200_000)
    packed = spaced_gzip(b"#" * 64 + b"\nK=", KEY.encode(), b"\n", 40_000)
    body = json.dumps({"content": base64.b64encode(packed).decode()}).encode()
    stream = leaks.stream()
    found = [stream.feed(body[i:i + 16_384]) for i in range(0, len(body), 16_384)]
    assert next(f for f in found if f is not None) == "unreadable"


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


@pytest.mark.parametrize("empties", [0, 3_000])
def test_a_followed_runs_bytes_go_on_only_once_what_they_unpack_to_is_read(
        scan: tuple[LeakScan, str], empties: int) -> None:
    """What of a followed run may go on (`StreamScan.held_back`: the request side holds
    the rest) unpacks to none of a key: the compressed bytes of its first half are held
    back until the key is found whole, even where the stream spaces the halves thousands
    of empty deflate blocks apart."""
    leaks, _ = scan
    r = random.Random(7)
    words = b" ".join(r.choice([b"alpha", b"beta", b"gamma"]) + str(i).encode()
                      for i in range(40_000)) + b"\nT="
    packed = spaced_gzip(words, KEY.encode(), b"\n" + words, empties)
    run = base64.b64encode(packed)
    body = b'{"content": "' + run + b'"}'
    stream = leaks.stream()
    sent = 0
    for i in range(0, len(body), 4096):
        found = stream.feed(body[i:i + 4096])
        if found is not None:
            break
        sent = max(sent, i + 4096 - max(leaks.keep, stream.held_back))
    assert found == "secret"
    went = body[body.index(run):sent]  # (the run's bytes that went on: what they unpack to)
    reader = zlib.decompressobj(31)
    shown = reader.decompress(base64.b64decode(went[:len(went) // 4 * 4]))
    assert len(shown) <= len(words) and sent > 100_000
