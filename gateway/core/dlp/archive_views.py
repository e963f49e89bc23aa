"""The views a scanner reads of a held body that is a compressed file or an archive
(`core/archives.py`): each file in it unpacked, read as a body of its own (`body gzip
file`, `body zip entry .env`), beside the body's own bytes. Not within another
archive's file (one level: a bomb's bound is of the body's size). Pure."""

from __future__ import annotations

from collections.abc import Iterator

from gateway.core.archives import FIRST_BYTES, Unpacker, archive_kind
from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.findings import Hit, Location
from gateway.core.dlp.multipart import Reads
from gateway.core.encodings import EncodingError

__all__ = ["UNPACKED", "archive_views", "unpacks"]

UNPACKED = "archive"  # (a location's `via`: read from an archive's file)


def unpacks(body: bytes, where: Location) -> bool:
    """Whether `body` (not empty) is read unpacked too (an archive, not in another's
    file)."""
    return body[0] in FIRST_BYTES and archive_kind(body[:6]) is not None and \
        UNPACKED not in where.via


def archive_views(scan: Reads, body: bytes, where: Location, nested: int) -> Iterator[Hit]:
    """The files of `body` (an archive: `unpacks`), each read by `scan`; raises
    Unreadable for one that unpacks past its bound."""
    kind = archive_kind(body[:6])
    assert kind is not None
    try:
        files = Unpacker(kind).feed(body)
    except EncodingError as exc:
        raise Unreadable(str(exc)) from None
    for name, data in files:
        said = f"zip entry {name}" if kind == "zip" else f"{kind} file"
        yield from scan.body_views(data, "application/octet-stream", Location(
            where.part, f"{where.name} {said}" if where.name else said, None,
            (*where.via, UNPACKED)), nested=nested + 1)
