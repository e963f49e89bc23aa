"""The views a scanner reads of a held body that is a compressed file or holds a zip's
entries (`core/archives.py`, `core/zip_entries.py`): each file in it unpacked, read as
a body of its own (`body gzip file`, `body zip entry .env`), beside the body's own
bytes. Not within another archive's file (one level: a bomb's bound is of the body's
size). Pure.

A base64 or hex run that decodes to one (a file sent in a JSON string, as GitHub's
contents API takes it) is unpacked too (`run_views`). The runs of one body, or of one
request's head, share one bound (`Sharing`: a body of a thousand small bombs is one
bound, not a thousand); a run read outside one (`run_views` without `Sharing`) is
bounded by its own size alone, no floor."""

from __future__ import annotations

from collections.abc import Iterator
from contextvars import ContextVar, Token

from gateway.core.archives import Allowance
from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.findings import Hit, Location
from gateway.core.dlp.multipart import Reads
from gateway.core.encodings import EncodingError
from gateway.core.zip_entries import holds_files, unpacked_files

__all__ = ["UNPACKED", "Sharing", "archive_views", "packed", "run_views", "unpacks"]

UNPACKED = "archive"  # (a location's `via`: read from an archive's file)


def unpacks(body: bytes, where: Location) -> bool:
    """Whether `body` (not empty) is read unpacked too (a compressed file, or holding a
    zip's entries anywhere: `zip_entries.holds_files`; not in another's file)."""
    return UNPACKED not in where.via and holds_files(body)


_SHARED: ContextVar[Allowance | None] = ContextVar("unpacking", default=None)


class Sharing:
    """Within: the runs unpacked share one `Allowance`: of a body or request of `size`
    bytes, or a stream's, growing as it comes (unless one is shared already: a
    request's, around its body's). A class, not a generator: one is entered for every
    body read."""

    __slots__ = ("_size", "_token")

    def __init__(self, size: int | Allowance) -> None:
        self._size = size
        self._token: Token[Allowance | None] | None = None

    def __enter__(self) -> None:
        if _SHARED.get() is None:
            size = self._size
            self._token = _SHARED.set(size if isinstance(size, Allowance) else Allowance(size))

    def __exit__(self, *_: object) -> None:
        if self._token is not None:
            _SHARED.reset(self._token)


def packed(text: str, where: Location) -> bool:
    """Whether a decoded run's text (latin-1) is a compressed file, or holds a zip's
    entries, to unpack."""
    return UNPACKED not in where.via and holds_files(text.encode("latin-1"))


def run_views(scan: Reads, text: str, where: Location) -> Iterator[Hit]:
    """The files of a decoded run that is a compressed file (`packed`), each read by
    `scan` (raises Unreadable past the shared bound)."""
    data = text.encode("latin-1")
    shared = _SHARED.get() or Allowance(len(data), floor=0)  # (outside a body's
    # reading: its own size, no floor)
    yield from archive_views(scan, data, where, 0, shared)


def archive_views(scan: Reads, body: bytes, where: Location, nested: int,
                  allowance: Allowance | None = None) -> Iterator[Hit]:
    """The files of `body` (`unpacks`), each read by `scan`; raises Unreadable for one
    that unpacks past its bound (its own, or `allowance`)."""
    try:
        files = unpacked_files(body, allowance)
    except EncodingError as exc:
        raise Unreadable(str(exc)) from None
    for said, data in files:
        yield from scan.body_views(data, "application/octet-stream", Location(
            where.part, f"{where.name} {said}" if where.name else said, None,
            (*where.via, UNPACKED)), nested=nested + 1)
