"""Streaming content decoders (gzip, deflate, br, zstd), bounded.

The core decodes bodies it must read — request bodies for the leak scan, responses
it must redact — as they stream, never holding more than a chunk. A body whose
decoded size passes `limit` (a decompression bomb) or that does not decode raises
`EncodingError`: the caller refuses it (fail closed), because a body it cannot read
is a body it cannot check. Every decoder is asked for at most `_STEP` bytes a call
(zstd's too: PEP 784's `ZstdDecompressor`, Python 3.14's `compression.zstd` or its
backport, takes `max_length`; a zstd frame can expand a few bytes into gigabytes), and
a zstd window larger than `ZSTD_WINDOW` is refused (its decoder allocates it whole).
"""

from __future__ import annotations

import functools
import gzip
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import brotli

__all__ = ["ZSTD_FRAME", "ZSTD_WINDOW", "Decoder", "EncodingError", "ZstdStream", "decoder_for",
           "encode", "known_encoding", "zstd_frame_start"]

DEFAULT_LIMIT = 256 * 1024 * 1024
_STEP = 256 * 1024  # decoded bytes produced per call into a decompressor
ZSTD_WINDOW = 27  # log2 of the largest zstd window decoded (128 MiB: zstd's own default
# limit, `--long` writes 27; an xz stream is bounded the same, `archives.MEMORY`)
ZSTD_FRAME = b"\x28\xb5\x2f\xfd"  # (a zstd frame's magic, RFC 8878 3.1.1)


class EncodingError(ValueError):
    """A body that cannot be decoded (unknown coding, corrupt data, over the limit)."""


class _Stage(Protocol):
    def feed(self, data: bytes) -> Iterator[bytes]: ...
    def end(self) -> Iterator[bytes]: ...


class _Zlib:
    """gzip (wbits 31), deflate as zlib (15) or, as browsers accept, raw deflate (-15).
    Output comes in pieces of at most _STEP bytes (a bomb never lands in one buffer).

    A gzip body may be several members one after another (RFC 1952 2.2), zero bytes
    between them: each is decoded, as Python's and Go's readers do (zlib stops at the
    first: a key in the second passed every check). Bytes after a deflate stream's end
    are an error: no reader decodes them, and what they hold is not known."""

    def __init__(self, gzip: bool) -> None:
        self._name = "gzip" if gzip else "deflate"
        self._obj = zlib.decompressobj(31) if gzip else None
        self._head = b""  # deflate: the first two bytes tell zlib-wrapped from raw

    def feed(self, data: bytes) -> Iterator[bytes]:
        if self._obj is None:
            self._head += data
            if len(self._head) < 2:
                return
            data, self._head = self._head, b""
            wrapped = data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0
            self._obj = zlib.decompressobj(15 if wrapped else -15)
        while data:
            try:
                out = self._obj.decompress(data, _STEP)
            except zlib.error:
                raise EncodingError(f"the body is not valid {self._name}") from None
            data = self._obj.unconsumed_tail
            if out:
                yield out
            if self._obj.eof and self._obj.unused_data:  # (what follows the end)
                data = self._next(self._obj.unused_data)

    def _next(self, rest: bytes) -> bytes:
        """After a stream's end: the next gzip member's bytes, with a new decompressor
        for them (b"": zero padding so far, kept); raises for bytes after deflate."""
        if self._name != "gzip":
            raise EncodingError("the body has bytes after the end of its deflate stream")
        member = rest.lstrip(b"\0")
        if member:
            self._obj = zlib.decompressobj(31)
        return member

    def end(self) -> Iterator[bytes]:
        if self._obj is None:
            if self._head:
                raise EncodingError(f"truncated {self._name} body")
            return  # an empty body
        try:
            out = self._obj.flush()
        except zlib.error:
            raise EncodingError(f"truncated {self._name} body") from None
        if out:
            yield out


class _Brotli:
    def __init__(self) -> None:
        self._obj = brotli.Decompressor()

    def feed(self, data: bytes) -> Iterator[bytes]:
        try:
            out = self._obj.process(data, output_buffer_limit=_STEP)
            while True:
                if out:
                    yield bytes(out)
                if self._obj.can_accept_more_data():
                    return
                out = self._obj.process(b"", output_buffer_limit=_STEP)
        except brotli.error:
            raise EncodingError("the body is not valid brotli") from None

    def end(self) -> Iterator[bytes]:
        return iter(())


@functools.cache
def _zstd() -> Any:
    """PEP 784's zstd module, imported at the first zstd body (0.6 MiB a process that
    never sees one)."""
    if sys.version_info >= (3, 14):
        from compression import zstd
    else:
        from backports import zstd
    return zstd


class ZstdStream:
    """A decoder of one zstd frame (or skippable frame), its window bounded, as bz2's
    and lzma's decoders are used (`decompress(data, max_length)`, `eof`, `unused_data`,
    `needs_input`); a frame that does not decode raises `EncodingError`."""

    __slots__ = ("_obj",)

    def __init__(self) -> None:
        zstd = _zstd()
        self._obj = zstd.ZstdDecompressor(options={
            zstd.DecompressionParameter.window_log_max: ZSTD_WINDOW})

    @property
    def eof(self) -> bool:
        return bool(self._obj.eof)

    @property
    def needs_input(self) -> bool:
        return bool(self._obj.needs_input)

    @property
    def unused_data(self) -> bytes:
        return bytes(self._obj.unused_data)

    def decompress(self, data: bytes | memoryview, max_length: int = -1) -> bytes:
        try:
            return bytes(self._obj.decompress(data, max_length))
        except _zstd().ZstdError as exc:
            raise EncodingError(f"the body is not valid zstd ({exc})") from None


def zstd_frame_start(data: bytes) -> bool:
    """Whether `data` may start a zstd frame or a skippable frame (RFC 8878 3.1.2:
    `0x184D2A5?`), or is the start of one's magic."""
    return data.startswith(ZSTD_FRAME) or ZSTD_FRAME.startswith(data) or (
        0x50 <= data[0] <= 0x5F and b"\x2a\x4d\x18".startswith(data[1:4]))


class _Zstd:
    """zstd (RFC 8878): its frames one after another, skippable frames among them, as
    `zstd -d` reads them; bytes after a frame that start no frame are an error."""

    def __init__(self) -> None:
        self._obj = ZstdStream()
        self._fed = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._fed = self._fed or bool(data)
        while True:
            if self._obj.eof:  # (a frame ended: what follows starts the next)
                data = self._obj.unused_data + data
                if not data:
                    return
                if not zstd_frame_start(data):
                    raise EncodingError("the body has bytes after its zstd frames")
                self._obj = ZstdStream()
            out = self._obj.decompress(data, _STEP)
            data = b""
            if out:
                yield out
            if not self._obj.eof and self._obj.needs_input:
                return

    def end(self) -> Iterator[bytes]:
        if self._fed and not self._obj.eof:
            raise EncodingError("truncated zstd body")
        return iter(())


_STAGES: dict[str, Callable[[], _Stage]] = {
    "gzip": lambda: _Zlib(True), "x-gzip": lambda: _Zlib(True),
    "deflate": lambda: _Zlib(False), "br": _Brotli, "zstd": _Zstd}


def known_encoding(header: str | None) -> bool:
    """True if every coding in a Content-Encoding value can be decoded here."""
    return all(c in _STAGES or c == "identity" for c in _codings(header))


def _codings(header: str | None) -> list[str]:
    return [c.strip().lower() for c in (header or "").split(",") if c.strip()]


class Decoder:
    """Decodes a body with the codings of one Content-Encoding header, as it streams."""

    def __init__(self, stages: list[_Stage], limit: int) -> None:
        self._stages = stages
        self._limit = limit
        self.produced = 0

    def _through(self, pieces: Iterable[bytes], start: int) -> Iterator[bytes]:
        for piece in pieces:
            if start == len(self._stages):
                self.produced += len(piece)
                if self.produced > self._limit:
                    raise EncodingError(f"the body decodes to more than {self._limit} bytes")
                yield piece
            else:
                yield from self._through(self._stages[start].feed(piece), start + 1)

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Decoded pieces of `data` (each at most 256 KiB)."""
        return self._through([data], 0)

    def end(self) -> Iterator[bytes]:
        """What the decoders still hold at the end of the body."""
        for i, stage in enumerate(self._stages):
            yield from self._through(stage.end(), i + 1)


def decoder_for(header: str | None, limit: int = DEFAULT_LIMIT) -> Decoder | None:
    """A decoder for a Content-Encoding value; None for no coding (identity).
    Raises EncodingError for a coding this gateway cannot decode."""
    codings = [c for c in _codings(header) if c != "identity"]
    if not codings:
        return None
    unknown = [c for c in codings if c not in _STAGES]
    if unknown:
        raise EncodingError(f"unknown content coding {unknown[0][:40]!r}")
    # Codings are listed in the order they were applied: undo them last to first.
    return Decoder([_STAGES[c]() for c in reversed(codings)], limit)


_ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress,
    "br": brotli.compress, "zstd": lambda data: bytes(_zstd().compress(data))}


def encode(header: str | None, data: bytes) -> bytes:
    """``data`` encoded with the codings of a Content-Encoding value, in order: a body
    the gateway rewrote goes out in the coding its head already names."""
    for coding in _codings(header):
        if coding != "identity":
            try:
                data = _ENCODERS[coding](data)
            except KeyError:
                raise EncodingError(f"unknown content coding {coding[:40]!r}") from None
    return data
