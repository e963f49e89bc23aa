"""The request body of a stdlib `BaseHTTPRequestHandler` request, as the fakes read it:
de-chunked (trailers skipped) or by Content-Length."""

from __future__ import annotations

from email.message import Message
from typing import BinaryIO


def read_body(headers: Message, rfile: BinaryIO) -> bytes:
    """The body the client sent (b"" when it sent none)."""
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        out = b""
        while True:
            size = int(rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return out
            out += rfile.read(size)
            rfile.readline()
    length = int(headers.get("Content-Length") or 0)
    return rfile.read(length) if length else b""
