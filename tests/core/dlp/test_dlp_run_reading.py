"""The runs a scanner decodes (`core/dlp/run_reading.py`): base64 written in lines is read
joined, as the decoders a receiver uses read it (a credential in `base64 .env`'s output,
cut by a line break, passed before the twentieth session); a run that decodes to a
compressed file is unpacked (a `.env` gzipped, base64'd into a JSON string, as GitHub's
contents API takes a file, passed before too), its bombs bounded by one allowance a body;
and the memory of stretches that decoded to nothing is bounded."""

from __future__ import annotations

import base64
import bz2
import gzip
import json
import lzma
import random
import textwrap
import time
import zlib
from pathlib import Path
from urllib.parse import quote

import pytest
from backports import zstd
from helpers.archives import deflated_zip, spaced_gzip, tar_gz
from helpers.dlp_corpus import DEFAULT_CORPUS, fake

from gateway.core import archives
from gateway.core.dlp import DEFAULT, Location, Scanner, StreamScanner
from gateway.core.dlp.decoding import Unreadable, stretches
from gateway.core.dlp.lines import wrapped
from gateway.core.dlp.run_reading import CLEAN_RUN, CLEAN_RUNS
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")
ENV = b"GITHUB_TOKEN=" + fake("github").text.encode() + b"\n"


def _found(body: bytes, ctype: str = "application/json") -> tuple[list[str], str | None]:
    result = SCANNER.scan_body(body, ctype)
    return [str(f.location) for f in result.findings], result.unreadable


def _lines(data: bytes, width: int, newline: str = "\n") -> str:
    return newline.join(textwrap.wrap(base64.b64encode(data).decode(), width))


@pytest.mark.parametrize("width", [20, 60, 64, 76])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_a_credential_in_base64_written_in_lines_is_found(width: int, newline: str) -> None:
    """Every default detector's fake, at every place against the lines' breaks (so some
    cut by one), in a JSON string and a text body."""
    for item in DEFAULT_CORPUS:
        for before in range(0, 60, 7):
            data = b"#" * before + b"KEY=" + item.text.encode() + b"\n" + b"tail " * 9
            lines = _lines(data, width, newline)
            where, _ = _found(json.dumps({"message": "add", "content": lines}).encode())
            assert where and all("(in base64" in w for w in where), (item.detector, before)
            where, _ = _found(lines.encode(), "text/plain")
            assert where, (item.detector, before)


def test_lines_of_one_block_and_only_those_are_joined() -> None:
    text = "id " + "A" * 10 + "bcdefghijklmnopqrstuvwxyz0123\nQWERTYUIOPasdfghjklzxcvbnm12\r\nabc"
    listed = list(stretches(text))
    assert list(wrapped(text, listed)) == [(3, len(text))]
    # (a short line ends the block: the line after it is not of it; a blank line too)
    text = "Xy7Qz3abCDef12Gh34IjklMn\nab\nQWERTYUIOPasdfghjklzxcvbnm12\n\nXy7Qz3abCDef12Gh34Ijkl"
    assert list(wrapped(text, list(stretches(text)))) == [(0, 27)]
    assert list(wrapped("one line only, Xy7Qz3abCDef12Gh34Ijkl", [(15, 37)])) == []
    # (an id of 21 characters and the next string: no encoder ends a line at 21; two
    # full lines of 21 and a short one are a block, and so is the same as JSON sends it)
    ids = "call_Xy7Qz3abCDef12Gh\ntype\nfunction"
    assert list(wrapped(ids, list(stretches(ids)))) == []
    text = "call_Xy7Qz3abCDef12Gh\nQWERTYUIOPasdfghjklzx\nabc"
    assert list(wrapped(text, list(stretches(text)))) == [(0, len(text))]
    escaped = text.replace("\n", "\\n")
    assert list(wrapped(escaped, list(stretches(escaped)))) == []
    assert list(wrapped(escaped, list(stretches(escaped)), escaped=True)) == [
        (0, len(escaped))]


def test_prose_and_code_in_lines_find_nothing() -> None:
    src = Path(archives.__file__).read_text()  # (lines of code and docstrings)
    assert _found(json.dumps({"content": src}).encode()) == ([], None)
    ids = "\n".join(f"call_{i:02d}Xy7Qz3abCDef12Gh34Ijkl" for i in range(40))
    assert _found(json.dumps({"content": ids}).encode()) == ([], None)


PACKED = {
    "gzip": gzip.compress(ENV, mtime=0),
    "bzip2": bz2.compress(ENV),
    "xz": lzma.compress(ENV),
    "zstd": zstd.compress(ENV),
    # (pzstd's: a skippable frame first; not taken for zstd before the twenty-second)
    "pzstd": b"\x50\x2a\x4d\x18\x04\0\0\0\0\0\0\0" + zstd.compress(ENV),
    "zip": deflated_zip({"README": b"notes\n", ".env": ENV}),
    "tar.gz": tar_gz({".env": ENV}),
}


@pytest.mark.parametrize("kind", sorted(PACKED))
def test_a_credential_in_a_compressed_file_in_a_run_is_found(kind: str) -> None:
    data = PACKED[kind]
    for encoded in (base64.b64encode(data).decode(), base64.urlsafe_b64encode(data).decode(),
                    data.hex(), data.hex().upper(), _lines(data, 76)):
        where, _ = _found(json.dumps({"path": ".env.gz", "content": encoded}).encode())
        assert any("$.content" in w and "archive" in w for w in where), (kind, encoded[:8])
        where, _ = _found(f"path=x&content={quote(encoded)}".encode(),
                          "application/x-www-form-urlencoded")
        assert any("form field content" in w and "archive" in w for w in where), kind
    found = SCANNER.scan_request("PUT", "/upload", [("X-Blob", base64.b64encode(data).decode())])
    assert [str(f.location) for f in found.findings][:1] in (
        ["header X-Blob zip entry .env (in base64, archive)"],
        [f"header X-Blob {_FILE.get(kind, kind)} file (in base64, archive)"])


_FILE = {"tar.gz": "gzip", "pzstd": "zstd"}  # (what a run's file is said to be)


def test_what_a_runs_file_holds_beside_nothing_is_clean() -> None:
    for data in (gzip.compress(b"def main():\n    return 0\n" * 50, mtime=0),
                 deflated_zip({"a.py": b"print('hello')\n"})):
        assert _found(json.dumps({"content": base64.b64encode(data).decode()}).encode()) == (
            [], None)


def test_a_compressed_file_in_a_runs_file_is_not_unpacked_again() -> None:
    inner = base64.b64encode(gzip.compress(ENV, mtime=0))
    outer = gzip.compress(b"blob: " + inner + b"\n", mtime=0)
    where, _ = _found(json.dumps({"content": base64.b64encode(outer).decode()}).encode())
    assert where == []  # (one level: a bomb's bound is of the body)


def test_the_runs_of_a_body_share_one_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small bombs in one body: one bound for all (FLOOR plus RATIO times the
    body), not one each; a run read outside a body's reading: its own size alone."""
    monkeypatch.setattr(archives, "FLOOR", 100_000)
    bomb = base64.b64encode(gzip.compress(b"\0" * 60_000, mtime=0)).decode()
    one = json.dumps({"content": [bomb]}).encode()
    assert _found(one) == ([], None)  # (60 kB: under the floor)
    many = json.dumps({"content": [bomb] * 4}).encode()
    _, unreadable = _found(many)
    assert unreadable is not None and "64 times" in unreadable
    with pytest.raises(Unreadable, match="64 times"):  # (outside a body's reading: 64
        SCANNER.scan_text(f"blob {bomb} end", Location("body"))  # times the run alone)


def test_what_the_runs_memory_holds_is_bounded() -> None:
    scanner = Scanner(build(("github",)), b"test-salt")
    for i in range(3 * CLEAN_RUNS):
        assert not scanner.scan_text(f"id Xy7Qz3abCDef12Gh{i:08d}", Location("body"))
        assert len(scanner.runs.clean) <= CLEAN_RUNS
    long = "aB" * CLEAN_RUN  # (over CLEAN_RUN: decoded each time, never remembered)
    assert not scanner.scan_text(long, Location("body"))
    assert long not in scanner.runs.clean


def _streamed(body: bytes, piece: int, ctype: str = "application/json"
              ) -> tuple[list[str], str | None]:
    stream = StreamScanner(SCANNER, content_type=ctype, unpack=True)
    found: list[str] = []
    for i in range(0, len(body), piece):
        result = stream.feed(body[i:i + piece])
        found += [str(f.location) for f in result.findings]
        if result.unreadable:
            return found, result.unreadable
    result = stream.end()
    return found + [str(f.location) for f in result.findings], result.unreadable


def _log(lines: int) -> bytes:
    return b"\n".join(b"step %d: ok, %d files" % (i, i * 7 % 13) for i in range(lines))


@pytest.mark.parametrize("in_lines", [False, True], ids=["one run", "in lines"])
def test_a_compressed_run_longer_than_a_window_is_read_whole_as_it_streams(
        in_lines: bool) -> None:
    """A run past the stream's window (64 KiB) is kept whole until it ends (before the
    twentieth session the part past the window was read as more base64)."""
    packed = gzip.compress(_log(60_000) + b"\n" + ENV, mtime=0)
    run = _lines(packed, 76) if in_lines else base64.b64encode(packed).decode()
    body = json.dumps({"path": "build.log.gz", "content": run}).encode()
    assert len(run) > 200_000
    for piece in (16_384, 65_536):
        where, unreadable = _streamed(body, piece)
        assert unreadable is None and any("archive" in w for w in where), piece
    clean = json.dumps({"content": base64.b64encode(gzip.compress(_log(60_000), mtime=0))
                        .decode()}).encode()
    assert _streamed(clean, 16_384) == ([], None)


@pytest.mark.parametrize("how", ["base64", "escaped lines", "hex", "escaped slashes"])
@pytest.mark.parametrize("kind", ["gzip", "zip", "bzip2", "xz", "zstd"])
def test_a_compressed_run_of_megabytes_is_followed_as_it_streams(kind: str, how: str) -> None:
    """A run of a 1.5 MB file (2-3 MB of characters: refused as unreadable before the
    twenty-first session, past 1 MiB) is read once, as it streams, from where a window's
    cut finds its start (`streamed_runs.FollowedRun`): the key at its file's end is found
    (`body gzip file at offset N (in base64, archive)`, N in the file); a file without
    one passes."""
    noise = random.Random(11).randbytes(1_500_000)
    for tail, expect in ((b"\n" + ENV, True), (b"\n", False)):
        data = noise + tail
        packed = deflated_zip({"a/.env": data}) if kind == "zip" else {
            "gzip": lambda d: gzip.compress(d, mtime=0), "bzip2": bz2.compress,
            "zstd": zstd.compress, "xz": lzma.compress}[kind](data)
        run = packed.hex() if how == "hex" else _lines(packed, 76) if how == "escaped lines" \
            else base64.b64encode(packed).decode()
        body = json.dumps({"message": "add", "content": run}).encode()
        if how == "escaped slashes":  # (PHP's json_encode, Java's writers: every `/` as
            body = body.replace(b"/", b"\\/")  # `\/`; the run was read up to the first)
        where, unreadable = _streamed(body, 65_536)
        assert unreadable is None
        said = "zip entry a/.env" if kind == "zip" else f"{kind} file"
        encoding = "hex" if how == "hex" else "base64"
        files = [w for w in where if w.endswith(f"(in {encoding}, archive)")]
        assert [w.split(" at offset ")[0] for w in files] == ([f"body {said}"] if expect
                                                             else []), (kind, how, where)
        assert expect or where == []  # (a stored block's key: also in the run's bytes)


def test_a_followed_run_that_gives_nothing_for_long_is_unreadable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose bytes give nothing for `HELD` bytes (empty deflate blocks spacing a
    key's halves apart) is unreadable: its bytes would be held back without bound."""
    monkeypatch.setattr("gateway.core.dlp.stream.HELD", 200_000)
    key = fake("github").text.encode()
    packed = spaced_gzip(_log(30_000) + b"\nKEY=", key, b"\n", 40_000)
    body = json.dumps({"content": base64.b64encode(packed).decode()}).encode()
    where, unreadable = _streamed(body, 16_384)
    assert where == [] and unreadable is not None and "gives nothing" in unreadable


@pytest.mark.parametrize("empties", [0, 30_000])  # (30,000: 200 kB, past the window)
def test_a_followed_runs_bytes_are_pending_until_what_they_unpack_to_is_read(
        empties: int) -> None:
    """What of a followed run a caller may send on (all but `pending`) unpacks to none
    of the key it holds, found later: its halves' compressed bytes held until it is read
    whole, even spaced apart by thousands of empty deflate blocks."""
    key = fake("github").text.encode()
    words = _log(40_000) + b"\nKEY="
    run = base64.b64encode(spaced_gzip(words, key, b"\n" + _log(40_000), empties))
    body = b'{"content": "' + run + b'"}'
    stream = StreamScanner(SCANNER, content_type="application/json", unpack=True)
    sent = 0
    for i in range(0, len(body), 4096):
        result = stream.feed(body[i:i + 4096])
        if result.findings:
            break
        sent = max(sent, i + 4096 - stream.pending)
    assert result.findings and result.unreadable is None
    went = body[body.index(run):sent]
    shown = zlib.decompressobj(31).decompress(base64.b64decode(went[:len(went) // 4 * 4]))
    assert len(shown) <= len(words) and sent > 100_000


def test_a_run_in_small_chunks_is_read_once() -> None:
    """A sender of a few bytes a chunk: the followed run is read once (a 300 kB run in
    100-byte chunks: before the twenty-first session a run kept whole was read again
    with each window's new characters)."""
    packed = gzip.compress(_log(20_000) + b"\n" + ENV, mtime=0)
    body = json.dumps({"content": base64.b64encode(packed).decode()}).encode()
    started = time.perf_counter()
    where, _ = _streamed(body, 100)
    assert any("archive" in w for w in where)
    assert time.perf_counter() - started < 5


def test_a_block_of_lines_crossing_a_window_is_cut_at_its_alignment() -> None:
    """A key in base64 lines across the window's cut: the next window reads the block
    from a multiple of 4 of its characters (lines of 70: breaks not counted)."""
    for before in range(0, 70_000, 9_973):
        data = b"x" * before + b"KEY=" + fake("github").text.encode() + b"\n" + b"y" * 80_000
        body = json.dumps({"content": _lines(data, 70)}).encode()
        where, unreadable = _streamed(body, 16_384)
        assert unreadable is None and where, before


def test_a_streams_runs_share_one_bound_grown_as_it_comes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's runs share one allowance (FLOOR, and RATIO times what came): a small
    run of a very compressible file is read, not refused for its own size; many bombs
    over many windows are refused, not read a floor each."""
    sparse = base64.b64encode(gzip.compress(b"\0" * 200_000, mtime=0)).decode()
    body = json.dumps({"pad": "x" * 300_000, "log": sparse, "more": "y" * 300_000}).encode()
    assert _streamed(body, 16_384) == ([], None)
    monkeypatch.setattr(archives, "FLOOR", 500_000)
    monkeypatch.setattr(archives, "RATIO", 1)  # (12 x 200 kB: past 0.5 MB + the stream)
    bombs = json.dumps({"pad": ["z" * 70_000 + " " + sparse for _ in range(12)]}).encode()
    _, unreadable = _streamed(bombs, 16_384)
    assert unreadable is not None and "times its size" in unreadable


@pytest.mark.parametrize("first", [[1], [2], [3], [5], [2, 1]])
def test_a_block_behind_short_lines_is_read_at_every_alignment(first: list[int]) -> None:
    """A sender writes the base64 of a file with short first lines (a decoder that skips
    breaks reads it whole): the block from its first long line, past 1 KiB, is decoded
    from each of its first four characters, so one is the receiver's alignment."""
    for pad in range(2_000, 2_060, 3):  # (the key cut by a break at many places)
        data = b"x" * pad + b"KEY=" + fake("github").text.encode() + b"\n"
        encoded = base64.b64encode(data).decode()
        lines, at = [], 0
        for size in first:
            lines.append(encoded[at:at + size])
            at += size
        placed = "\n".join(lines + textwrap.wrap(encoded[at:], 76))
        where, _ = _found(json.dumps({"content": placed}).encode())
        assert where, (first, pad)


def _archive_of_bombs() -> bytes:
    """A `.tar.gz` of 600 kB of random words (about 3x compressible) and four base64
    runs of a gzip of 200 kB of zeros each."""
    r = random.Random(9)
    words = " ".join(r.choice(["alpha", "beta", "gamma", "delta"]) + str(r.randrange(10**6))
                     for _ in range(50_000)).encode()[:600_000]
    sparse = base64.b64encode(gzip.compress(b"\0" * 200_000, mtime=0))
    return tar_gz({"log.txt": words, "blobs.txt": b"\n".join([sparse] * 4)})


def test_an_archives_files_runs_share_the_bodys_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compressed runs in a streamed archive's files are bounded by the body's
    allowance (its bytes as sent), not a new one grown by what the files unpack to: a
    bound of a bound would let a small body inflate 64 times 64 times."""
    monkeypatch.setattr(archives, "FLOOR", 500_000)
    monkeypatch.setattr(archives, "RATIO", 1)
    body = _archive_of_bombs()
    _, unreadable = _streamed(body, 16_384, "application/gzip")
    assert unreadable is not None and "times its size" in unreadable
