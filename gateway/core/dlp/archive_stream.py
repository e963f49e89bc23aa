"""A streamed request body's files, where it is a compressed file or an archive
(`core/archives.py`): unpacked as the body comes and read by a stream scanner of their
own, beside the body's (`body unpacked at offset N`). Pure."""

from __future__ import annotations

from gateway.core.archives import Sniffed
from gateway.core.dlp.findings import Finding, ScanResult
from gateway.core.dlp.scanner import Scanner
from gateway.core.dlp.stream import StreamScanner
from gateway.core.encodings import EncodingError

__all__ = ["ArchiveStream"]

_NOTHING = ScanResult(())


class ArchiveStream:
    """Feed the body's pieces as they come (`feed`, then `end`): the findings new in
    its files, once its first bytes say it is an archive (none for any other body)."""

    __slots__ = ("_scan", "_scanner", "_sniffed", "_where")

    def __init__(self, scanner: Scanner, where: str = "body") -> None:
        self._scanner = scanner
        self._where = where
        self._sniffed = Sniffed()
        self._scan: StreamScanner | None = None

    @property
    def pending(self) -> int:
        """The files' window not decided yet (in unpacked bytes: a compressed body's
        bytes that made them are fewer)."""
        return self._scan.pending if self._scan is not None else 0

    def feed(self, piece: bytes) -> ScanResult:
        if self._sniffed.decided and self._sniffed.unpacker is None:
            return _NOTHING  # (most bodies: no archive, after their first bytes)
        return self._read(piece, final=False)

    def end(self) -> ScanResult:
        return self._read(b"", final=True)

    def _read(self, piece: bytes, final: bool) -> ScanResult:
        try:
            files = self._sniffed.feed(piece, final)
        except EncodingError as exc:
            return ScanResult((), str(exc))
        if self._sniffed.unpacker is None:
            return _NOTHING
        if self._scan is None:
            self._scan = StreamScanner(self._scanner, where=f"{self._where} unpacked")
        found: list[Finding] = []
        for result in [*(self._scan.feed(data) for _, data in files),
                       *([self._scan.end()] if final else [])]:
            found += result.findings
            if result.unreadable is not None:
                return ScanResult(tuple(found), result.unreadable)
        return ScanResult(tuple(found))
