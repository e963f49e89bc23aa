"""Streaming, bounded content decoding."""

from __future__ import annotations

import gzip
import zlib

import brotli
import pytest

from gateway.core.encodings import EncodingError, decoder_for, known_encoding

DATA = b"the quick brown fox " * 5000


@pytest.mark.parametrize(("coding", "encode"), [
    ("gzip", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda d: zlib.compress(d)[2:-4]),  # raw deflate, as some servers send
    ("br", brotli.compress),
    ("gzip, br", lambda d: brotli.compress(gzip.compress(d))),
    ("identity, gzip", gzip.compress),
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


@pytest.mark.parametrize("coding", ["zstd", "compress", "x-custom"])
def test_unknown_codings_are_refused(coding: str) -> None:
    assert not known_encoding(coding)
    with pytest.raises(EncodingError):
        decoder_for(coding)


def test_a_bomb_is_stopped_at_the_limit() -> None:
    bomb = gzip.compress(b"\0" * (20 * 1024 * 1024))
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


@pytest.mark.parametrize("header", ["gzip", "x-gzip", "deflate", "br", "gzip, br", "identity"])
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
        encode("zstd", data)
