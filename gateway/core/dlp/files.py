"""The files a request body holds, as it comes (pure): where the body, or a part of a
multipart body, is a compressed file or holds a zip's entries (`core/archives.py`,
`core/zip_entries.py`), what they unpack to, each by its key: the part's number (0: the
body itself) and the file's within it. What reads a body as it comes (the stream
scanner, the leak guard) reads each key's bytes with a scanner of its own: a file's
bytes are not read across another's."""

from __future__ import annotations

from gateway.core.archives import Undecided
from gateway.core.dlp.multipart import StreamedParts
from gateway.core.zip_entries import Sniffed

Key = tuple[int, int]  # (a part's number, a file's in it)

__all__ = ["Files", "Key"]


class Files:
    """Feed the body's pieces (`feed`, the last with `final`): the files' bytes, each
    with its key. A multipart body (`delimiter`) is read by its parts (the heads checked
    where `check`, `multipart.StreamedParts`), each part's files by a `Sniffed` of its
    own; any other body by one. `live`: the keys still being read (a reader ends the
    others' scans). `undecided`: which of the body's bytes may go on while the files'
    bytes are read (`archives.Undecided`)."""

    __slots__ = ("_part", "_parts", "undecided")

    def __init__(self, delimiter: bytes | None, check: bool = False,
                 after: tuple[bytes, int] | None = None) -> None:
        """`after`: a body's bytes so far held nothing (`zip_entries.quiet`): their last
        3 and their size (not a multipart body's)."""
        self._parts = StreamedParts(delimiter, check) if delimiter is not None else None
        self._part: tuple[int, Sniffed] | None = None if delimiter is not None else (
            0, Sniffed(slots=True, after=after))
        self.undecided = Undecided()

    def feed(self, data: bytes, final: bool = False) -> list[tuple[Key, bytes]]:
        """What `data` unpacks to, by key (raises EncodingError for a bomb, Unreadable
        for a part head the check refuses)."""
        if not data and self.idle:
            return []  # (the end of a body that held nothing: most)
        out = self._feed(data, final)
        self.undecided.fed(len(data), sum(len(piece) for _, piece in out))
        part = self._part
        if final or part is None or not part[1].reading:
            # (no file being read (the first bytes sniffed, a magic's 6 at most, and a
            # zip's header are none): its bytes give no more)
            self.undecided.settle()
        return out

    @property
    def reading(self) -> bool:
        """Whether a file is being read (`Sniffed.reading`; or multipart parts: always)."""
        part = self._part
        return self._parts is not None or part is None or part[1].reading

    def skips(self, data: bytes, searched: bool = False) -> bool:
        """`feed` for `data` that adds no file's bytes (`Sniffed.skips`; not a multipart
        body's; `searched`: no zip signature in it, found by the caller): True, its bytes
        taken; False, having done nothing, for any other."""
        part = self._part
        if self._parts is not None or part is None or not part[1].skips(data, searched):
            return False
        self.undecided.passed(len(data))
        return True

    @property
    def idle(self) -> bool:
        """Whether nothing it was fed is being read, and its end gives nothing (a body
        that held no file: most)."""
        part = self._part
        return self._parts is None and part is not None and part[1].idle

    def live(self) -> set[Key]:
        """The keys whose files are still being read."""
        part = self._part
        return {(part[0], number) for number in part[1].live()} if part is not None else set()

    def _feed(self, data: bytes, final: bool) -> list[tuple[Key, bytes]]:
        if self._parts is None:
            assert self._part is not None
            return [((0, number), piece) for number, piece in self._part[1].feed(data, final)]
        out = []
        for number, content in self._parts.feed(data):
            if self._part is None or self._part[0] != number:
                out += self._close()
                self._part = (number, Sniffed(slots=True))
            out += [((number, file), piece) for file, piece in self._part[1].feed(content)]
        return out + self._close() if final else out

    def _close(self) -> list[tuple[Key, bytes]]:
        if self._part is None:
            return []
        number, sniffed = self._part
        return [((number, file), piece) for file, piece in sniffed.feed(b"", final=True)]
