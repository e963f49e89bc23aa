"""A git push's body as its server reads it (pure): the ref updates, then the pack.

`git push` over HTTP posts `application/x-git-receive-pack-request`: pkt-lines naming
the refs it updates (and push options), then a pack of the objects, each
zlib-deflated. A credential committed to a file is in the pack only deflated, so the
leak guard and outbound credential detection read the objects (`PackReader`, fed as
the body comes): each object's bytes inflated; a delta object's literal bytes (its
insert instructions: what it adds to its base; a delta's copies come from a base the
gateway may not hold, the server's own objects in a thin pack, and are not
reassembled, as a token sent in pieces over two requests is not). What the reader
cannot read (framing that is not git's, an object that inflates to other than its
declared size, a pack that inflates to more than `FLOOR` plus `RATIO` times its bytes)
is an `EncodingError`: the caller refuses it, as any body it cannot read.
"""

from __future__ import annotations

import zlib
from urllib.parse import unquote

from gateway.core.encodings import EncodingError

__all__ = ["FLOOR", "PUSH_TYPE", "RATIO", "PackReader", "is_git_push", "is_push_path"]

FLOOR = 64 * 1024 * 1024  # bytes a push may inflate to whatever its size
RATIO = 64  # and per byte of it (deflate's ratio is at most ~1032: a bomb is refused)
_LINES, _PACK_HEAD, _OBJECT_HEAD, _BASE, _DATA, _TRAILER, _DONE = range(7)
_KINDS = {1: "commit", 2: "tree", 3: "blob", 4: "tag", 6: "delta", 7: "delta"}


PUSH_TYPE = "application/x-git-receive-pack-request"


def is_git_push(content_type: str | None) -> bool:
    """Whether a Content-Type is a git push's."""
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    return ctype == PUSH_TYPE


def is_push_path(target: str) -> bool:
    """Whether a request-target is git's push endpoint (`/repo.git/git-receive-pack`):
    git's own HTTP backend reads a push only by its type, but a server that routes by
    the path may read a pack whatever the type says, so a body there is read as one."""
    if "%" not in target and "ack" not in target and "ACK" not in target:
        return False  # (most requests: two searches of the target)
    path = unquote(target.split("?", 1)[0]).rstrip("/")
    return path.lower().endswith("/git-receive-pack")


class PackReader:
    """A git push's body, fed as it comes (`feed`/`numbered`, then `end`): the ref
    updates' lines (number 0), then each object's bytes (from 1), inflated; a delta's
    inserted bytes. `pending`: bytes taken in and not given out yet (a line, a header
    being read; a few inside zlib)."""

    unit = "git object"
    __slots__ = ("_buf", "_decoded", "_delta", "_hash", "_inflate", "_left", "_objects",
                 "_raw", "_sections", "_state", "count")

    def __init__(self) -> None:
        self._buf = bytearray()  # (a pkt-line, a header or a trailer being read)
        self._state = _LINES
        self._hash = 20  # (an object name's bytes: 32 where the push names sha256)
        self._sections = 1  # (sections of lines before the pack: 2 with push options)
        self._objects = 0  # (objects the pack says it holds)
        self.count = 0  # objects begun
        self._inflate: zlib._Decompress | None = None
        self._left = 0  # (inflated bytes the object being read has still to give)
        self._delta: _Delta | None = None  # (the object being read is a delta)
        self._raw = self._decoded = 0

    @property
    def pending(self) -> int:
        return len(self._buf) + (64 if self._inflate is not None else 0)

    def feed(self, data: bytes) -> list[bytes]:
        """The bytes `data` gives of the lines and objects (raises EncodingError)."""
        return [piece for _, _, piece in self.numbered(data)]

    def numbered(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """`feed`'s pieces, each with the number of its object (0: the ref updates)."""
        self._raw += len(data)
        out: list[tuple[int, int, bytes]] = []
        view = memoryview(data)
        while view and self._state != _DONE:
            if self._state == _DATA:
                view = self._data(view, out)
            else:
                take = self._need()
                got = min(take - len(self._buf), len(view)) if take else 1
                self._buf += view[:got]
                view = view[got:]
                if take == 0 or len(self._buf) == take:
                    self._step(out)
        if view:
            raise EncodingError("a git push with bytes after its pack")
        return out

    def end(self) -> None:
        """The end of the body: raises EncodingError where it ends inside the push (a
        push of ref deletions alone has no pack: its lines end it)."""
        if self._state not in (_DONE, _PACK_HEAD) or self._buf:
            raise EncodingError("the git push ends inside its pack")

    def _need(self) -> int:
        """Bytes of the header being read that make it whole (0: read one at a time)."""
        if self._state == _LINES:
            return 4 if len(self._buf) < 4 else _pkt_length(self._buf)
        if self._state == _PACK_HEAD:
            return 12
        if self._state == _TRAILER:
            return self._hash
        if self._state == _BASE and self._kind_byte() == 7:
            return self._header_end() + self._hash
        return 0

    def _step(self, out: list[tuple[int, int, bytes]]) -> None:
        """A header (or one more byte of a varint) is in `_buf`: go on."""
        buf = self._buf
        if self._state == _LINES:
            if len(buf) == 4 and _pkt_length(buf) == 4:  # (a flush: the pack, if any,
                buf.clear()  # after the push options where the push has them)
                self._sections -= 1
                self._state = _PACK_HEAD if self._sections == 0 else _LINES
                return
            if len(buf) > 4:
                line = bytes(buf[4:])
                if b"\0" in line:  # (the first update: the push's capabilities)
                    said = line.split(b"\0", 1)[1].split()
                    self._hash = 32 if b"object-format=sha256" in said else 20
                    self._sections = 2 if b"push-options" in said else 1
                out.append((0, 0, line))
                buf.clear()
        elif self._state == _PACK_HEAD:
            if bytes(buf[:4]) != b"PACK" or bytes(buf[4:8]) not in (b"\0\0\0\2", b"\0\0\0\3"):
                raise EncodingError("a git push whose pack is not a git pack")
            self._objects = int.from_bytes(buf[8:12], "big")
            buf.clear()
            self._state = _OBJECT_HEAD if self._objects else _TRAILER
        elif self._state == _OBJECT_HEAD:
            if buf[-1] & 0x80:  # (the size's varint goes on)
                if len(buf) > 10:
                    raise EncodingError("a git object whose size is not a size")
                return
            kind = self._kind_byte()
            if kind not in _KINDS:
                raise EncodingError("a git object of no kind git has")
            if kind in (6, 7):  # (a delta: its base's offset, or its name, comes first)
                self._state = _BASE
            else:
                self._begin()
        elif self._state == _BASE:
            if self._kind_byte() == 6 and buf[-1] & 0x80:  # (the base's offset goes on)
                if len(buf) - self._header_end() > 10:
                    raise EncodingError("a git delta whose base is not an offset")
                return
            self._begin()
        elif self._state == _TRAILER:
            buf.clear()
            self._state = _DONE

    def _kind_byte(self) -> int:
        return self._buf[0] >> 4 & 7

    def _header_end(self) -> int:
        """Bytes of the object's type-and-size varint in `_buf`."""
        at = 0
        while self._buf[at] & 0x80:
            at += 1
        return at + 1

    def _begin(self) -> None:
        """The object's header is read: inflate its bytes."""
        head = self._buf[:self._header_end()]
        size, shift = head[0] & 0x0F, 4
        for byte in head[1:]:
            size |= (byte & 0x7F) << shift
            shift += 7
        self._delta = _Delta() if self._kind_byte() in (6, 7) else None
        self._buf.clear()
        self._left = size
        self._inflate = zlib.decompressobj()
        self.count += 1
        self._state = _DATA

    def _data(self, view: memoryview, out: list[tuple[int, int, bytes]]) -> memoryview:
        """Inflate the object's bytes in `view`; the rest of `view` after its end."""
        assert self._inflate is not None
        allowed = FLOOR + RATIO * self._raw - self._decoded
        try:
            got = self._inflate.decompress(view, min(self._left + 1, max(allowed, 0) + 1))
        except zlib.error:
            raise EncodingError("a git object that does not inflate") from None
        self._decoded += len(got)
        if len(got) > self._left:
            raise EncodingError("a git object that inflates to more than its size")
        if self._decoded > FLOOR + RATIO * self._raw:
            raise EncodingError(f"a git push that inflates to more than {RATIO} times its "
                                "size; push it in smaller parts")
        self._left -= len(got)
        piece = self._delta.inserted(got) if self._delta is not None else got
        if piece:
            if out and out[-1][0] == self.count:
                out[-1] = (self.count, self.count, out[-1][2] + piece)
            else:
                out.append((self.count, self.count, piece))
        if not self._inflate.eof:
            return view[len(view):]
        if self._left or (self._delta is not None and not self._delta.whole):
            raise EncodingError("a git object that inflates to less than its size")
        rest = self._inflate.unused_data
        self._inflate = self._delta = None
        self._objects -= 1
        self._state = _OBJECT_HEAD if self._objects else _TRAILER
        return memoryview(rest)


class _Delta:
    """A delta's instructions, read as they inflate: its inserted bytes given out."""

    __slots__ = ("_header", "_insert", "_skip")

    def __init__(self) -> None:
        self._header = 2  # (varints still to read: the base's size, the result's)
        self._skip = 0  # (bytes of a copy's operands still to skip)
        self._insert = 0  # (bytes of an insert still to give)

    @property
    def whole(self) -> bool:
        return self._header == 0 and not self._skip and not self._insert

    def inserted(self, data: bytes) -> bytes:
        out = bytearray()
        at, size = 0, len(data)
        while at < size:
            if self._header:
                self._header -= 0 if data[at] & 0x80 else 1
                at += 1
            elif self._skip:
                take = min(self._skip, size - at)
                self._skip -= take
                at += take
            elif self._insert:
                take = min(self._insert, size - at)
                out += data[at:at + take]
                self._insert -= take
                at += take
            else:
                op = data[at]
                at += 1
                if op & 0x80:  # (a copy from the base: its offset's and size's bytes)
                    self._skip = (op & 0x7F).bit_count()
                elif op:
                    self._insert = op
                else:
                    raise EncodingError("a git delta with an instruction git reserves")
        return bytes(out)


def _pkt_length(buf: bytearray) -> int:
    """A pkt-line's length from its four hex digits (0000, a flush, reads as 4)."""
    digits = bytes(buf[:4])
    if digits.strip(b"0123456789abcdefABCDEF"):  # (int() would take "+1f0", " 1f0")
        raise EncodingError("a git push whose lines are not git's")
    length = int(digits, 16)
    if length == 0:
        return 4
    if length < 5:  # (0001-0004: no line of a push; a delimiter is protocol v2's)
        raise EncodingError("a git push whose lines are not git's")
    return length
