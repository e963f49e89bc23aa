"""The views a scanner reads of a body read by its messages (`core/framing.py`): a gRPC
body's messages, a compressed one decompressed (gRPC-Web text: its base64 undone
first); a git push's ref updates and objects, each inflated. Each is read as a body of
its own (its bytes as text, JSON where it is JSON, its base64 runs decoded). Pure."""

from __future__ import annotations

from collections.abc import Iterator

from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.findings import Hit, Location
from gateway.core.dlp.multipart import Reads
from gateway.core.encodings import EncodingError
from gateway.core.framing import reader_for

__all__ = ["message_views"]


def message_views(scan: Reads, body: bytes, ctype: str, where: Location,
                  nested: int) -> Iterator[Hit]:
    """The messages of a body of Content-Type `ctype` (lowered), each read by `scan` at
    `where` `gRPC message N` (`git object N`, `git ref updates`); raises Unreadable for
    a body whose messages cannot be read (a coding the gateway cannot undo, a body cut
    inside a message, text that is not base64, a pack that is not git's)."""
    reader = reader_for(ctype)
    assert reader is not None
    try:
        pieces = reader.numbered(body)
        reader.end()
    except EncodingError as exc:
        raise Unreadable(str(exc)) from None
    for first, last, piece in pieces:
        said = named(reader.unit, first, last)
        name = f"{where.name} {said}" if where.name else said
        yield from scan.body_views(piece, "application/octet-stream",
                                   Location(where.part, name, None, where.via), nested=nested + 1)


def named(unit: str, first: int, last: int) -> str:
    """Where messages `first`-`last` are: `gRPC message 2`, `gRPC messages 3-900`, `git
    object 4`, `git ref updates` (a push's number 0)."""
    if unit == "git object" and first == 0:
        return "git ref updates"
    return f"{unit} {first}" if first == last else f"{unit}s {first}-{last}"
