"""A body that is a compressed file, unpacked (pure).

A sandbox that uploads its workspace as `.tar.gz` or `.zip` to a host a rule allows (an
object store, an artifact registry) sends every file in it compressed: a `.env` inside
is not in the body's bytes. Whoever downloads it unpacks it, so the leak guard and
outbound credential detection read a body that starts as a gzip, bzip2, xz or zstd file
also unpacked (`Unpacker`, fed as the body comes): its every stream (members, as
`gunzip` reads them; a tar inside is plain bytes). A zip's entries are read wherever
they are (`core/zip_entries.py`), each by an `Unpacker` of its data (`deflate`, `lzma`,
or a compressed file's kind). As `gunzip` does, it reads what decodes and stops where
the bytes stop being the format (the rest is read as bytes, as every body is). A body
that inflates to more than `FLOOR` plus `RATIO` times its bytes (a bomb) is an
`EncodingError`: the caller refuses it; an xz or LZMA stream whose decoder would take
more than `MEMORY`, or a zstd frame whose window is larger, is not read (a header asking
4 GiB is not allocated). A compressed file is said by a body's first bytes (`gunzip`,
`xz`, `zstd` and `bunzip2` read none after other bytes). What a gzip or deflate stream
decoded before bad bytes is read (zlib's stream is copied before each call); a bzip2 or
xz stream's failing call gives nothing (they cannot be copied): what it decoded in that
call is not read.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from typing import Any, Protocol

from gateway.core.encodings import EncodingError, ZstdStream, zstd_frame_start
from gateway.core.unpack_bounds import AMPLE, Undecided, charged_to, spend

__all__ = ["FIRST_BYTES", "FLOOR", "RATIO", "Allowance", "Undecided", "Unpacker", "archive_kind"]

FLOOR = 64 * 1024 * 1024  # bytes a body may unpack to whatever its size
RATIO = 64  # and per byte of it
_MAGIC = ((b"\x1f\x8b\x08", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
          (b"PK\x03\x04", "zip"), (b"\x28\xb5\x2f\xfd", "zstd"))
MEMORY = 128 * 1024 * 1024  # an xz or LZMA decoder's memory at most (xz -9 uses 65 MiB)
# (a zstd file may start with a skippable frame, `0x184D2A5?` little-endian, as pzstd's
# do; `zstd -d` reads past it)
_SKIPPABLE = range(0x50, 0x60)
FIRST_BYTES = frozenset(magic[0] for magic, _ in _MAGIC) | frozenset(_SKIPPABLE)  # (`body[0]
# in`: most bodies)
_MEMBERS = frozenset({"gzip", "bzip2", "xz", "zstd"})  # (another stream may follow one)


def archive_kind(head: bytes) -> str | None:
    """What a body starting with `head` (its first 6 bytes or more) is: `gzip`, `bzip2`,
    `xz`, `zip`, `zstd` (a frame or a skippable frame first), or None."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if head[:1] and head[0] in _SKIPPABLE and head[1:4] == b"\x2a\x4d\x18":
        return "zstd"
    return None


class _Stream(Protocol):
    @property
    def eof(self) -> bool: ...

    @property
    def unused_data(self) -> bytes: ...

    def decompress(self, data: bytes | memoryview, max_length: int = -1) -> bytes: ...


def _starts(data: bytes, kind: str) -> bool:
    """Whether `data` may start a file of `kind` (it starts with its magic, or is the
    start of the magic: the rest may come with the next bytes)."""
    if kind == "zstd":  # (a frame, or a skippable frame, follows)
        return zstd_frame_start(data)
    magic = next(m for m, k in _MAGIC if k == kind)
    return data.startswith(magic) or magic.startswith(data)


def _decompressor(kind: str) -> _Stream:
    """A stream of `kind` (`archive_kind`'s but zip, or a zip entry's: `deflate`,
    `lzma`)."""
    if kind == "deflate":  # (a zip entry's: raw deflate)
        return zlib.decompressobj(-15)
    if kind == "lzma":  # (a zip entry's, method 14)
        return _ZipLzma()
    if kind == "gzip":
        return zlib.decompressobj(31)
    if kind == "bzip2":
        return bz2.BZ2Decompressor()
    if kind == "zstd":
        return ZstdStream()
    if kind == "xz":
        return lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=MEMORY)
    raise ValueError(f"no stream of kind {kind!r} (a zip's entries: `zip_entries`)")


# (ValueError: properties no decoder takes, a zstd frame that does not decode, as
# `EncodingError`; MemoryError: one it could not make)
_ERRORS = (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError, MemoryError)


_PROBE = 16  # (bytes of a failed call `_salvage` tries first)


def _salvage(before: Any, data: bytes | memoryview, limit: int) -> bytes:
    """What `data` decodes to before the byte where the stream fails (the call that
    failed gave nothing): a reader writing as it decodes (gunzip) has written it. Found
    by halving on copies of the stream as it was `before` the call (zlib's; a bzip2 or
    xz stream cannot be copied: what its failing call decoded is not read). Its first
    16 bytes are tried first: bytes that are no stream at all (a zip entry's data tried
    as deflate, `zip_entries`) fail in them, in 5 calls, not one a halving of the whole."""
    if before is None:
        return b""
    copy = before.copy
    out = bytearray()
    first = True
    while len(data) > 1 and len(out) < limit:
        half = min(len(data) // 2, _PROBE) if first else len(data) // 2
        first = False
        trial = copy()
        try:
            out += trial.decompress(data[:half], limit - len(out))
        except _ERRORS:
            data = data[:half]  # (the bad byte is in the first half)
            continue
        copy, data = trial.copy, data[half:]
    return bytes(out)


class _ZipLzma:
    """A zip entry's LZMA (method 14): a 4-byte header, the LZMA properties, then a raw
    LZMA1 stream (its properties read here, as PKWARE's APPNOTE 5.8.8 lays them out)."""

    def __init__(self) -> None:
        self._head = bytearray()
        self._inner: lzma.LZMADecompressor | None = None

    @property
    def eof(self) -> bool:
        return self._inner is not None and self._inner.eof

    @property
    def unused_data(self) -> bytes:
        return self._inner.unused_data if self._inner is not None else b""

    def decompress(self, data: bytes | memoryview, max_length: int = -1) -> bytes:
        if self._inner is None:
            self._head += data
            if len(self._head) < 9:
                return b""
            size = int.from_bytes(self._head[2:4], "little")
            if size != 5 or self._head[4] >= 9 * 5 * 5:
                raise lzma.LZMAError("not a zip entry's LZMA properties")
            pb, rest = divmod(self._head[4], 45)
            lp, lc = divmod(rest, 9)
            window = int.from_bytes(self._head[5:9], "little")
            if window > MEMORY // 2:  # (its dictionary is allocated whole, as it says)
                raise lzma.LZMAError("an LZMA dictionary larger than the gateway makes")
            self._inner = lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[{
                "id": lzma.FILTER_LZMA1, "dict_size": window,
                "lc": lc, "lp": lp, "pb": pb}])
            data, self._head = bytes(self._head[9:]), bytearray()
        return self._inner.decompress(data, max_length)


class Allowance:
    """The bytes several unpackings may give together (`left`): the compressed files
    in one body's base64 runs share the body's bound, `FLOOR` plus `RATIO` times the
    body's size, so that a body of many small bombs is one bound, not one each."""

    __slots__ = ("left",)

    def __init__(self, size: int, floor: int | None = None) -> None:
        self.left = (FLOOR if floor is None else floor) + RATIO * size

    def grow(self, size: int) -> None:
        """`size` more bytes of the body (a stream's next piece)."""
        self.left += RATIO * size


class Unpacker:
    """The bytes a compressed stream of `kind` gives, fed as it comes (`feed`): a
    gzip, bzip2, xz or zstd file's every stream (members, as `gunzip` reads them), or one
    zip entry's data (`deflate`, `lzma`: zip's method 14; its end is the entry's).
    Bounded by its own bytes, or by a shared `allowance`."""

    __slots__ = ("_allowance", "_charged", "_kind", "_raw", "_stream", "_unpacked", "done")

    def __init__(self, kind: str, allowance: Allowance | None = None) -> None:
        self._kind = kind
        self._allowance = allowance
        self._stream: _Stream = _decompressor(kind)
        self._raw = self._unpacked = self._charged = 0
        self.done = False  # (the bytes stopped being the format: the rest is not read)

    def feed(self, data: bytes | memoryview) -> list[tuple[str, bytes]]:
        """What `data` unpacks to (one piece, named ""); raises EncodingError past the
        bound."""
        out: list[tuple[str, bytes]] = []
        view = memoryview(data)
        while view and not self.done:
            view = self._inflate(view, out)
        return out

    def _inflate(self, view: memoryview, out: list[tuple[str, bytes]]) -> memoryview:
        """Decompress what of `view` is the stream's; the rest of `view` after it."""
        allowed = self._allowed(len(view))
        stream = self._stream
        copy = getattr(stream, "copy", None)  # (zlib's: what a failing call decoded is
        before = copy() if copy is not None else None  # found again on it, `_salvage`)
        try:
            got = stream.decompress(view, max(allowed, 0) + 1)  # (no copy: a zip
            # entry's stream is given the body's bytes after it, and may stop early)
        except _ERRORS:  # (not the format from here: gunzip stops, having written what
            got = _salvage(before, view, max(allowed, 0) + 1)  # it decoded before
            self.done = True  # the bad bytes)
        rest = stream.unused_data if not self.done and stream.eof else b""
        self._raw += len(view) - len(rest)  # (its own bytes: a zip entry's stream is
        self._unpacked += len(got)  # given the body's bytes after it too)
        if self._allowance is not None:
            self._allowance.left -= len(got)
        if self._allowed() < 0:
            raise EncodingError(f"a compressed file that unpacks to more than {RATIO} times "
                                "its size; send it uncompressed or in parts")
        self._charge()
        if got:
            if out:
                out[-1] = ("", out[-1][1] + got)
            else:
                out.append(("", got))
        if self.done or not stream.eof:
            return view[len(view):]
        if self._kind in _MEMBERS and _starts(rest, self._kind):  # (another member or
            self._stream = _decompressor(self._kind)  # stream may follow)
        else:
            self.done = True  # (a zip entry's stream ends it)
        return memoryview(rest)

    def _charge(self) -> None:
        """What it unpacked past `AMPLE` times its bytes, to its sandbox's `Excess`."""
        over = self._unpacked - AMPLE * self._raw - self._charged
        if over <= 0 or charged_to() is None:
            return
        self._charged += over
        spend(over)

    def _allowed(self, coming: int = 0) -> int:
        """The bytes it may still give (below 0: past the bound), `coming` more bytes of
        it being read."""
        if self._allowance is not None:
            return self._allowance.left
        return FLOOR + RATIO * (self._raw + coming) - self._unpacked
