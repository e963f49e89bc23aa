"""A gRPC (or Connect streaming) body's messages as its server reads them (pure).

A gRPC (and gRPC-Web) body is a run of length-prefixed messages: one byte saying whether
the message is compressed (and, in gRPC-Web, whether it is the trailers), four giving
its length, then the message. A compressed one is in the coding the call's
`grpc-encoding` names (gzip, deflate or zstd; not a `Content-Encoding`: nothing else in the
head says so), so a key or a gateway token in it is not in the body's bytes: the leak
guard and outbound credential detection read the messages instead (`Frames`), an
uncompressed message as its bytes come (a streaming call is never held whole), a
compressed one once whole (bounded), decompressed by what its bytes are. A coding the
gateway cannot undo (snappy), a message flagged otherwise, or a body cut inside a
message is an `EncodingError`: the caller refuses it, as any body it cannot read.
gRPC-Web's text form (`application/grpc-web-text`) is the same run in base64, each
padded piece decoded as its readers decode it (`TextFrames`)."""

from __future__ import annotations

import binascii
import re
import struct
import zlib

from gateway.core.encodings import ZSTD_FRAME, EncodingError, decoder_for

__all__ = ["COMPRESSED_LIMIT", "DECODED_LIMIT", "Frames", "TextFrames", "frames_for", "inflate",
           "is_grpc"]

COMPRESSED_LIMIT = 8 * 1024 * 1024  # bytes of one compressed message held to decode it
DECODED_LIMIT = 32 * 1024 * 1024  # bytes it may decode to (read whole: bounded)
_PREFIX = 5
_HEAD = struct.Struct(">BI")  # (a message's prefix: compressed or not, its length)


def is_grpc(content_type: str | None) -> bool:
    """Whether a Content-Type is gRPC's or gRPC-Web's framing (`application/grpc`,
    `application/grpc+proto`, `application/grpc-web+json`, `application/grpc-web-text`,
    ...), or Connect's streaming one (`application/connect+proto`: the same prefixes,
    compressed by `connect-content-encoding`)."""
    ctype = (content_type or "").split(";", 1)[0].strip().lower()
    return ctype.startswith(("application/grpc", "application/connect+"))


def frames_for(content_type: str | None) -> Frames | None:
    """A reader of the messages of a body of this Content-Type, None where it is not
    gRPC's (`is_grpc`): `TextFrames` for gRPC-Web's base64 text form."""
    if not is_grpc(content_type):
        return None
    text = (content_type or "").split(";", 1)[0].strip().lower().startswith(
        "application/grpc-web-text")
    return TextFrames() if text else Frames()


class Frames:
    """A body's messages, fed as it comes (`feed`, then `end`): the bytes of each message
    in order, decompressed where it is compressed. `pending`: bytes of the body taken in
    and not given out yet (a prefix, a compressed message not whole): what a caller
    forwarding the body as it goes holds back."""

    unit = "gRPC message"
    __slots__ = ("_flag", "_held", "_left", "count")

    def __init__(self) -> None:
        self._held = bytearray()  # a prefix being read, or a compressed message
        self._flag = -1  # the message being read: -1 none (reading a prefix), 0, 1
        self._left = 0  # its bytes still to come
        self.count = 0  # messages begun

    @property
    def pending(self) -> int:
        return len(self._held)

    def feed(self, data: bytes) -> list[bytes]:
        """The message bytes `data` completes or continues (raises EncodingError)."""
        return [piece for _, _, piece in self.numbered(data)]

    def numbered(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """`feed`'s pieces, each with the numbers of its first and last messages (from
        1): uncompressed messages in a row come as one piece (a body of thousands of
        tiny messages is read as one text, not thousands)."""
        out: list[tuple[int, int, bytes]] = []
        plain, first = bytearray(), 0  # (the uncompressed bytes in a row, from message)
        view, at, size = memoryview(data), 0, len(data)
        while at < size:
            if self._flag < 0:  # (a prefix: from `data` where it is whole in it)
                if not self._held and size - at >= _PREFIX:
                    self._begin(*_HEAD.unpack_from(view, at))
                    at += _PREFIX
                else:
                    need = min(_PREFIX - len(self._held), size - at)
                    self._held += view[at:at + need]
                    at += need
                    if len(self._held) < _PREFIX:
                        break
                    head = _HEAD.unpack(self._held)
                    self._held.clear()
                    self._begin(*head)
                if self._flag == 0 and not plain:
                    first = self.count
            else:
                take = min(self._left, size - at)
                (plain if self._flag == 0 else self._held).extend(view[at:at + take])
                at += take
                self._left -= take
            if self._left == 0:
                if self._flag == 1:
                    if plain:
                        out.append((first, self.count - 1, bytes(plain)))
                        plain.clear()
                    out.append((self.count, self.count, self._inflate()))
                self._flag = -1
        if plain:
            out.append((first, self.count, bytes(plain)))
        return [piece for piece in out if piece[2]]

    def end(self) -> None:
        """The end of the body: raises EncodingError where it ends inside a message."""
        if self._held or self._flag >= 0:
            raise EncodingError("the gRPC body ends inside a message")

    def _begin(self, flag: int, length: int) -> None:
        if flag & ~0x81:  # (0x80: gRPC-Web's trailers, read as a message; 1: compressed)
            raise EncodingError(f"a gRPC message flagged {flag}, neither compressed nor not")
        flag &= 1
        if flag == 1 and length > COMPRESSED_LIMIT:
            raise EncodingError(f"a compressed gRPC message over {COMPRESSED_LIMIT} bytes "
                                "cannot be checked; send it uncompressed")
        self._flag, self._left = flag, length
        self.count += 1

    def _inflate(self) -> bytes:
        """The compressed message held, decompressed by what its bytes are (`inflate`)."""
        message = bytes(self._held)
        self._held.clear()
        self._flag = -1
        return inflate(message) if message else b""


class TextFrames(Frames):
    """gRPC-Web's text form: the framed messages in base64, decoded four characters at a
    time (a padded piece may follow another: a client or proxy sends each of its pieces
    padded, and its readers decode them so), whitespace skipped, either alphabet; any
    other byte, or a body ending inside four characters, raises EncodingError."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        super().__init__()
        self._rest = b""  # (characters after the last whole four)

    @property
    def pending(self) -> int:
        """As `Frames.pending`, in the body's characters (four for every three bytes)."""
        return -(-super().pending * 4 // 3) + len(self._rest)

    def numbered(self, data: bytes) -> list[tuple[int, int, bytes]]:
        return super().numbered(self._decode(data))

    def end(self) -> None:
        if self._rest:
            raise EncodingError("the gRPC-Web text body ends inside a base64 quantum")
        super().end()

    def _decode(self, data: bytes) -> bytes:
        text = self._rest + data.translate(_URLSAFE, b" \t\r\n")
        whole = len(text) - len(text) % 4
        self._rest = text[whole:]
        try:  # (each padded piece alone: `=` is only ever at a piece's end)
            return b"".join(binascii.a2b_base64(piece, strict_mode=True)
                            for piece in _PIECES.findall(text, 0, whole))
        except binascii.Error:
            raise EncodingError("a gRPC-Web text body that is not base64") from None


_URLSAFE = bytes.maketrans(b"-_", b"+/")
_PIECES = re.compile(rb"[^=]*(?:=+|$)")  # (base64 up to and with its padding)


def inflate(message: bytes) -> bytes:
    """A compressed message: gzip (every member, as Python's and Go's readers read it),
    zstd (its frames), else deflate, zlib-wrapped or raw, whole (cut short, or bytes
    after its end: no reader decodes it so) and at most `DECODED_LIMIT` bytes; raises
    EncodingError."""
    if message[:4] == ZSTD_FRAME:
        decoder = decoder_for("zstd", DECODED_LIMIT)
        assert decoder is not None
        try:
            return b"".join([*decoder.feed(message), *decoder.end()])
        except EncodingError as exc:
            raise EncodingError(f"a compressed gRPC message: {exc}") from None
    gzip = message[:2] == b"\x1f\x8b"
    wrapped = len(message) > 1 and message[0] & 0x0F == 8 and \
        (message[0] << 8 | message[1]) % 31 == 0
    wbits = 31 if gzip else 15 if wrapped else -15
    out = bytearray()
    data = message
    while data:
        obj = zlib.decompressobj(wbits)
        try:
            out += obj.decompress(data, DECODED_LIMIT + 1 - len(out))
        except zlib.error:
            raise EncodingError(_UNREAD) from None
        if len(out) > DECODED_LIMIT or obj.unconsumed_tail:
            raise EncodingError(f"a compressed gRPC message decodes to more than "
                                f"{DECODED_LIMIT} bytes")
        if not obj.eof:
            raise EncodingError(_UNREAD)
        data = obj.unused_data.lstrip(b"\0") if gzip else obj.unused_data
        if data and not gzip:
            raise EncodingError(_UNREAD)
    return bytes(out)


_UNREAD = ("a compressed gRPC message the gateway cannot read (a grpc-encoding other than "
           "gzip, deflate or zstd, or cut short); send it uncompressed or with gzip")
