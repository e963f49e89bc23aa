"""A held body that is an archive, read unpacked too (`core/dlp/archive_views.py`): a
credential in a file of a `.tar.gz` or a `.zip` is found where it is (`body zip entry
.env`), beside the body's own bytes; an archive in an archive's file is not unpacked
again (a bomb's bound is of the body); a bomb is unreadable."""

from __future__ import annotations

import base64
import gzip
import io
import json
import random
import zipfile

import pytest
from helpers.archives import deflated_zip
from helpers.dlp_corpus import fake

from gateway.core import archives
from gateway.core.dlp import DEFAULT, Scanner, StreamScanner
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")



def _where(body: bytes, ctype: str = "application/octet-stream") -> list[str]:
    return [str(f.location) for f in SCANNER.scan_body(body, ctype).findings]


def test_a_credential_in_an_archives_file_is_found_where_it_is() -> None:
    key = fake("github").text.encode()
    env = b"GITHUB_TOKEN=" + key + b"\n"
    assert _where(gzip.compress(env, mtime=0), "application/gzip") == [
        "body gzip file (in archive)"]
    assert _where(deflated_zip({"README": b"notes\n", ".env": env})) == [
        "body zip entry .env (in archive)"]
    # (stored: the body's own bytes hold it)
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(".env", env)
    assert [w.startswith("body at offset") for w in _where(raw.getvalue())] == [True]
    assert _where(deflated_zip({"README": b"def main():\n    return 0\n"})) == []


def test_an_archive_in_an_archives_file_is_not_unpacked_again() -> None:
    env = b"GITHUB_TOKEN=" + fake("github").text.encode() + b"\n"
    inner = deflated_zip({".env": env})
    assert _where(deflated_zip({"inner.zip": inner})) == []  # (one level: see the module)
    assert _where(gzip.compress(deflated_zip({".env": env}), mtime=0)) == []


def test_a_bomb_is_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archives, "FLOOR", 10_000)
    result = SCANNER.scan_body(gzip.compress(b"\0" * 2_000_000, mtime=0))
    assert result.unreadable is not None and "64 times" in result.unreadable


@pytest.mark.parametrize("at", [0, 1, 2])
def test_a_credential_in_an_image_that_is_also_a_zip_in_a_json_string_is_found(
        at: int) -> None:
    """A file sent in a JSON string (GitHub's contents API) that is an image and a zip
    (unzip reads it): its zip's entries, wherever the zip's header falls in a base64
    group, held whole and streamed as a run 1.5 MB long before the zip."""
    env = b"GITHUB_TOKEN=" + fake("github").text.encode() + b"\n"
    for size in (1000 + at, 1_500_000 + at):
        image = b"\x89PNG\r\n\x1a\n" + random.Random(size).randbytes(size)
        packed = image + deflated_zip({"README": b"notes\n", ".env": env})
        body = json.dumps({"message": "add", "content": base64.b64encode(packed).decode()})
        if size < 10_000:
            assert _where(body.encode(), "application/json") == [
                "body $.content zip entry .env (in base64, archive)"]
        stream, found = StreamScanner(SCANNER, content_type="application/json"), []
        for i in range(0, len(body), 65_536):
            found += stream.feed(body[i:i + 65_536].encode()).findings
        found += stream.end().findings
        assert [f.detector for f in found] == ["github"], (at, size)
        assert "zip entry .env" in str(found[0].location)
