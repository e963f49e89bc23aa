"""The files a request body is, as it comes (pure): where the body, or a part of a
multipart body, is a compressed file or an archive (`core/archives.py`), what it
unpacks to, by the part's number (0: the body itself). What reads a body as it comes
(the stream scanner, the leak guard) reads each number's files with a scanner of its
own: a part's files are not read across another's."""

from __future__ import annotations

from gateway.core.archives import FIRST_BYTES, Sniffed, Undecided
from gateway.core.dlp.multipart import StreamedParts

__all__ = ["Files"]


class Files:
    """Feed the body's pieces (`feed`, the last with `final`): the files' bytes, each
    with its part's number. A multipart body (`delimiter`) is read by its parts (the
    heads checked where `check`, `multipart.StreamedParts`); any other by its first
    bytes. `done`: nothing more can come of it (its first bytes say it is no archive).
    `undecided`: which of the body's bytes may go on while the files' bytes are read
    (`archives.Undecided`)."""

    __slots__ = ("_fresh", "_part", "_parts", "done", "undecided")

    def __init__(self, delimiter: bytes | None, check: bool = False) -> None:
        self._parts = StreamedParts(delimiter, check) if delimiter is not None else None
        self._part: tuple[int, Sniffed] | None = None if delimiter is not None else (
            0, Sniffed())
        self.done = False
        self._fresh = True  # (nothing of the body seen yet)
        self.undecided = Undecided()

    def feed(self, data: bytes, final: bool = False) -> list[tuple[int, bytes]]:
        """What `data` unpacks to, by part (raises EncodingError for a bomb, Unreadable
        for a part head the check refuses)."""
        out = self._feed(data, final)
        self.undecided.fed(len(data), sum(len(piece) for _, piece in out))
        if final or self.unpacking is None:
            # (no archive being read, or its first bytes being sniffed, a magic's 6 at
            # most, all header: its bytes give no more)
            self.undecided.settle()
        return out

    @property
    def unpacking(self) -> int | None:
        """The number of the part whose archive is being read (None: none is, what was
        read of one has ended)."""
        part = self._part
        unpacker = part[1].unpacker if part is not None else None
        return part[0] if part is not None and unpacker is not None and not unpacker.done \
            and not self.done else None

    def _feed(self, data: bytes, final: bool) -> list[tuple[int, bytes]]:
        if self._parts is None:
            assert self._part is not None
            sniffed = self._part[1]
            if self.done:
                return []
            if self._fresh and len(data) >= 6 and data[0] not in FIRST_BYTES:
                self.done = True  # (most bodies: one look at their first byte)
                return []
            self._fresh = self._fresh and not data  # (a first piece of a few bytes: the
            # next ones are not the body's first: the sniff reads them together)
            out = [(0, piece) for _, piece in sniffed.feed(data, final)]
            self.done = sniffed.decided and sniffed.unpacker is None
            return out
        out = []
        for number, content in self._parts.feed(data):
            if self._part is None or self._part[0] != number:
                out += self._close()
                self._part = (number, Sniffed())
            out += [(number, piece) for _, piece in self._part[1].feed(content)]
        return out + self._close() if final else out

    def _close(self) -> list[tuple[int, bytes]]:
        if self._part is None:
            return []
        number, sniffed = self._part
        return [(number, piece) for _, piece in sniffed.feed(b"", final=True)]
