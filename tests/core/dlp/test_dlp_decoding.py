"""Bodies decoded as the receiver reads them, bounded by the hold limit: stacked codings,
zstd, bombs and corrupt bodies are `Unreadable` (the caller fails closed); base64 and
hex runs found and decoded."""

from __future__ import annotations

import base64
import codecs
import gzip
import json
import zlib
from collections.abc import Callable

import brotli
import pytest
import zstandard
from helpers.dlp_corpus import fake

from gateway.core.dlp import DEFAULT, Scanner, Unreadable
from gateway.core.dlp.decoding import (
    decode_content,
    decode_run,
    encode_content,
    json_codec,
    runs,
    text_codec,
)
from gateway.services.dlp.library import build

DATA = b"hello " * 1000
ENCODERS = {"gzip": gzip.compress, "deflate": zlib.compress, "br": brotli.compress,
            "zstd": zstandard.ZstdCompressor().compress,
            "raw-deflate": lambda d: zlib.compress(d)[2:-4]}


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate", "br", "zstd", "gzip, br",
                                    "zstd, gzip", "br, zstd, deflate", "identity, gzip"])
def test_codings_and_their_stacks_round_trip(coding: str) -> None:
    encoded = encode_content(DATA, coding)
    assert encoded != DATA
    assert decode_content(encoded, coding, 1 << 20) == DATA


def test_raw_deflate_as_browsers_send_it() -> None:
    assert decode_content(ENCODERS["raw-deflate"](DATA), "deflate", 1 << 20) == DATA


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "zstd"])
def test_a_bomb_stops_at_the_limit(coding: str) -> None:
    bomb = ENCODERS[coding](b"\0" * (64 << 20))
    assert len(bomb) < 200_000
    with pytest.raises(Unreadable, match="more than"):
        decode_content(bomb, coding, 1 << 20)


def test_a_zstd_bomb_in_many_frames_stops_at_the_limit() -> None:
    frame = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    with pytest.raises(Unreadable, match="more than"):
        decode_content(frame * 3, "zstd", (2 << 20) + 5)
    assert len(decode_content(frame * 2, "zstd", 2 << 20)) == 2 << 20  # all frames read


@pytest.mark.parametrize(("body", "coding", "why"), [
    (b"not gzip", "gzip", "not valid gzip"), (b"not br", "br", "not valid brotli"),
    (b"not zstd", "zstd", "not valid zstd"), (b"x", "compress", "unknown content coding"),
    (b"x" * 2000, None, "more than"),
])
def test_what_cannot_be_read_is_unreadable(body: bytes, coding: str | None, why: str) -> None:
    scanner = Scanner(build(DEFAULT), b"s", limit=1000)
    result = scanner.scan_request("POST", "/", [("Content-Encoding", coding)] if coding
                                  else [], body)
    assert result.unreadable is not None and why in result.unreadable
    assert not result.clean


def test_unreadable_keeps_what_the_head_showed() -> None:
    scanner = Scanner(build(DEFAULT), b"s", limit=1000)
    result = scanner.scan_request("POST", "/", [("X-K", fake("github").text),
                                                ("Content-Encoding", "gzip")], b"bad")
    assert result.unreadable and [f.detector for f in result.findings] == ["github"]


def test_runs_base64_urlsafe_padded_and_hex() -> None:
    key = b"0123456789abcdef-key-bytes!"
    text = (f"a {base64.b64encode(key).decode()} b {base64.urlsafe_b64encode(key).decode()}"
            f" c {key.hex()} d {key.hex().upper()} e short")
    found = list(runs(text))
    assert [r.kind for r in found if decode_run(text, r) == key] == [
        "base64", "base64", "hex", "hex"]
    # a short base64 run is also read from its 2nd to 4th character (misaligned keys)
    assert len([r for r in found if r.kind == "base64"]) > 2


def test_a_key_behind_other_characters_and_a_long_run_from_its_start_only() -> None:
    key = base64.b64encode(b"AKIAABCDEFGHIJKLMNOP").decode()
    for prefix in ("x", "xy", "xyz"):
        assert any(decode_run(prefix + key, r) == b"AKIAABCDEFGHIJKLMNOP"
                   for r in runs(prefix + key))
    long = "Ab" * 1000
    assert [r.start for r in runs(long)] == [0]


def test_ordinary_words_are_not_runs() -> None:
    assert list(runs("the quick brown fox jumps over the lazy dog " * 50)) == []


@pytest.mark.parametrize(("body", "ctype", "codec"), [
    (b"plain", "text/plain", "latin-1"),
    (b"plain", "text/plain; charset=utf-8", "latin-1"),
    (b"plain", "text/plain; charset=ISO-8859-15", "latin-1"),
    (b"plain", "text/csv; charset=windows-1252", "latin-1"),
    (b"plain", "text/plain; charset=shift_jis", "latin-1"),  # (ASCII is its own bytes)
    (b"x", 'text/plain; charset="UTF-16LE"', "utf-16-le"),
    (b"x", "text/plain;charset=utf-32be", "utf-32-be"),
    (b"x", "text/plain; charset=utf-7", "utf-7"),
    (b"x", "text/plain; charset=iso-2022-jp", "iso2022_jp"),
    (b"x", "text/plain; charset=cp500", "cp500"),  # EBCDIC
    ("x".encode("utf-16"), "text/plain", "utf-16"),  # a byte-order mark, no charset
    ("x".encode("utf-32"), "application/octet-stream", "utf-32"),
    ("x".encode("utf-16"), "text/plain; charset=utf-16", "utf-16"),  # (its order: the BOM)
    ("x".encode("utf-32"), "text/plain; charset=UTF-32", "utf-32"),
])
def test_a_text_body_is_read_in_the_charset_its_receiver_reads(
        body: bytes, ctype: str, codec: str) -> None:
    assert text_codec(body, ctype) == codec


@pytest.mark.parametrize("charset", [
    "x-klingon",  # (no codec)
    "hex", "base64", "zlib", "rot13", "uu",  # (Python's codecs of bytes, or of text, to bytes)
    "unicode_escape", "raw-unicode-escape",  # (`\x67hp_` read as `ghp_`)
    "punycode", "idna", "undefined",  # (no charset, and they cannot read every byte)
])
def test_a_charset_without_a_codec_is_unreadable(charset: str) -> None:
    """Unreadable, the refusal's reason (before, a codec that is no charset raised
    LookupError or UnicodeError out of the scan, or read `\x67hp_` as it is)."""
    with pytest.raises(Unreadable, match=f"charset '{charset}'"):
        text_codec(b"x", f"text/plain; charset={charset}")


@pytest.mark.parametrize("ctype", ["text/plain; charset=latin-1; charset=utf-16",
                                   "text/plain;charset=utf-8 ;charset=utf-7",
                                   'text/plain; x="; charset=utf-16"; charset=utf-8'])
def test_a_content_type_naming_two_charsets_is_unreadable(ctype: str) -> None:
    """A reader takes the first or the last (a quoted one too, where it reads badly):
    which hides a key is not known, so neither is chosen."""
    with pytest.raises(Unreadable, match="more than one charset"):
        text_codec("ghp_x".encode("utf-16"), ctype)
    assert text_codec(b"x", "text/plain; charset=utf-8; charset=UTF-8") == "latin-1"


@pytest.mark.parametrize("codec", ["utf-16-be", "utf-16-le", "utf-32-be", "utf-32-le"])
@pytest.mark.parametrize("charset", ["utf-16", "utf-32", "UTF16"])
def test_a_charset_naming_no_byte_order_needs_a_byte_order_mark(codec: str,
                                                                charset: str) -> None:
    """Python reads such a body little-endian, RFC 2781 big-endian: a key in one order is
    noise in the other, so a body without the mark is unreadable, and says what to send."""
    with pytest.raises(Unreadable, match=r"names no byte order.*utf-16le"):
        text_codec("ghp_x".encode(codec), f"text/plain; charset={charset}")


@pytest.mark.parametrize(("ctype", "encode"), [
    ("text/plain; charset=utf-16", lambda t: t.encode("utf-16")),
    ("text/plain; charset=utf-16be", lambda t: t.encode("utf-16-be")),
    ("text/plain; charset=utf-32", lambda t: t.encode("utf-32")),
    ("text/plain; charset=utf-7", lambda t: t.encode("utf-7").replace(b"_", b"+AF8-")),
    ("text/plain; charset=cp500", lambda t: t.encode("cp500")),
    ("text/plain", lambda t: t.encode("utf-16")),
])
def test_a_key_in_a_text_body_of_another_charset_is_found(
        ctype: str, encode: Callable[[str], bytes]) -> None:
    """The raw bytes hold no anchor (UTF-16's NULs, UTF-7's escapes, EBCDIC's bytes):
    the receiver's reading does."""
    scanner = Scanner(build(DEFAULT), b"salt")
    key = fake("github").text
    body = encode(f"token = {key}\n")
    assert key.encode() not in body
    assert [f.detector for f in scanner.scan_body(body, ctype).findings] == ["github"]


def test_a_text_body_in_a_charset_without_a_codec_is_refused_unread() -> None:
    scanner = Scanner(build(DEFAULT), b"salt")
    result = scanner.scan_body(b"anything", "text/plain; charset=x-klingon")
    assert result.unreadable is not None and "x-klingon" in result.unreadable


@pytest.mark.parametrize(("body", "codec"), [
    (b"", "latin-1"),
    (b'{"a": "b"}', "latin-1"),
    (b"[1]", "latin-1"),
    ('{"a": "é"}'.encode(), "latin-1"),  # UTF-8: read as its bytes
    (codecs.BOM_UTF8 + b'{"a": 1}', "latin-1"),
    ('{"a": 1}'.encode("utf-16"), "utf-16"),  # a byte-order mark (FF FE)
    ('{"a": 1}'.encode("utf-16-be"), "utf-16-be"),  # a NUL in the first four bytes
    ('{"a": 1}'.encode("utf-16-le"), "utf-16-le"),
    ('{"a": 1}'.encode("utf-32"), "utf-32"),
    ('{"a": 1}'.encode("utf-32-be"), "utf-32-be"),
    ('{"a": 1}'.encode("utf-32-le"), "utf-32-le"),
    (codecs.BOM_UTF16_BE + '{"a": 1}'.encode("utf-16-be"), "utf-16"),  # FE FF
    (b'{"a": "\x00"}', "latin-1"),  # (a NUL past the first four bytes: not a codec's)
])
def test_json_codec_is_the_json_readers(body: bytes, codec: str) -> None:
    """The codec a JSON reader (`json.loads`) finds by a body's first bytes."""
    assert json_codec(body) == codec
    if body:
        assert json.detect_encoding(body).replace("utf-8-sig", "utf-8") == (
            "utf-8" if codec == "latin-1" else codec)

