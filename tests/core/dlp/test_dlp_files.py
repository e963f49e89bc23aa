"""The files a streamed request body holds (`core/dlp/files.py`), and the stream scanner
reading them (`StreamScanner(unpack=True)`): a body, or a multipart body's part, that is
a compressed file or holds a zip's entries is unpacked as it comes, each file by a
scanner of its own, at any cut; a body that holds none costs one search a piece
(`skips`); answers are not unpacked."""

from __future__ import annotations

import gzip
import random
from typing import Any

import pytest
from helpers.archives import deflated_zip, tar_gz
from helpers.dlp_corpus import fake

from gateway.core import archives
from gateway.core.dlp import DEFAULT, Scanner, StreamScanner
from gateway.core.dlp import stream as stream_module
from gateway.core.dlp.files import Files
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")
ENV = b"GITHUB_TOKEN=" + fake("github").text.encode() + b"\n"
MULTIPART = "multipart/form-data; boundary=XyZ123"




def _form(*parts: tuple[str, bytes]) -> bytes:
    """A multipart form (an S3 presigned POST's shape): its fields, then the file."""
    return b"".join(b"--XyZ123\r\nContent-Disposition: form-data; name=\"" + name.encode() +
                    b"\"\r\n\r\n" + data + b"\r\n" for name, data in parts) + b"--XyZ123--\r\n"


def _read(body: bytes, step: int, ctype: str | None = None,
          unpack: bool = True) -> tuple[list[str], str | None, int]:
    stream, found, held = StreamScanner(SCANNER, content_type=ctype, unpack=unpack), [], 0
    for at in range(0, len(body), step):
        result = stream.feed(body[at:at + step])
        found += [str(f.location) for f in result.findings]
        held = max(held, stream.pending)
        if result.unreadable:
            return found, result.unreadable, held
    result = stream.end()
    return found + [str(f.location) for f in result.findings], result.unreadable, held


_RNG = random.Random(7)
README = "".join(_RNG.choice("abcdefghij klmnop") for _ in range(300_000)).encode()


@pytest.mark.parametrize("step", [1, 4096, 65536])
def test_a_credential_in_a_streamed_tarballs_file_is_found_at_any_cut(step: int) -> None:
    body = tar_gz({".env": ENV} if step == 1 else {"README": README, ".env": ENV})
    found, unreadable, held = _read(body, step)
    assert unreadable is None and len(found) == 1, found
    assert found[0].startswith("body unpacked at offset")
    assert held < 200_000
    assert _read(tar_gz({"README": README}), step)[:2] == ([], None)


@pytest.mark.parametrize("step", [1, 4096, 65536])
def test_a_credential_in_a_multipart_forms_zip_part_is_found_at_any_cut(step: int) -> None:
    """An upload form (S3's presigned POST is one) with the archive its last part: the
    part is unpacked alone (the fields before it are not an archive), at any cut."""
    files = {".env": ENV} if step == 1 else {"README": README, ".env": ENV}
    body = _form(("key", b"uploads/ws.zip"), ("file", deflated_zip(files)))
    found, unreadable, _ = _read(body, step, MULTIPART)
    assert unreadable is None and len(found) == 1, found
    assert found[0].startswith("body part 2 unpacked at offset")
    clean = _form(("key", b"uploads/ws.zip"), ("file", deflated_zip({"README": README})))
    assert _read(clean, step, MULTIPART)[:2] == ([], None)


def test_an_archive_whose_first_bytes_come_alone_is_still_unpacked() -> None:
    """A sender that cuts its body after two bytes (`\x1f\x8b`, then the rest): the
    look at the first byte is of the body's first, not of the second piece's."""
    body = tar_gz({".env": ENV})
    files = Files(None)
    got = files.feed(body[:2]) + files.feed(body[2:]) + files.feed(b"", final=True)
    assert ENV in b"".join(piece for _, piece in got)
    assert [w.split(" at ")[0] for w in _read(body, 2)[0]] == ["body unpacked"]


def test_answers_and_bodies_that_are_no_archive_are_not_unpacked() -> None:
    body = tar_gz({".env": ENV})
    assert _read(body, 4096, unpack=False)[0] == []  # (an answer: a download)
    files = Files(None)
    assert files.feed(b'{"model": "m", "messages": []}') == [] and not files.reading
    assert files.skips(b'"more": 1}')
    later = Files(None)  # (a compressed file after other bytes: gunzip reads none)
    assert later.feed(b"notes: ") == [] and later.feed(body) == []


def test_a_zip_after_other_bytes_is_read_as_unzip_reads_it() -> None:
    """An image that is also a zip (unzip extracts what follows the image's bytes):
    its entries are read, by a scanner each, at any cut."""
    body = b"\x89PNG\r\n\x1a\n" + README[:5000] + deflated_zip({"README": README, ".env": ENV})
    for step in (1, 4096, 65536):
        found, unreadable, _ = _read(body, step, "image/png")
        assert unreadable is None and len(found) == 1, found
        assert found[0].startswith("body unpacked at offset")


def test_a_zips_many_entries_are_read_by_one_scanner_not_one_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries one after another share a number (`ZipEntries(slots=True)`): a zip of a
    workspace's 2,000 files makes a scanner a piece at most, not 2,000, and the key in
    its last file is found."""
    made = []

    class Counted(StreamScanner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)

    files = {f"src/f{n}.py": b"print(%d)\n" % n * 20 for n in range(2000)} | {".env": ENV}
    body = deflated_zip(files)
    stream, found = StreamScanner(SCANNER, unpack=True), []
    monkeypatch.setattr(stream_module, "StreamScanner", Counted)
    pieces = range(0, len(body), 16384)
    for at in pieces:
        found += stream.feed(body[at:at + 16384]).findings
    found += stream.end().findings
    assert [str(f.location).split(" at ")[0] for f in found] == ["body unpacked"]
    assert len(made) <= len(pieces) + 1 < 2000


def test_a_streamed_bomb_is_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archives, "FLOOR", 100_000)
    bomb = gzip.compress(b"\0" * 20_000_000, mtime=0)
    for body, ctype in ((bomb, None), (_form(("file", bomb)), MULTIPART)):
        _, unreadable, _ = _read(body, 65536, ctype)
        assert unreadable is not None and "64 times" in unreadable, ctype


def test_a_multipart_parts_coded_head_is_still_unreadable_when_unpacking() -> None:
    body = (b"--XyZ123\r\nContent-Disposition: form-data; name=\"f\"\r\n"
            b"Content-Encoding: gzip\r\n\r\n" + gzip.compress(ENV) + b"\r\n--XyZ123--\r\n")
    assert "content coding" in (_read(body, 7, MULTIPART)[1] or "")


def test_an_archive_parts_files_are_read_when_it_ends_not_at_the_bodys_end() -> None:
    """An upload form's gzip part, then 3 MB of a plain part: the part's file is read
    to its end when the part ends (before the twenty-first session, at the next
    archive's or the body's end: its last window was read after the plain part had
    pushed the part's bytes out of what is held back, so the key's compressed bytes
    went on first); what may go on is never past the part while it is undecided."""
    packed = gzip.compress(README[:100_000] + b"\n" + ENV, mtime=0)
    body = _form(("file", packed), ("notes", b"plain words " * 250_000))
    stream = StreamScanner(SCANNER, content_type=MULTIPART, unpack=True)
    sent, end = 0, body.index(packed) + len(packed)
    for at in range(0, len(body), 4096):
        result = stream.feed(body[at:at + 4096])
        if result.findings:
            break
        sent = max(sent, at + 4096 - stream.pending)
    assert result.findings and sent < end - 40 and at < end + 4096
    assert str(result.findings[0].location).startswith("body part 1 unpacked")


def test_files_say_which_part_is_being_unpacked_and_what_may_go_on() -> None:
    files = Files(b"XyZ123")
    body = _form(("a", gzip.compress(README, mtime=0)), ("b", b"x" * 10_000))
    first = body.index(b"\x1f\x8b")
    files.feed(body[:first + 2000])
    assert files.live() == {(1, 0)} and files.undecided.held(0) == files.undecided.raw
    files.feed(body[first + 2000:])
    assert files.live() == set()
    assert files.undecided.held(files.undecided.out) == 0  # (all decided: all may go)
