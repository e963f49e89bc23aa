"""A streamed body that is an archive (`core/dlp/archive_stream.py`): its files read
as they unpack, at any cut, by a stream scanner of their own; a body that is none costs
one look at its first bytes."""

from __future__ import annotations

import gzip
import io
import random
import tarfile

import pytest
from helpers.dlp_corpus import fake

from gateway.core import archives
from gateway.core.dlp import DEFAULT, Scanner
from gateway.core.dlp.archive_stream import ArchiveStream
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")


def _tar_gz(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def _read(body: bytes, step: int) -> tuple[list[str], str | None, int]:
    stream, found, held = ArchiveStream(SCANNER), [], 0
    for at in range(0, len(body), step):
        result = stream.feed(body[at:at + step])
        found += [str(f.location) for f in result.findings]
        held = max(held, stream.pending)
        if result.unreadable:
            return found, result.unreadable, held
    result = stream.end()
    return found + [str(f.location) for f in result.findings], result.unreadable, held


@pytest.mark.parametrize("step", [1, 4096, 65536])
def test_a_credential_in_a_streamed_tarballs_file_is_found_at_any_cut(step: int) -> None:
    rng = random.Random(7)
    readme = "".join(rng.choice("abcdefghij klmnop") for _ in range(300_000)).encode()
    key = fake("github").text.encode()
    body = _tar_gz({"README": readme, ".env": b"GITHUB_TOKEN=" + key + b"\n"})
    if step == 1:
        body = _tar_gz({".env": b"GITHUB_TOKEN=" + key + b"\n"})
    found, unreadable, held = _read(body, step)
    assert unreadable is None and len(found) == 1 and found[0].startswith(
        "body unpacked at offset"), found
    assert held < 200_000
    assert _read(_tar_gz({"README": readme}), step)[:2] == ([], None)


def test_a_body_that_is_no_archive_is_not_unpacked() -> None:
    stream = ArchiveStream(SCANNER)
    assert stream.feed(b'{"model": "m", "messages": []}').findings == ()
    assert stream.feed(gzip.compress(b"GITHUB_TOKEN=" + fake("github").text.encode(),
                                     mtime=0)).findings == ()  # (not its first bytes)
    assert stream.end().findings == () and stream.pending == 0


def test_a_streamed_bomb_is_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archives, "FLOOR", 100_000)
    _, unreadable, _ = _read(gzip.compress(b"\0" * 20_000_000, mtime=0), 65536)
    assert unreadable is not None and "64 times" in unreadable
