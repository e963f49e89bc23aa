"""A compressed file in a base64 or hex run, read as the run streams
(`core/streamed_runs.py`): every way a run is written and cut into pieces decodes to the
file's bytes, the run ends where its characters do, and what may go on is held back
until the bytes it unpacks to are decided."""

from __future__ import annotations

import base64
import gzip
import random

import pytest
from helpers.archives import deflated_zip, spaced_gzip

from gateway.core.archives import Allowance
from gateway.core.encodings import EncodingError
from gateway.core.streamed_runs import FollowedRun, open_run

DATA = b"\n".join(b"line %d: %s" % (i, b"x" * (i % 50)) for i in range(20_000)) + b"\nEND"
PACKED = gzip.compress(DATA, mtime=0)
B64 = base64.b64encode(PACKED)


def _wrapped(run: bytes, breaks: bytes, width: int = 76) -> bytes:
    return breaks.join(run[i:i + width] for i in range(0, len(run), width))


FORMS = {
    "base64": B64,
    "url-safe": base64.urlsafe_b64encode(PACKED),
    "hex": PACKED.hex().encode(),
    "HEX": PACKED.hex().upper().encode(),
    "lines": _wrapped(B64, b"\n"),
    "crlf lines": _wrapped(B64, b"\r\n"),
    "escaped lines": _wrapped(B64, b"\\n"),
    "escaped crlf lines": _wrapped(B64, b"\\r\\n"),
    "hex lines": _wrapped(PACKED.hex().encode(), b"\n", 60),
    "escaped slashes": B64.replace(b"/", b"\\/"),
}


def _read(run: bytes, pieces: list[int]) -> tuple[bytes, FollowedRun, int]:
    """The files' bytes of `run` fed in pieces of the sizes given (cycled), then what
    the run took of the last piece."""
    follow = FollowedRun(Allowance(0))
    out, at, i = [], 0, 0
    while at < len(run) and not follow.ended:
        size = pieces[i % len(pieces)]
        out += follow.feed(run[at:at + size])
        at, i = at + size, i + 1
    out += follow.end()
    return b"".join(piece for _, _, piece in out), follow, at


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pieces", [[1], [2, 3], [7, 1, 4096], [65_536]],
                         ids=["1", "2-3", "7-1-4096", "64k"])
def test_every_written_form_cut_anywhere_reads_the_file(form: str, pieces: list[int]) -> None:
    run = FORMS[form]
    if pieces == [1] and len(run) > 300_000:
        run = run[:300_000]  # (a byte a piece: the first part, for time)
        got, _, _ = _read(run, pieces)
        assert DATA.startswith(got) and len(got) > 200_000
        return
    got, follow, _ = _read(run + b'", "next": 1}', pieces)
    assert got == DATA and follow.ended and follow.kind == "gzip"
    assert follow.encoding == ("hex" if "hex" in form.lower() else "base64")


@pytest.mark.parametrize(("after", "taken"), [
    (b'"', 0), (b"=", 0), (b"==\"", 0), (b" next", 0), (b"\\\\", 0), (b"\\u0041", 0),
    (b"\r x", 0), (b"\\r x", 0), (b"QUJD\"", 4), (b"QU\\nJD=", 6)])
def test_the_run_ends_where_its_characters_do(after: bytes, taken: int) -> None:
    """`taken`: what of the piece holding the end was the run's (a break's first bytes
    at the end of a piece wait for the next; a backslash not a break's ends it)."""
    follow = FollowedRun(Allowance(0))
    follow.feed(B64[:4000])
    follow.feed(after)
    assert follow.ended and follow.taken == taken
    assert follow.feed(b"AAAA") == [] and follow.taken == 0


def test_a_break_cut_by_a_pieces_end_waits_for_the_next() -> None:
    follow = FollowedRun(Allowance(0))
    follow.feed(B64[:76])
    for part in (b"\\", b"r", b"\\", b"n"):
        assert follow.feed(part) == [] and not follow.ended and follow.taken == 1
    follow.feed(B64[76:8000])
    assert not follow.ended and follow.out > 0


def test_a_run_that_is_no_compressed_file_ends_at_once() -> None:
    follow = FollowedRun(Allowance(0))
    assert follow.feed(base64.b64encode(b"just some text that is long enough")) == []
    assert follow.ended and follow.kind == ""


def test_a_zips_entries_come_by_name() -> None:
    run = base64.b64encode(deflated_zip({"a.txt": b"first " * 1000, ".env": b"K=v\n"}))
    follow = FollowedRun(Allowance(0))
    names = [name for _, name, _ in follow.feed(run + b'"')]
    assert names[0] == "zip entry a.txt" and names[-1] == "zip entry .env" and follow.ended


def test_a_bomb_is_refused_at_the_streams_bound() -> None:
    run = base64.b64encode(gzip.compress(b"\0" * 5_000_000, mtime=0))
    follow = FollowedRun(Allowance(len(run), floor=1_000_000))
    with pytest.raises(EncodingError):
        for at in range(0, len(run), 1000):
            follow.feed(run[at:at + 1000])


def test_what_may_go_on_is_what_the_next_output_giving_piece_decided() -> None:
    """`held(decided)`: a piece's bytes go once the files' bytes of the next piece that
    gave any are decided (a deflate symbol's bits may be read with the next bytes); a
    stretch of empty blocks giving nothing is held whole."""
    secret = b"S3CRET-" + bytes(random.Random(1).choice(b"abcdef") for _ in range(40))
    run = base64.b64encode(spaced_gzip(DATA, secret, DATA, 20_000))
    follow = FollowedRun(Allowance(0))
    outs = []
    for at in range(0, len(run), 4096):
        follow.feed(run[at:at + 4096])
        outs.append((follow.raw, follow.out))
    assert follow.held(0) == follow.raw  # (nothing decided: all of it)
    assert follow.held(follow.out) < 2 * 4096  # (all decided: the last piece or two)
    follow = FollowedRun(Allowance(0))
    held = []
    for at in range(0, len(run), 4096):
        follow.feed(run[at:at + 4096])
        held.append(follow.held(min(follow.out, len(DATA))))  # (the secret: undecided)
    gap = len(run) - len(base64.b64encode(spaced_gzip(DATA, secret, DATA, 0)))
    assert max(held) > gap  # (the empty blocks, and the secret's first half, held)


_RUN = base64.b64encode(PACKED)[:5000]


@pytest.mark.parametrize("at", [0, 1, 2])
def test_open_run_finds_a_zip_inside_a_run_from_its_group(at: int) -> None:
    """A run of other bytes, then a zip (an image that is also one): from the group of
    characters holding the zip's local header, whose bytes read from there hold it."""
    image = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4 + b"x" * at
    zipped = deflated_zip({".env": b"KEY=1\n"})
    run = base64.b64encode(image + zipped)
    start = open_run(b'"' + run.rstrip(b"="))  # (a run going on: no padding yet)
    assert start is not None and (start - 1) % 4 == 0 and start > 1000
    decoded = base64.b64decode(run[start - 1:])
    assert decoded.find(b"PK\x03\x04") == (len(image) % 3)
    follow = FollowedRun(Allowance(0))
    files = follow.feed(run[start - 1:]) + follow.end()
    assert b"".join(piece for _, _, piece in files) == b"KEY=1\n"
    assert open_run(b'"' + run[:len(run) // 2]) is None  # (no header in it yet)
    hexed = (image + zipped).hex().encode()
    assert open_run(b'"' + hexed) == 1 + 2 * len(image)


@pytest.mark.parametrize(("data", "since", "cut", "start"), [
    (b'{"content": "' + _RUN, 0, None, 13),  # (to the end: the stream may bring more)
    (b'{"content": "' + _RUN + b'"}', 0, None, None),  # (it ended)
    (b'{"content": "' + _RUN + b'"}', 0, 3000, 13),  # (past the cut)
    (b'{"content": "' + _RUN + b'"}', 0, 6000, None),
    (b'{"content": "' + _RUN, 100, None, None),  # (looked for before)
    (b'{"content": "' + _RUN.replace(b"/", b"\\/"), 0, None, 13),  # (PHP, Java: `\/`)
    (b'"' + base64.b64encode(b"\xfd7zXZ\x00" + bytes(30)).replace(b"/", b"\\/"), 0, None, 1),
    (b"notes\\n" + _RUN[:500] + b"\\n" + _RUN[500:1000], 0, None, 7),  # (after a break)
    (b"notes\r\n" + _RUN[:500] + b"\r\n", 0, None, 7),
    (b"fooH4sI" + _RUN[4:100], 0, None, None),  # (inside a word: no decoder reads it so)
    (b'"' + PACKED.hex().encode()[:400], 0, None, 1),
    # (a zstd file with a skippable frame first, as pzstd writes it, base64 and hex)
    (b'"' + base64.b64encode(b"\x50\x2a\x4d\x18\x04\0\0\0" + bytes(40)), 0, None, 1),
    (b'"' + base64.b64encode(b"\x5f\x2a\x4d\x18\x04\0\0\0" + bytes(40)), 0, None, 1),
    (b'"' + (b"\x53\x2a\x4d\x18" + bytes(40)).hex().upper().encode(), 0, None, 1),
    (b'"' + base64.b64encode(b"\x60\x2a\x4d\x18\x04\0\0\0" + bytes(40)), 0, None, None),
    (b'"' + _RUN[:100] + b"\\", 0, None, 1),  # (a break's first byte at the end)
    (b'"' + _RUN[:100] + b"\\u00", 0, None, None),
    (b'"' + base64.b64encode(b"just text, no compressed file")[:30], 0, None, None),
    (b"", 0, None, None),
])
def test_open_run_finds_where_a_compressed_files_run_goes_on(
        data: bytes, since: int, cut: int | None, start: int | None) -> None:
    assert open_run(data, since, cut) == start
