"""A gRPC body read by its messages (`core/dlp/grpc_views.py`): a credential in a
compressed message is found (it is not in the body's bytes), where it is said by the
message's number; a body whose messages cannot be read is unreadable, held or streamed."""

from __future__ import annotations

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
        stream = StreamScanner(SCANNER, content_type=ctype)
        got = [f for at in range(0, len(body), piece)
               for f in stream.feed(body[at:at + piece]).findings]
        got += stream.end().findings
        assert [f.detector for f in got] == ["github"], piece


@pytest.mark.parametrize("body", [frame(b"\xff\x00not gzip nor deflate", 1),
                                  frame(_proto("cut"))[:-1]])
def test_messages_that_cannot_be_read_make_the_body_unreadable(body: bytes) -> None:
    assert SCANNER.scan_body(body, GRPC).unreadable is not None
    stream = StreamScanner(SCANNER, content_type=GRPC)
    stream.feed(body)
    assert stream.end().unreadable is not None
