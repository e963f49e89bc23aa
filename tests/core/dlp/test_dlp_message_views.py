"""A body read by its messages (`core/dlp/message_views.py`): a credential in a
compressed message is found (it is not in the body's bytes), where it is said by the
message's number; a body whose messages cannot be read is unreadable, held or streamed."""

from __future__ import annotations

import base64
import gzip
import struct

import pytest
from helpers.dlp_corpus import fake

from gateway.core.dlp import DEFAULT, Scanner, StreamScanner
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt")
GRPC = "application/grpc"


def frame(message: bytes, compressed: int = 0) -> bytes:
    return bytes([compressed]) + struct.pack(">I", len(message)) + message


def _streamed(body: bytes, ctype: str, piece: int) -> list[str]:
    """The detectors a stream scanner finds `body` holds, fed `piece` bytes at a time."""
    stream = StreamScanner(SCANNER, content_type=ctype)
    got = [f for at in range(0, len(body), piece)
           for f in stream.feed(body[at:at + piece]).findings]
    return [f.detector for f in got + list(stream.end().findings)]


def _proto(text: str) -> bytes:  # (field 1, a string)
    data = text.encode()
    return b"\x0a" + bytes([len(data)]) + data


@pytest.mark.parametrize("ctype", [GRPC, "application/grpc+proto", "application/grpc-web",
                                   "application/connect+proto"])
def test_a_credential_in_a_compressed_message_is_found_held_and_streamed(ctype: str) -> None:
    key = fake("github").text
    body = frame(_proto("hello")) + frame(gzip.compress(_proto(f"deploy {key}")), 1)
    assert key.encode() not in body
    assert not SCANNER.body_clean(body, ctype)  # (a gRPC body is read by its messages)
    found = SCANNER.scan_body(body, ctype).findings
    assert [(f.detector, str(f.location)) for f in found] == [("github", "body gRPC message 2")]
    for piece in (1, 7, len(body)):
        assert _streamed(body, ctype, piece) == ["github"], piece


def test_the_text_forms_messages_are_read_under_its_base64() -> None:
    """gRPC-Web's text form: its padded base64 pieces undone, then its messages (a
    compressed one decompressed), held and streamed; base64 that is not is unreadable."""
    key, ctype = fake("github").text, "application/grpc-web-text"
    body = base64.b64encode(frame(_proto("helo"))) + base64.b64encode(
        frame(gzip.compress(_proto(f"deploy {key}")), 1))
    found = SCANNER.scan_body(body, ctype).findings
    assert [(f.detector, str(f.location)) for f in found] == [("github", "body gRPC message 2")]
    for piece in (1, 5, len(body)):
        assert _streamed(body, ctype, piece) == ["github"], piece
    assert SCANNER.scan_body(body + b"!", ctype).unreadable is not None


@pytest.mark.parametrize("body", [frame(b"\xff\x00not gzip nor deflate", 1),
                                  frame(_proto("cut"))[:-1]])
def test_messages_that_cannot_be_read_make_the_body_unreadable(body: bytes) -> None:
    assert SCANNER.scan_body(body, GRPC).unreadable is not None
    stream = StreamScanner(SCANNER, content_type=GRPC)
    stream.feed(body)
    assert stream.end().unreadable is not None


def _push(*files: bytes, ref: bytes = b"refs/heads/main") -> bytes:
    """A git push of blobs (a pack made here; git's own are read in test_core_git_pack)."""
    import zlib

    pack = b"PACK\0\0\0\2" + len(files).to_bytes(4, "big")
    for data in files:
        size, head = len(data), bytearray()
        head.append(0x30 | size & 0x0F | (0x80 if size > 0x0F else 0))
        size >>= 4
        while size:
            head.append(size & 0x7F | (0x80 if size > 0x7F else 0))
            size >>= 7
        pack += bytes(head) + zlib.compress(data)
    line = b"0" * 40 + b" " + b"1" * 40 + b" " + ref + b"\0report-status\n"
    return b"%04x" % (len(line) + 4) + line + b"0000" + pack + b"\0" * 20


GIT = "application/x-git-receive-pack-request"


def test_a_credential_committed_to_a_pushed_file_is_found_held_and_streamed() -> None:
    key = fake("github").text
    body = _push(b"# notes\n", f"GITHUB_TOKEN={key}\n".encode())
    assert key.encode() not in body and not SCANNER.body_clean(body, GIT)
    found = SCANNER.scan_body(body, GIT).findings
    assert [(f.detector, str(f.location)) for f in found] == [("github", "body git object 2")]
    for piece in (1, 9, len(body)):
        assert _streamed(body, GIT, piece) == ["github"], piece
    named = SCANNER.scan_body(_push(b"x", ref=f"refs/heads/{key}".encode()), GIT).findings
    assert [str(f.location) for f in named] == ["body git ref updates"]
    assert not SCANNER.scan_body(_push(b"def main():\n    return 0\n"), GIT).findings
    assert SCANNER.scan_body(_push(b"x")[:-25], GIT).unreadable is not None
