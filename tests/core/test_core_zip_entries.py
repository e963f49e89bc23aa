"""A zip's entries read wherever they are (`core/zip_entries.py`): every method and
layout a sandbox's upload may have (deflate, bzip2, LZMA, zstd, data descriptors, zip64
sizes), at any cut; and every zip a reader extracts that a walk of local headers from
the body's first byte misses: after other bytes (an image that is also a zip, a
self-extracting program), after junk between entries, after another zip, inside a
stored entry or a tar, with a local header whose method, sizes or flags differ from the
central directory's. Each is checked against Python's `zipfile` (and Info-ZIP's `unzip`
where it is installed): what they extract, the gateway reads. Overlapping entries past
`LIVE` and bombs are errors; a body of many headers costs little."""

from __future__ import annotations

import io
import random
import shutil
import struct
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
from backports.zstd import zipfile as zstd_zipfile

from gateway.core import archives
from gateway.core.encodings import EncodingError
from gateway.core.zip_entries import (
    LIVE,
    Sniffed,
    ZipEntries,
    entry_kinds,
    holds_files,
    unpacked_files,
)

KEY = b"GITHUB_TOKEN=ghp_bbI3N2G46G3G8hLwqoiCabcdefghij0123456789\n"
README = b"the model parses the rows\n" * 400


class _Unseekable(io.RawIOBase):
    """A file zipfile cannot seek back in: its entries get data descriptors."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.data += b
        return len(b)


def _zip(method: int = zipfile.ZIP_DEFLATED, *, seekable: bool = True,
         zip64: bool = False, files: dict[str, bytes] | None = None) -> bytes:
    out: io.BytesIO | _Unseekable = io.BytesIO() if seekable else _Unseekable()
    # (zstd, method 93: Python 3.14's zipfile, here its backport's)
    maker = zstd_zipfile.ZipFile if method == zstd_zipfile.ZIP_ZSTANDARD else zipfile.ZipFile
    with maker(out, "w", method) as archive:
        for name, data in (files if files is not None else {"README": README}).items():
            archive.writestr(name, data)
        with archive.open(".env", "w", force_zip64=zip64) as entry:
            entry.write(KEY)
    return bytes(out.getvalue() if isinstance(out, io.BytesIO) else out.data)


METHODS = {
    "deflate": _zip(),
    "bzip2": _zip(zipfile.ZIP_BZIP2),
    "lzma": _zip(zipfile.ZIP_LZMA),
    "data descriptors": _zip(seekable=False),
    "zip64 sizes": _zip(zip64=True),
    "zstd": _zip(zstd_zipfile.ZIP_ZSTANDARD),  # (its .env entry: the key as it is)
}


def _read(body: bytes, step: int) -> dict[str, bytes]:
    """What the entries give, by name, the body fed in pieces of `step`."""
    sniffed, out = Sniffed(), {}
    for at in range(0, len(body), step):
        for number, piece in sniffed.feed(body[at:at + step]):
            out[sniffed.name(number)] = out.get(sniffed.name(number), b"") + piece
    for number, piece in sniffed.feed(b"", final=True):
        out[sniffed.name(number)] = out.get(sniffed.name(number), b"") + piece
    return out


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("step", [1, 3, 4096, 1 << 20])
def test_every_method_is_read_at_any_cut(name: str, step: int) -> None:
    body = METHODS[name]
    assert KEY not in body or name == "zstd"
    files = _read(body, step)
    assert set(files) == {"zip entry README", "zip entry .env"}, files
    assert KEY in files["zip entry .env"] and README in files["zip entry README"]


def _shifted(body: bytes, at: int, insert: bytes) -> bytes:
    """`body` (a zip) with `insert` put at `at`, its central directory's offsets moved
    to match (as a tool appending or prefixing bytes rewrites them, or not)."""
    out = bytearray(body[:at] + insert + body[at:])
    end = out.rfind(b"PK\x05\x06")
    directory = struct.unpack_from("<I", out, end + 16)[0]
    if directory >= at:
        directory += len(insert)
        struct.pack_into("<I", out, end + 16, directory)
    while out[directory:directory + 4] == b"PK\x01\x02":
        offset = struct.unpack_from("<I", out, directory + 42)[0]
        if offset >= at:
            struct.pack_into("<I", out, directory + 42, offset + len(insert))
        sizes = struct.unpack_from("<HHH", out, directory + 28)
        directory += 46 + sum(sizes)
    return bytes(out)


def _second_entry(body: bytes) -> int:
    return zipfile.ZipFile(io.BytesIO(body)).infolist()[1].header_offset


def _lied(body: bytes, field: str) -> bytes:
    """The .env entry's local header saying what its central directory does not."""
    out = bytearray(body)
    at = _second_entry(body)
    if field == "method":
        struct.pack_into("<H", out, at + 8, 0)  # (stored)
    elif field == "sizes":
        struct.pack_into("<II", out, at + 18, 1, 1)
    elif field == "encrypted":
        struct.pack_into("<H", out, at + 6, 1)
    return bytes(out)


def _inside_stored() -> bytes:
    """A zip whose stored entry's bytes hold another entry (local header and deflated
    data), which the central directory lists too: unzip extracts both."""
    inner = _zip(files={})
    header = inner[:zipfile.ZipFile(io.BytesIO(inner)).infolist()[0].header_offset +
                   len(inner)]  # (the .env entry, its directory after)
    outer = io.BytesIO()
    with zipfile.ZipFile(outer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("cover.bin", b"\0" * 64 + header)
    body = outer.getvalue()
    data = body.find(header)
    # (the outer directory given a second record: the inner entry's, at its place)
    record = bytearray(inner[inner.find(b"PK\x01\x02"):inner.find(b"PK\x05\x06")])
    struct.pack_into("<I", record, 42, data)
    end = body.rfind(b"PK\x05\x06")
    start = struct.unpack_from("<I", body, end + 16)[0]
    directory = bytes(body[start:end]) + bytes(record)
    tail = bytearray(body[end:])
    struct.pack_into("<HHI", tail, 8, 2, 2, len(directory))
    return body[:start] + directory + bytes(tail)


def _in_tar() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("dist/app.zip")
        body = _zip()
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    return raw.getvalue()


HIDDEN = {
    "after an image's bytes": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8 + _zip(),
    "after a program's bytes, offsets moved": _shifted(_zip(), 0, b"\x7fELF" + b"\0" * 900),
    "after junk between entries": _shifted(_zip(), _second_entry(_zip()), b"JUNK" * 50),
    "after another zip": _zip(files={"a": b"x"}) + _zip(),
    "a method the local header does not say": _lied(_zip(), "method"),
    "sizes the local header does not say": _lied(_zip(), "sizes"),
    "an encryption the local header says falsely": _lied(_zip(), "encrypted"),
    "inside a stored entry": _inside_stored(),
}


def _extracted(body: bytes, tmp: Path) -> list[bytes]:
    """What Python's zipfile and Info-ZIP's unzip (where installed) extract of .env (they
    differ: unzip goes by a local header's method and sizes, zipfile by the central
    directory's)."""
    out = []
    try:
        out.append(zipfile.ZipFile(io.BytesIO(body)).read(".env"))
    except (zipfile.BadZipFile, KeyError, OSError, EOFError):
        out.append(b"")
    if shutil.which("unzip"):
        path = tmp / "body.zip"
        path.write_bytes(body)
        out.append(subprocess.run(["unzip", "-p", str(path), ".env"], capture_output=True,
                                  timeout=30, check=False).stdout)
    return out


@pytest.mark.parametrize("name", list(HIDDEN))
def test_what_a_reader_extracts_wherever_it_is_is_read(name: str, tmp_path: Path) -> None:
    body = HIDDEN[name]
    assert KEY not in body and KEY in _extracted(body, tmp_path)
    assert holds_files(body)
    for step in (1, 7, 4096, 1 << 20):
        files = _read(body, step)
        assert KEY in files.get("zip entry .env", b""), (step, list(files))


def test_a_zip_in_a_tar_is_read() -> None:
    """A plain tar is its files' bytes: a zip in it is read as any zip after other
    bytes (a `.jar` in a build's tarball)."""
    body = _in_tar()
    assert KEY not in body
    assert KEY in b"".join(data for _, data in unpacked_files(body))


@pytest.mark.skipif(not shutil.which("zip"), reason="Info-ZIP's zip is not installed")
def test_an_encrypted_entry_gives_nothing_and_the_others_are_read(tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_bytes(KEY)
    (tmp_path / "README").write_bytes(README)
    subprocess.run(["zip", "-q", "-P", "pw", "-j", str(tmp_path / "e.zip"),
                    str(tmp_path / "secret.txt")], check=True, timeout=30)
    subprocess.run(["zip", "-q", "-j", str(tmp_path / "e.zip"), str(tmp_path / "README")],
                   check=True, timeout=30)
    files = _read((tmp_path / "e.zip").read_bytes(), 4096)
    assert KEY not in b"".join(files.values())
    assert README in files["zip entry README"]


def test_a_stored_entry_is_the_bodys_own_bytes() -> None:
    body = _zip(zipfile.ZIP_STORED)
    assert KEY in body and KEY not in b"".join(_read(body, 5).values())


def test_an_lzma_entry_asking_for_a_huge_dictionary_is_not_decoded() -> None:
    """A zip's LZMA entry says its dictionary's size, which its decoder allocates whole:
    one over the bound (4 GiB here) is never allocated, and the entries after it are
    read."""
    body = bytearray(_zip(zipfile.ZIP_LZMA))
    data = 30 + len("README") + struct.unpack_from("<H", body, 28)[0]
    assert body[data + 2:data + 4] == b"\x05\x00"  # (5 bytes of properties)
    body[data + 5:data + 9] = b"\xff\xff\xff\xff"
    files = _read(bytes(body), 4096)
    assert README not in files.get("zip entry README", b"") and KEY in files["zip entry .env"]


def _nested(depth: int) -> bytes:
    """`depth` local headers, each followed by a deflate stored block that holds the
    rest: every entry's stream goes on past the next header."""
    body = b"tail" * 100
    for number in range(depth):
        name = b"n%d" % number
        block = b"\x00" + struct.pack("<HH", 0xFFFF, 0x0000)  # (a stored block, 65,535)
        body = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0, 0, 0, 0,
                           len(name), 0) + name + block + body
    return body


def test_entries_inside_one_another_past_live_are_refused() -> None:
    assert len(_read(_nested(LIVE), 4096)) == LIVE
    with pytest.raises(EncodingError, match=f"more than {LIVE} entries"):
        _read(_nested(LIVE + 1), 4096)


def test_a_body_of_headers_costs_little() -> None:
    """A body of nothing but local headers (each entry's data the next header): each
    new entry's stream is given `_FIRST` bytes first and dies in them, not the rest of
    the piece each (which would be quadratic)."""
    header = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0, 0, 0, 0, 0, 0)
    body = header * (1 << 20 // len(header))
    started = time.process_time()
    assert unpacked_files(body) == []
    assert time.process_time() - started < 5


def test_entries_share_one_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archives, "FLOOR", 100_000)
    body = _zip(files={f"f{n}": b"\0" * 90_000 for n in range(4)})
    assert len(body) * archives.RATIO + 100_000 < 360_000
    with pytest.raises(EncodingError, match="more than 64 times"):
        unpacked_files(body)
    unpacked_files(_zip(files={"f": b"\0" * 90_000}))  # (within it)


def test_cuts_anywhere_give_the_same_entries() -> None:
    body = HIDDEN["after junk between entries"] + b"more" + HIDDEN["inside a stored entry"]
    whole = _read(body, len(body))
    rng = random.Random(7)
    for _ in range(60):
        sniffed, out, at = Sniffed(), {}, 0
        while at < len(body):
            step = rng.choice([1, 2, 3, 4, 5, 31, 64, 1000])
            for number, piece in sniffed.feed(body[at:at + step]):
                out[sniffed.name(number)] = out.get(sniffed.name(number), b"") + piece
            at += step
        for number, piece in sniffed.feed(b"", final=True):
            out[sniffed.name(number)] = out.get(sniffed.name(number), b"") + piece
        assert out == whole


@pytest.mark.parametrize(("pieces", "skipped"), [
    ([b"plain text", b" and more"], [True, True]),
    ([b"some PK\x03", b"\x04 after"], [True, False]),  # (a signature across the cut)
    ([b"PK", b"\x03\x04"], [True, False]),
    ([b"x", b"P", b"K\x03\x04"], [True, True, False]),
    ([b"abc PK\x03\x04 header"], [False]),
])
def test_skips_takes_only_pieces_that_add_nothing(pieces: list[bytes],
                                                  skipped: list[bool]) -> None:
    entries = ZipEntries()
    for piece, skips in zip(pieces, skipped, strict=True):
        assert entries.skips(piece) is skips
        if not skips:
            return


def test_a_body_read_by_skips_and_feed_alike() -> None:
    body = b"prefix " * 5000 + _zip() + b" suffix" * 5000
    rng = random.Random(3)
    sniffed, out, at = Sniffed(), b"", 0
    while at < len(body):
        step = rng.randint(1, 9000)
        piece = body[at:at + step]
        if not sniffed.skips(piece):
            out += b"".join(data for _, data in sniffed.feed(piece))
        at += step
    out += b"".join(data for _, data in sniffed.feed(b"", final=True))
    assert KEY in out and README in out


@pytest.mark.parametrize(("data", "kinds"), [
    (b"\x78\x9c\x01\x02\x03\x04", ("deflate",)),
    (b"BZh91AY", ("deflate", "bzip2")),
    (b"\x28\xb5\x2f\xfd\x04\0", ("deflate", "zstd")),
    (b"\xfd7zXZ\0", ("deflate", "xz")),
    (b"\x09\x14\x05\x00\x5d\x00", ("deflate", "lzma")),
    (b"PK\x03\x04\x14\0", ("deflate",)),
    (b"", ("deflate",)),
])
def test_an_entrys_data_is_read_as_what_it_starts_as(data: bytes, kinds: tuple[str, ...]
                                                     ) -> None:
    assert entry_kinds(data) == kinds


@pytest.mark.parametrize(("body", "holds"), [
    (b'{"model": "m"}', False), (b"PK\x05\x06" + b"\0" * 18, False),
    (b"\x1f\x8b\x08\0\0\0", True), (b"text then PK\x03\x04", True), (b"PK\x03\x04", True),
])
def test_holds_files(body: bytes, holds: bool) -> None:
    assert holds_files(body) is holds


@pytest.mark.parametrize("first", ["gateway.core.zip_entries", "gateway.core.streamed_runs",
                                   "gateway.core.archives", "gateway.core.dlp"])
def test_the_c_search_is_bound_whichever_module_a_process_imports_first(first: str) -> None:
    """Importing the C module imports gateway.core.dlp, whose scanners import
    `zip_entries`: bound at the first search, never taken for "not built" because of
    that cycle (a process that imported `streamed_runs` first searched with
    `bytes.find`, 0.5-0.9 ms a MiB, in the first cut)."""
    import importlib.util
    import sys

    if importlib.util.find_spec("gateway.core.dlp._gate") is None:
        pytest.skip("_gate.c not built")
    done = subprocess.run(
        [sys.executable, "-c", f"import {first}\nimport gateway.core.zip_entries as z\n"
         "assert z.local_header(b'xPK\\x03\\x04') == 1\nprint(type(z._SEARCH[0]).__name__)"],
        capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "builtin_function_or_method", done.stderr


def test_streams_that_give_nothing_are_charged_to_the_sandbox() -> None:
    """A body of nothing but local headers (each entry's stream, tried, decodes to
    nothing: ~15 µs each, 0.6 s a MiB) is charged `_TRIED` bytes an entry past `AMPLE`
    times its bytes to its sandbox's unpacking budget, and refused once that is spent;
    a zip of stored files of 1.5 KB is not charged (of 64 bytes it is: 4 KiB an entry
    past 16 times its ~160 bytes)."""
    from gateway.core.unpack_bounds import Excess, ExcessError, charge_to

    header = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0, 0, 0, 0, 0, 0)
    crafted = header * ((1 << 20) // len(header))
    stored = io.BytesIO()
    with zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as archive:
        for n in range(300):
            archive.writestr(f"res/{n}.txt", b"value %05d\n" % n * 128)
    excess = Excess(64 << 20, 1)
    charge_to(excess)
    try:
        unpacked_files(stored.getvalue())
        assert excess.left == 64 << 20
        sniffed, fed, step = Sniffed(), 0, 1 << 16
        with pytest.raises(ExcessError, match="this sandbox's compressed data"):
            for fed in range(0, len(crafted), step):
                sniffed.feed(crafted[fed:fed + step], final=False)
        assert fed < len(crafted) * 3 // 4  # (refused before its end: ~0.4 s, not 0.6)
    finally:
        charge_to(None)
