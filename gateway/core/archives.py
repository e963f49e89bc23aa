"""A body that is a compressed file or an archive, unpacked (pure).

A sandbox that uploads its workspace as `.tar.gz` or `.zip` to a host a rule allows (an
object store, an artifact registry) sends every file in it deflated: a `.env` inside is
not in the body's bytes. Whoever downloads it unpacks it, so the leak guard and outbound
credential detection read a body that starts as a gzip, bzip2, xz or zstd file, or a
zip archive, also unpacked (`Unpacker`, fed as the body comes): a compressed file's every
stream (members, as `gunzip` reads them; a tar inside is plain bytes), a zip's entries
one after another from its first local header (deflated, bzip2- or LZMA-compressed ones
inflated, zstd too; stored ones are the body's own bytes, read as they are). As
`gunzip` and `unzip` do, it reads what decodes and stops where the bytes stop being the
format (the rest is read as bytes, as every body is); an encrypted entry or a zip
method it cannot undo are read as their bytes (what a cipher hides no reading finds). A
body that inflates to more than `FLOOR` plus `RATIO` times its bytes (a bomb) is an
`EncodingError`: the caller refuses it; an xz or LZMA stream whose decoder would take
more than `MEMORY`, or a zstd frame whose window is larger, is not read (a header asking
4 GiB is not allocated). What the body
is must be said by its first bytes: an archive after other bytes is not looked for
(every body would pay a search). What a gzip stream decoded before bad bytes is read
(zlib's stream is copied before each call); a bzip2 or xz stream's failing call gives
nothing (they cannot be copied): what it decoded in that call is not read.
"""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from collections.abc import Callable
from typing import Any, Protocol

from gateway.core.encodings import EncodingError, ZstdStream, zstd_frame_start
from gateway.core.unpack_bounds import AMPLE, ExcessError, Undecided, charged_to

__all__ = ["FIRST_BYTES", "FLOOR", "RATIO", "Allowance", "Sniffed", "Undecided", "Unpacker",
           "archive_kind"]

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
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # (a zip entry's local header: 30 bytes)


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

    def decompress(self, data: bytes, max_length: int = -1) -> bytes: ...


def _starts(data: bytes, kind: str) -> bool:
    """Whether `data` may start a file of `kind` (it starts with its magic, or is the
    start of the magic: the rest may come with the next bytes)."""
    if kind == "zstd":  # (a frame, or a skippable frame, follows)
        return zstd_frame_start(data)
    magic = next(m for m, k in _MAGIC if k == kind)
    return data.startswith(magic) or magic.startswith(data)


def _decompressor(kind: str) -> _Stream:
    if kind == "gzip":
        return zlib.decompressobj(31)
    if kind == "bzip2":
        return bz2.BZ2Decompressor()
    if kind == "zstd":
        return ZstdStream()
    return lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=MEMORY)


# (ValueError: properties no decoder takes, a zstd frame that does not decode, as
# `EncodingError`; MemoryError: one it could not make)
_ERRORS = (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError, MemoryError)


def _salvage(before: Any, data: bytes, limit: int) -> bytes:
    """What `data` decodes to before the byte where the stream fails (the call that
    failed gave nothing): a reader writing as it decodes (gunzip) has written it. Found
    by halving on copies of the stream as it was `before` the call (zlib's; a bzip2 or
    xz stream cannot be copied: what its failing call decoded is not read)."""
    if before is None:
        return b""
    copy = before.copy
    out = bytearray()
    while len(data) > 1 and len(out) < limit:
        half = len(data) // 2
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

    def decompress(self, data: bytes, max_length: int = -1) -> bytes:
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


# (deflate, bzip2, LZMA, zstd: what unzip, 7-Zip and Python's zipfile read (zstd:
# APPNOTE 6.3.8's method 93, as 7-Zip and Python 3.14's zipfile); deflate64 and others
# are read as their bytes)
_ZIP_METHODS: dict[int, Callable[[], _Stream]] = {
    8: lambda: zlib.decompressobj(-15), 12: bz2.BZ2Decompressor, 14: _ZipLzma,
    93: ZstdStream}


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
    """The files in a body of `kind` (`archive_kind`), fed as it comes (`feed`): the
    bytes each gives, in order, by name (a zip entry's). Bounded by its own bytes, or by
    a shared `allowance`."""

    __slots__ = ("_allowance", "_buf", "_charged", "_descriptor", "_entry", "_kind", "_left",
                 "_raw", "_stream", "_unpacked", "done", "name")

    def __init__(self, kind: str, allowance: Allowance | None = None) -> None:
        self._kind = kind
        self._allowance = allowance
        self._buf = bytearray()  # (a zip entry's header being read)
        self._stream: _Stream | None = None if kind == "zip" else _decompressor(kind)
        self._entry = -1  # (a zip entry's compressed bytes still to come; -1: to its end)
        self._left = 0  # (a zip entry's bytes to pass over unread)
        self._descriptor = False  # (a data descriptor follows the entry just read)
        self._raw = self._unpacked = self._charged = 0
        self.done = False  # (the bytes stopped being the format: the rest is not read)
        self.name = ""

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        """What `data` unpacks to, each piece with the zip entry it is of ("" in a
        compressed file); raises EncodingError past the bound."""
        self._raw += len(data)
        out: list[tuple[str, bytes]] = []
        view = memoryview(data)
        while view and not self.done:
            if self._stream is not None:
                view = self._inflate(view, out)
            elif self._left:
                skip = min(self._left, len(view))
                self._left -= skip
                view = view[skip:]
            else:
                view = self._header(view)
        return out

    def _inflate(self, view: memoryview, out: list[tuple[str, bytes]]) -> memoryview:
        """Decompress what of `view` is the stream's; the rest of `view` after it."""
        assert self._stream is not None
        take = len(view) if self._entry < 0 else min(self._entry, len(view))
        allowed = self._allowed()
        failed: memoryview | None = None
        stream = self._stream
        copy = getattr(stream, "copy", None)  # (zlib's: what a failing call decoded is
        before = copy() if copy is not None else None  # found again on it, `_salvage`)
        try:
            got = stream.decompress(bytes(view[:take]), max(allowed, 0) + 1)
        except _ERRORS:  # (not the format from here: gunzip stops, having written what
            got = _salvage(before, bytes(view[:take]), max(allowed, 0) + 1)
            if self._entry >= 0:  # decoded before the bad bytes; unzip goes on with the
                self._left, self._entry, self._stream = self._entry - take, -1, None
                failed = view[take:]  # next entry, past this one by its size)
            else:
                self.done, failed = True, view[len(view):]
        self._unpacked += len(got)
        if self._allowance is not None:
            self._allowance.left -= len(got)
        if self._allowed() < 0:
            raise EncodingError(f"a compressed file that unpacks to more than {RATIO} times "
                                "its size; send it uncompressed or in parts")
        self._charge()
        if got:
            if out and out[-1][0] == self.name:
                out[-1] = (self.name, out[-1][1] + got)
            else:
                out.append((self.name, got))
        if failed is not None:
            return failed
        if self._entry >= 0:  # (a zip entry of known size: it ends with its bytes)
            self._entry -= take
            if stream.eof or not self._entry:
                self._left, self._entry, self._stream = self._entry, -1, None
            return view[take:]
        if not stream.eof:
            return view[len(view):]
        rest = stream.unused_data
        if self._kind == "zip":  # (the entry's end; its data descriptor, if any, is
            self._stream = None  # passed over by the next header's search)
        elif _starts(rest, self._kind):  # (another member or stream may follow)
            self._stream = _decompressor(self._kind)
        else:
            self.done = True
        return memoryview(rest)

    def _charge(self) -> None:
        """What it unpacked past `AMPLE` times its bytes, to its sandbox's `Excess`."""
        over = self._unpacked - AMPLE * self._raw - self._charged
        if over <= 0 or (excess := charged_to()) is None:
            return
        self._charged += over
        excess.left -= over
        if excess.left < 0:
            raise ExcessError(
                f"this sandbox's compressed data unpacked to more than {AMPLE} times its size "
                f"by over {excess.size / 2**20:.0f} MiB lately (refilled at "
                f"{excess.rate / 2**20:.0f} MiB a second); send it uncompressed, or slower")

    def _allowed(self) -> int:
        """The bytes the files may still give (below 0: past the bound)."""
        if self._allowance is not None:
            return self._allowance.left
        return FLOOR + RATIO * self._raw - self._unpacked

    def _header(self, view: memoryview) -> memoryview:
        """At a zip entry's local header (after a data descriptor's 12 to 24 bytes where
        the last entry said one follows): its data inflated next, or passed over; the
        central directory, or bytes that are no zip, end the reading."""
        need = _LOCAL.size + (24 if self._descriptor else 0)
        if len(self._buf) < need:
            take = min(need - len(self._buf), len(view))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) < need:
                return view
        if self._descriptor:  # (its signature, if any, and 12 or 20 bytes: find the next)
            at = next((at for at in (12, 16, 20, 24) if self._buf[at:at + 4] in _NEXT), -1)
            if at < 0:
                self.done = True
                return view
            del self._buf[:at]
            self._descriptor = False
        if bytes(self._buf[:4]) != b"PK\x03\x04":  # (the central directory: the end)
            self.done = True
            return view
        (_, _, flags, method, _, _, _, csize, usize, nlen, xlen) = _LOCAL.unpack_from(
            self._buf)
        if len(self._buf) < _LOCAL.size + nlen + xlen:
            take = min(_LOCAL.size + nlen + xlen - len(self._buf), len(view))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) < _LOCAL.size + nlen + xlen:
                return view
        extra = bytes(self._buf[_LOCAL.size + nlen:_LOCAL.size + nlen + xlen])
        self.name = bytes(self._buf[_LOCAL.size:_LOCAL.size + nlen]).decode("utf-8", "replace")
        rest = bytes(self._buf[_LOCAL.size + nlen + xlen:])  # (bytes read past the header)
        self._buf.clear()
        sized = not flags & 0x08  # (its sizes are in its header, not after its data)
        if csize == 0xFFFFFFFF:
            csize = _zip64_size(extra, usize == 0xFFFFFFFF)
        if method in _ZIP_METHODS and not flags & 0x01 and (sized or method != 14):
            self._stream = _ZIP_METHODS[method]()
            self._entry = csize if sized else -1  # (sized: to its size; else its end)
            self._descriptor = not sized
        elif sized and csize >= 0:  # (stored, encrypted, or a method not undone: its
            self._left = csize  # bytes are read as the body's own)
        else:
            self.done = True  # (no size to pass it over by: the rest is read as bytes)
        return memoryview(rest + bytes(view)) if rest else view


class Sniffed:
    """A streamed body's files (`Unpacker`) once its first bytes say it is an archive
    (`feed`: what each piece unpacks to; nothing for a body that is none)."""

    __slots__ = ("_head", "decided", "unpacker")

    def __init__(self) -> None:
        self._head = b""  # (the first bytes, while fewer than a magic's)
        self.decided = False
        self.unpacker: Unpacker | None = None

    def feed(self, data: bytes, final: bool = False) -> list[tuple[str, bytes]]:
        if self.decided:
            return self.unpacker.feed(data) if self.unpacker is not None and data else []
        head = self._head + data if self._head else data  # (no copy of a first piece)
        if len(head) < _SNIFF and not final:
            self._head = head
            return []
        self.decided, self._head = True, b""
        kind = archive_kind(head[:_SNIFF])
        if kind is None:
            return []
        self.unpacker = Unpacker(kind)
        return self.unpacker.feed(head)


_SNIFF = max(len(magic) for magic, _ in _MAGIC)
_NEXT = (b"PK\x03\x04", b"PK\x01\x02")  # (a local header, the central directory)


def _zip64_size(extra: bytes, after_size: bool) -> int:
    """A zip64 entry's compressed size, from its extra field (after its size where the
    header's is zip64's too); -1 if it has none."""
    at, skip = 0, 8 if after_size else 0
    while at + 4 <= len(extra):
        kind, size = struct.unpack_from("<HH", extra, at)
        if kind == 1 and size >= skip + 8 and at + 4 + skip + 8 <= len(extra):
            return int(struct.unpack_from("<Q", extra, at + 4 + skip)[0])
        at += 4 + size
    return -1
