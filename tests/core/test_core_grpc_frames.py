"""A gRPC body's messages (`core/grpc_frames.py`): each message whole and in order at any
cut of the body, a compressed one decompressed by what its bytes are; what the gateway
cannot read (another coding, a flag, a cut message, a bomb) is an EncodingError."""

from __future__ import annotations

import base64
import gzip
import struct
import zlib

import pytest
from backports import zstd

from gateway.core import grpc_frames
from gateway.core.encodings import EncodingError
from gateway.core.grpc_frames import Frames, TextFrames, frames_for, inflate, is_grpc


def frame(message: bytes, compressed: int = 0) -> bytes:
    return bytes([compressed]) + struct.pack(">I", len(message)) + message


def _read(body: bytes, step: int) -> tuple[bytes, list[int]]:
    frames, out, pending = Frames(), b"", []
    for at in range(0, len(body), step):
        out += b"".join(frames.feed(body[at:at + step]))
        pending.append(frames.pending)
    frames.end()
    return out, pending


MESSAGES = [b"first message", b"", b"x" * 70_000, b"\x0a\x05hello"]
CODINGS = [gzip.compress, zlib.compress, lambda m: zlib.compress(m)[2:-4],  # (raw deflate)
           lambda m: gzip.compress(m[:3]) + b"\0\0" + gzip.compress(m[3:]),  # (two members)
           zstd.compress]  # (read since the twenty-first session: it could not be bounded)


@pytest.mark.parametrize("step", [1, 2, 5, 6, 4096, 1 << 20])
def test_every_message_is_read_whole_and_in_order_at_any_cut(step: int) -> None:
    body = b"".join(frame(m) for m in MESSAGES) + b"".join(
        frame(code(m), 1) for m in MESSAGES for code in CODINGS)
    out, pending = _read(body, step)
    assert out == b"".join(MESSAGES) + b"".join(m * len(CODINGS) for m in MESSAGES)
    assert max(pending) <= 5 + max(len(code(m)) for m in MESSAGES for code in CODINGS)


# (gzip with mtime 0: a parameter's id is its bytes, the same in every xdist worker)
@pytest.mark.parametrize(("body", "says"), [
    (frame(b"\xff\x00snappy-ish bytes", 1), "cannot read"),  # (a coding it cannot undo)
    (frame(gzip.compress(b"x", mtime=0)[:-3], 1), "cannot read"),  # (cut short)
    (frame(zlib.compress(b"x") + b"more", 1), "cannot read"),  # (bytes after its end)
    (frame(gzip.compress(b"x", mtime=0) + b"junk", 1), "cannot read"),
    (frame(zstd.compress(b"x" * 100)[:-2], 1), "truncated zstd"),
    (frame(zstd.compress(b"x") + b"junk", 1), "after its zstd frames"),
    (frame(b"x", 2), "flagged 2"),
    (frame(b"x", 0x40), "flagged 64"),
    (frame(b"hello")[:-2], "ends inside a message"),
    (b"\x00\x00\x00", "ends inside a message"),
])
def test_what_cannot_be_read_is_an_error(body: bytes, says: str) -> None:
    for step in (1, len(body)):
        with pytest.raises(EncodingError, match=says):
            _read(body, step)


def test_a_compressed_message_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held to decode it, a compressed message is at most `COMPRESSED_LIMIT` bytes (its
    prefix says so before any is held), and decodes to at most `DECODED_LIMIT`."""
    with pytest.raises(EncodingError, match="over"):
        Frames().feed(b"\x01" + struct.pack(">I", grpc_frames.COMPRESSED_LIMIT + 1))
    monkeypatch.setattr(grpc_frames, "DECODED_LIMIT", 1000)
    with pytest.raises(EncodingError, match="more than 1000"):
        inflate(gzip.compress(b"a" * 1001, mtime=0))
    assert inflate(gzip.compress(b"a" * 1000, mtime=0)) == b"a" * 1000
    with pytest.raises(EncodingError, match="more than 1000"):
        inflate(zstd.compress(b"a" * 1001))
    assert inflate(zstd.compress(b"a" * 1000)) == b"a" * 1000


@pytest.mark.parametrize(("ctype", "framed"), [
    ("application/grpc", True), ("application/grpc+proto", True),
    ("Application/GRPC; charset=utf-8", True), ("application/grpc-web", True),
    ("application/grpc-web+json", True), ("application/grpc-web-text", True),
    ("application/grpc-web-text+proto", True),
    ("application/connect+proto", True), ("application/connect+json", True),
    ("application/proto", False),  # (Connect's unary call: Content-Encoding compresses)
    ("application/json", False), (None, False), ("text/grpc", False)])
def test_which_bodies_are_framed(ctype: str | None, framed: bool) -> None:
    assert is_grpc(ctype) is framed


def test_uncompressed_messages_in_a_row_come_as_one_piece_numbered() -> None:
    """A body of thousands of tiny messages is one piece to read (each a scan of its
    own cost thousands), numbered by its first and last message; a compressed message
    is a piece of its own, in order."""
    body = frame(b"a") * 5000 + frame(gzip.compress(b"zipped", mtime=0), 1) + frame(b"b") * 3
    frames = Frames()
    pieces = frames.numbered(body[:7]) + frames.numbered(body[7:])
    frames.end()
    assert [(first, last) for first, last, _ in pieces] == [(1, 1), (2, 5000), (5001, 5001),
                                                             (5002, 5004)]
    assert b"".join(p for _, _, p in pieces) == b"a" * 5000 + b"zipped" + b"bbb"


@pytest.mark.parametrize(("ctype", "reader"), [
    ("application/grpc", Frames), ("application/grpc-web+proto", Frames),
    ("application/grpc-web-text", TextFrames), ("Application/gRPC-Web-Text+proto", TextFrames),
    ("application/json", None), (None, None)])
def test_the_text_form_has_its_own_reader(ctype: str | None, reader: type | None) -> None:
    found = frames_for(ctype)
    assert (type(found) if found is not None else None) is reader


def _text(pieces: list[bytes], sep: bytes = b"") -> bytes:
    """gRPC-Web text: each piece base64 on its own, padded (as a client's chunks are)."""
    return sep.join(base64.b64encode(piece) for piece in pieces)


@pytest.mark.parametrize("step", [1, 3, 4, 7, 1 << 20])
@pytest.mark.parametrize("sep", [b"", b"\r\n"])
def test_the_text_form_is_read_as_its_base64_pieces_at_any_cut(step: int, sep: bytes) -> None:
    """gRPC-Web's text form: the same messages, a compressed one too, in base64 whose
    padded pieces follow one another; held back while a quantum or message is not whole."""
    zipped = gzip.compress(b"zipped", mtime=0)
    body = _text([frame(b"\x0a\x04helo"), frame(zipped, 1) + frame(b"last")], sep)
    body = body.replace(b"+", b"-").replace(b"/", b"_")  # (either alphabet)
    frames, out, pending = TextFrames(), b"", []
    for at in range(0, len(body), step):
        out += b"".join(frames.feed(body[at:at + step]))
        pending.append(frames.pending)
    frames.end()
    assert out == b"\x0a\x04helo" + b"zipped" + b"last"
    assert max(pending) <= -(-(5 + len(zipped)) * 4 // 3) + 3 + len(sep)


@pytest.mark.parametrize(("body", "says"), [
    (b"QQ=A", "not base64"), (b"Q===", "not base64"), (b"QUJD!!!!", "not base64"),
    (b"AAAAAAE", "inside a base64 quantum"),  # (cut inside four characters)
    (base64.b64encode(frame(b"hello"))[:-4], "ends inside a message"),
    (base64.b64encode(frame(b"\xff\x00", 1)), "cannot read")])
def test_what_the_text_form_cannot_read_is_an_error(body: bytes, says: str) -> None:
    for step in (1, len(body)):
        frames = TextFrames()
        with pytest.raises(EncodingError, match=says):
            for at in range(0, len(body), step):
                frames.feed(body[at:at + step])
            frames.end()


def test_grpc_webs_trailers_are_read_as_a_message() -> None:
    """gRPC-Web ends an answer with its trailers in a message flagged 0x80 (0x81 when
    compressed): read like any message, not an error that leaves the answer unread."""
    body = frame(b"answer") + frame(b"grpc-status: 0\r\n", 0x80) + frame(
        gzip.compress(b"x-more: 1\r\n", mtime=0), 0x81)
    assert _read(body, 3)[0] == b"answer" + b"grpc-status: 0\r\n" + b"x-more: 1\r\n"
