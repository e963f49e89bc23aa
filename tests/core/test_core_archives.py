"""A body that is a compressed file, unpacked (`core/archives.py`): every format a
sandbox's upload may be (gzip with several members, a tar inside, bzip2, xz, zstd), at
any cut of the body; what stops being the format stops the reading (as gunzip stops); a
bomb is an error. A zip's entries: tests/core/test_core_zip_entries.py."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import random
import tarfile

import pytest
from backports import zstd

from gateway.core import archives
from gateway.core.archives import FIRST_BYTES, Undecided, Unpacker, archive_kind
from gateway.core.encodings import EncodingError

KEY = b"GITHUB_TOKEN=ghp_bbI3N2G46G3G8hLwqoiCabcdefghij0123456789\n"
README = b"the model parses the rows\n" * 400
# (prose of a few letters: a zstd frame codes its literals, the key's too, with Huffman
# codes; a short key alone is stored as it is in the frame)
NOTES = bytes(random.Random(1).choices(b"etaoin shrdlu", k=4000))


def _tar_gz() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in (("README", README), (".env", KEY)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


FORMATS = {
    "gzip": gzip.compress(KEY, mtime=0),
    "gzip, two members": gzip.compress(README, mtime=0) + gzip.compress(KEY, mtime=0),
    "tar.gz": _tar_gz(),
    "bzip2, two streams": bz2.compress(README) + bz2.compress(KEY),
    "xz": lzma.compress(README + KEY),
    "zstd": zstd.compress(NOTES + KEY),
    # (frames one after another, a skippable frame among them: `zstd -d` reads them all)
    "zstd, frames": zstd.compress(README) + b"\x50\x2a\x4d\x18\x02\0\0\0hi" +
    zstd.compress(NOTES + KEY),
    # (pzstd's: a skippable frame first, read past by `zstd -d`; not taken for zstd
    # before the twenty-second session)
    "zstd, a skippable frame first": b"\x5e\x2a\x4d\x18\x05\0\0\0hello" +
    zstd.compress(NOTES + KEY),
    "tar.zst": zstd.compress(NOTES + gzip.decompress(_tar_gz())),
}


def _unpack(body: bytes, step: int) -> list[tuple[str, bytes]]:
    unpacker = Unpacker(archive_kind(body[:6]) or "")
    return [file for at in range(0, len(body), step) for file in unpacker.feed(
        body[at:at + step])]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("step", [1, 3, 4096, 1 << 20])
def test_every_format_is_unpacked_at_any_cut(name: str, step: int) -> None:
    body = FORMATS[name]
    assert KEY not in body and body[0] in FIRST_BYTES
    files = _unpack(body, step)
    assert KEY in b"".join(data for _, data in files), files


@pytest.mark.parametrize("body", [
    gzip.compress(KEY, mtime=0) + b"trailing garbage",  # (gunzip: warns, keeps the file)
    # (a wrong CRC or length: gunzip has written the file when it finds it out)
    gzip.compress(README + KEY, mtime=0)[:-8] + b"\0" * 8,
])
@pytest.mark.parametrize("step", [1, 1 << 20])
def test_what_stops_being_the_format_stops_the_reading_not_before(body: bytes,
                                                                   step: int) -> None:
    """What decoded before bytes that are not the format is read, whether the bad bytes
    came in the same piece or later (a failing call of zlib's gives nothing: the
    decoded part is found again on copies of the stream)."""
    assert KEY in b"".join(d for _, d in _unpack(body, step))


def test_a_bomb_is_refused_as_it_unpacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archives, "FLOOR", 10_000)
    bomb = gzip.compress(b"\0" * 5_000_000, mtime=0)
    assert len(bomb) < 10_000
    with pytest.raises(EncodingError, match="more than 64 times"):
        _unpack(bomb, 4096)
    _unpack(gzip.compress(b"\0" * 9_000, mtime=0), 1)  # (within the floor)


@pytest.mark.parametrize(("head", "kind"), [
    (b"\x1f\x8b\x08\0\0\0", "gzip"), (b"BZh91AY", "bzip2"), (b"\xfd7zXZ\0", "xz"),
    (b"PK\x03\x04\x14\0", "zip"), (b"PK\x05\x06\0\0", None),  # (an empty zip: nothing)
    (b"\x28\xb5\x2f\xfd\x04\0", "zstd"), (b"\x50\x2a\x4d\x18\x04\0", "zstd"),
    (b"\x5f\x2a\x4d\x18\0\0", "zstd"), (b"\x60\x2a\x4d\x18\0\0", None),
    (b"\x50\x2a\x4d\x19\0\0", None), (b"[1, 2]", None), (b"P", None),
    (b"\x1f\x8b\x09", None), (b'{"a": 1}', None), (b"", None)])
def test_what_a_body_is_is_said_by_its_first_bytes(head: bytes, kind: str | None) -> None:
    assert archive_kind(head) == kind


def test_unpacker_names_a_compressed_files_pieces_with_no_name() -> None:
    assert Unpacker("gzip").feed(gzip.compress(KEY, mtime=0)) == [("", KEY)]


def test_a_kind_that_is_no_stream_is_an_error() -> None:
    """A zip is not one stream (`zip_entries.ZipEntries` reads its entries)."""
    with pytest.raises(ValueError, match="zip_entries"):
        Unpacker("zip")


# Each step: ("fed", raw, gave) or ("settle",), then the held bytes asked with `decided`.
_UNDECIDED = {
    "nothing decided holds all": ([("fed", 100, 50), ("fed", 100, 50)], 0, 200),
    # (a piece's bytes go once the next piece that gave any is decided)
    "the first piece goes with the second's bytes read": (
        [("fed", 100, 50), ("fed", 100, 50)], 100, 100),
    "its own output read is not enough": ([("fed", 100, 50), ("fed", 100, 50)], 99, 200),
    # (pieces giving nothing are held with the one before them)
    "empty pieces are held": (
        [("fed", 100, 50), ("fed", 500, 0), ("fed", 100, 50)], 100, 600),
    "a settled stream goes once what it gave is read": (
        [("fed", 100, 50), ("fed", 100, 0), ("settle",)], 50, 0),
    "a settled stream waits for what it gave": (
        [("fed", 100, 50), ("fed", 100, 0), ("settle",)], 49, 200),
    "bytes after a settle that give nothing go on": (
        [("fed", 100, 50), ("settle",), ("fed", 300, 0), ("settle",)], 50, 0),
}


@pytest.mark.parametrize("case", _UNDECIDED)
def test_undecided_holds_what_the_next_giving_piece_has_not_decided(case: str) -> None:
    steps, decided, held = _UNDECIDED[case]
    undecided = Undecided()
    for step in steps:
        if step[0] == "fed":
            undecided.fed(step[1], step[2])
        else:
            undecided.settle()
    assert undecided.held(decided) == held


def test_undecided_settles_in_one_mark_however_often() -> None:
    undecided = Undecided()
    for _ in range(10_000):
        undecided.fed(10, 0)
        undecided.settle()
    assert len(undecided._marks) == 1 and undecided.held(0) == 0
