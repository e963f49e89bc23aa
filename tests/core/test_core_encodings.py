"""Streaming, bounded content decoding."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest
from backports import zstd

from gateway.core.encodings import ZSTD_WINDOW, EncodingError, decoder_for, known_encoding

DATA = b"the quick brown fox " * 5000


@pytest.mark.parametrize(("coding", "encode"), [
    ("gzip", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda d: zlib.compress(d)[2:-4]),  # raw deflate, as some servers send
    ("br", brotli.compress),
    ("gzip, br", lambda d: brotli.compress(gzip.compress(d, mtime=0))),
    ("identity, gzip", gzip.compress),
    ("zstd", zstd.compress),
    ("gzip, zstd", lambda d: zstd.compress(gzip.compress(d, mtime=0))),
])
def test_decodes_in_any_split(coding: str, encode: object) -> None:
    blob = encode(DATA)  # type: ignore[operator]
    for step in (1, 13, 4096, len(blob)):
        decoder = decoder_for(coding)
        assert decoder is not None
        out = b"".join(p for i in range(0, len(blob), step) for p in decoder.feed(blob[i:i + step]))
        out += b"".join(decoder.end())
        assert out == DATA


def test_identity_needs_no_decoder() -> None:
    assert decoder_for(None) is None and decoder_for("identity") is None


@pytest.mark.parametrize("coding", ["compress", "x-custom"])
def test_unknown_codings_are_refused(coding: str) -> None:
    assert not known_encoding(coding)
    with pytest.raises(EncodingError):
        decoder_for(coding)


def test_a_bomb_is_stopped_at_the_limit() -> None:
    bomb = gzip.compress(b"\0" * (20 * 1024 * 1024), mtime=0)
    decoder = decoder_for("gzip", limit=1024 * 1024)
    assert decoder is not None
    with pytest.raises(EncodingError, match="more than"):
        for _ in decoder.feed(bomb):
            pass


def test_corrupt_data_is_an_error() -> None:
    decoder = decoder_for("gzip")
    assert decoder is not None
    with pytest.raises(EncodingError):
        list(decoder.feed(b"not gzip at all"))


@pytest.mark.parametrize("header", ["gzip", "x-gzip", "deflate", "br", "gzip, br", "identity",
                                    "zstd"])
def test_encode_is_undone_by_the_decoder(header: str) -> None:
    """A body the gateway rewrote goes out in the coding its head names."""
    from gateway.core.encodings import encode

    data = b'{"stream_options":{"include_usage":true},"model":"m"}' * 50
    encoded = encode(header, data)
    decoder = decoder_for(header)
    decoded = data if decoder is None else b"".join(
        [*decoder.feed(encoded), *decoder.end()])
    assert decoded == data
    with pytest.raises(EncodingError):
        encode("compress", data)


def _decode(header: str, body: bytes, step: int) -> bytes:
    decoder = decoder_for(header, 1 << 30)
    assert decoder is not None
    out = b"".join(b"".join(decoder.feed(body[at:at + step]))
                   for at in range(0, len(body), step))
    return out + b"".join(decoder.end())


def test_every_member_of_a_gzip_body_is_decoded_in_any_split() -> None:
    """A gzip body of several members, zero bytes between some (RFC 1952 2.2): every
    member is decoded, as Python's `gzip` and Go's reader do (zlib stopped at the first,
    and what the others held was never read)."""
    members = [gzip.compress(bytes([65 + i]) * (997 * i + 1)) for i in range(5)]
    body = members[0] + b"\0" * 7 + members[1] + members[2] + b"\0" + members[3] + \
        members[4] + b"\0\0"
    for step in (1, 2, 3, 17, 1000, len(body)):
        assert _decode("gzip", body, step) == gzip.decompress(body), step


@pytest.mark.parametrize(("header", "body"), [
    ("gzip", gzip.compress(b"a", mtime=0) + b"not a member"),
    ("deflate", zlib.compress(b"a") + zlib.compress(b"b")),
    ("deflate", zlib.compress(b"a") + b"x"),
    ("deflate", zlib.compress(b"a")[2:-4] + b"x"),  # (raw deflate)
    ("zstd", zstd.compress(b"a") + b"not a frame"),
    ("zstd", zstd.compress(b"a" * 1000)[:-3]),  # (cut short)
    ("zstd", b"(\xb5/\xfd not a frame"),
])
def test_bytes_after_the_end_are_an_error(header: str, body: bytes) -> None:
    """What follows a deflate stream's end, or a gzip member's that is not another
    member, is no body a reader decodes: refused, never dropped unread."""
    for step in (1, 4, len(body)):
        with pytest.raises(EncodingError):
            _decode(header, body, step)


def _skippable(data: bytes) -> bytes:
    return b"\x5a\x2a\x4d\x18" + len(data).to_bytes(4, "little") + data


def test_every_zstd_frame_is_decoded_in_any_split_skippable_ones_passed_over() -> None:
    """A zstd body of several frames, skippable frames among them (RFC 8878 3.1.2), is
    decoded whole, as `zstd -d` reads it."""
    frames = [zstd.compress(bytes([65 + i]) * (997 * i + 1)) for i in range(4)]
    body = frames[0] + _skippable(b"meta") + frames[1] + frames[2] + _skippable(b"") + \
        frames[3]
    for step in (1, 2, 3, 17, 1000, len(body)):
        assert _decode("zstd", body, step) == b"".join(
            bytes([65 + i]) * (997 * i + 1) for i in range(4)), step


def test_a_zstd_bomb_is_stopped_at_the_limit_in_bounded_pieces() -> None:
    """A frame of a few KB that expands to 200 MB: no call gives more than 256 KiB, and
    the limit refuses it (before the twenty-first session a zstd body was not decoded
    at all: streamed, unreadable; held, refused by the leak guard)."""
    bomb = zstd.compress(b"\0" * (200 * 1024 * 1024), level=19)
    assert len(bomb) < 10_000
    decoder = decoder_for("zstd", limit=8 * 1024 * 1024)
    assert decoder is not None
    sizes = []
    with pytest.raises(EncodingError, match="more than"):
        for piece in decoder.feed(bomb):
            sizes.append(len(piece))
    assert max(sizes) <= 256 * 1024 and sum(sizes) <= 8 * 1024 * 1024


def test_a_zstd_window_past_the_bound_is_refused() -> None:
    """A frame whose window is larger than 2**ZSTD_WINDOW (its decoder would allocate
    it whole) is an error, not a 2 GiB allocation."""
    for window, refused in ((ZSTD_WINDOW + 1, True), (ZSTD_WINDOW, False)):
        packer = zstd.ZstdCompressor(options={  # (streamed: the frame says its window,
            zstd.CompressionParameter.window_log: window,  # not a smaller content size)
            zstd.CompressionParameter.enable_long_distance_matching: 1})
        body = packer.compress(b"x" * 100_000) + packer.flush()
        if refused:
            with pytest.raises(EncodingError, match="too much memory"):
                _decode("zstd", body, len(body))
        else:
            assert _decode("zstd", body, len(body)) == b"x" * 100_000
