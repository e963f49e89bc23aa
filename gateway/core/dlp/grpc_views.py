"""The views a scanner reads of a gRPC body (`core/grpc_frames.py`): each message, a
compressed one decompressed (gRPC-Web text: its base64
undone first), read as a body of its own (its bytes as text, JSON where it
is JSON, its base64 runs decoded). Pure."""

from __future__ import annotations

from collections.abc import Iterator

from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.findings import Hit, Location
from gateway.core.dlp.multipart import Reads
from gateway.core.encodings import EncodingError
from gateway.core.grpc_frames import frames_for

__all__ = ["grpc_views"]


def grpc_views(scan: Reads, body: bytes, ctype: str, where: Location,
               nested: int) -> Iterator[Hit]:
    """The messages of a gRPC body of Content-Type `ctype` (lowered), each read by `scan`
    at `where` `gRPC message N`; raises Unreadable for a body whose messages cannot be
    read (a coding the gateway cannot undo, a body cut inside a message, text that is
    not base64)."""
    frames = frames_for(ctype)
    assert frames is not None
    try:
        pieces = frames.numbered(body)
        frames.end()
    except EncodingError as exc:
        raise Unreadable(str(exc)) from None
    for first, last, piece in pieces:
        said = f"gRPC message {first}" if first == last else f"gRPC messages {first}-{last}"
        name = f"{where.name} {said}" if where.name else said
        yield from scan.body_views(piece, "application/octet-stream",
                                   Location(where.part, name, None, where.via), nested=nested + 1)
