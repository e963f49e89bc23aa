"""The request body of an exchange, scanned for keys and tokens as it goes: streamed, the
tail of each chunk that could start a marker held back until the next shows it clean; a
compressed body decoded for the scan (and forwarded as sent, once whole, up to
`ENCODED_LIMIT`); a whole body decoded once, for the body stage to read. A streamed body
also goes through outbound credential detection (`exchange_dlp.DlpCheck`, a rule with
`dlp:`), which holds back what it has not decided yet; a whole one is detected by the
exchange, once decoded. A gRPC body is read as its messages, a git push as its ref
updates and objects (`core/framing.py`: a compressed message decompressed, an object
inflated; its raw bytes held back until it is read); a body that is a compressed file
or holds a zip's entries (a `.tar.gz`, a `.zip`, an image that is also one:
`core/archives.py`, `core/zip_entries.py`) is read as it is and its files unpacked."""

from __future__ import annotations

from collections import deque

from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.fastscan import RUN
from gateway.core.dlp.files import Files, Key
from gateway.core.dlp.multipart import boundary
from gateway.core.encodings import Decoder, EncodingError, decoder_for
from gateway.core.framing import MessageReader, framing
from gateway.core.leaks import StreamScan
from gateway.core.refusal import Refusal
from gateway.core.zip_entries import NO_SIGNATURE, last_bytes, quiet
from gateway.pipeline.exchange_state import ExchangeState

__all__ = ["ENCODED_LIMIT", "RequestSide"]

ENCODED_LIMIT = 8 * 1024 * 1024  # a compressed request body is held whole up to this size


def _archives(content_type: str | None) -> Files | None:
    """What reads the files a multipart body's parts hold, each maybe a compressed file
    or holding a zip's entries (`dlp.files.Files`); None for another body (read by a
    `Files` made at its first piece that is not `zip_entries.quiet`)."""
    try:
        delimiter = boundary(content_type) if content_type and \
            "multipart/" in content_type.lower() else None
    except Unreadable:  # (two boundaries: detection refuses it; the leak scan reads its
        delimiter = None  # bytes, and the files the body holds as a whole)
    return Files(delimiter) if delimiter is not None else None


def _unreadable(exc: EncodingError) -> Refusal:
    return Refusal("bad_request", f"the request body cannot be checked: {exc}")


class RequestSide:
    """The request body's way out (see the module docstring)."""

    def __init__(self, ex: ExchangeState) -> None:
        self.ex = ex
        self._scan: StreamScan | None = None
        self._decoder: Decoder | None = None
        self._encoded: list[bytes] | None = None
        self._held: deque[bytes] = deque()  # the tail held back, as it came
        self._held_size = 0
        self._frames: MessageReader | None = None  # (gRPC, a git push: its messages)
        self._typed = False  # (whether the body's Content-Type was read for it)
        self._type: str | None = None  # (the type it is read by, once read: `_body_type`)
        # (the files a body, or a multipart body's parts, hold: each read by a leak scan
        # of its own)
        self._archives: Files | None = None
        self._quiet: tuple[bytes, int] | None = None  # (a body read so far with none:
        self._files: dict[Key, StreamScan] = {}  # its last 3 bytes and its size)

    def _scanner(self) -> StreamScan:
        if self._scan is None:
            assert self.ex.scan is not None
            self._scan = self.ex.scan.stream()
            try:
                self._decoder = decoder_for(self.ex.head.headers.joined("content-encoding"))
            except EncodingError as exc:
                raise Refusal("bad_request", f"the request body cannot be checked: {exc}; "
                              "send it uncompressed or with gzip, deflate or br") from None
            if self._decoder is not None:
                self._encoded = []
        return self._scan

    def _check(self, scanner: StreamScan, data: bytes, streamed: bool = True) -> None:
        """The leak scan, then (a body streamed) outbound credential detection and the
        content its policy exports (decoded: as the receiver reads it)."""
        # One gate pass for both checks: a whole body's is the leak guard's run check,
        # whose answer detection then takes for the same body; a streamed one's is made
        # per piece (`DlpCheck.passed`), the leak guard taking its run, detection all.
        dlp = self.ex.dlp
        if not self._typed and data:  # (at the first bytes: a bodiless request never asks)
            self._typed = True
            self._type = self.ex.body_type
            # (any of its types: a server may read the body by a second one)
            readers = set(map(framing, self.ex.body_types()))
            readers.discard(None)
            if len(readers) > 1:  # (gRPC-Web's text and binary forms, a git push: which?)
                raise _unreadable(EncodingError(
                    "its Content-Types name two framings (gRPC's binary and text forms, "
                    "a git push)"))
            made = readers.pop() if readers else None
            self._frames = made() if made is not None else None
            if self._frames is None:  # (the files a body holds read too)
                self._archives = _archives(self.ex.head.headers.get("content-type"))
                self._quiet = (b"", 0) if self._archives is None else None
        if self._frames is not None:  # (gRPC, a git push: the messages are read, `framing`)
            self._messages(scanner, data, streamed)
            return
        flags = dlp.passed(data) if dlp is not None and streamed else None
        found = scanner.feed(data, dlp.gate if dlp is not None and not streamed else None,
                             None if flags is None else bool(flags & RUN), flags or 0)
        if found is not None:
            raise self.ex.leak(found)
        searched = flags is not None and bool(flags & NO_SIGNATURE)
        quiet_so_far = self._quiet
        if quiet_so_far is not None:  # (no reader of its files made yet: most bodies)
            tail, seen = quiet_so_far
            if quiet(data, tail, seen, searched):
                self._quiet = (last_bytes(tail, data), seen + len(data))
            else:  # (a piece that may hold one: its reader, begun after what held none)
                self._archives = Files(None, after=quiet_so_far if seen else None)
                self._quiet = None
        if self._archives is not None and not self._archives.skips(data, searched):
            self._unpacked(self._archives, data)
        self._detected(data, flags, streamed)

    def _detected(self, data: bytes, flags: int | None, streamed: bool) -> None:
        """A piece, read by the leak scan, to detection and the content export (a body
        streamed)."""
        dlp = self.ex.dlp
        if dlp is not None and streamed:
            dlp.feed(data, self._body_type(), flags)
        if streamed and self.ex.content is not None:
            self.ex.content.request(data, self.ex.head.headers.get("content-type"), whole=False)

    def _body_type(self) -> str | None:
        """The Content-Type the body is read by (`ExchangeState.body_type`), read once at
        its first bytes rather than at every piece."""
        return self._type if self._typed else self.ex.body_type

    def _messages(self, scanner: StreamScan, data: bytes, streamed: bool) -> None:
        """A piece of a body read by its messages (gRPC, a git push): the leak scan
        reads its messages (decompressed, inflated), detection the piece (its scanner
        reads the messages itself)."""
        assert self._frames is not None
        try:
            messages = self._frames.feed(data)
        except EncodingError as exc:
            raise _unreadable(exc) from None
        for message in messages:
            found = scanner.feed(message)
            if found is not None:
                raise self.ex.leak(found)
        if self.ex.dlp is not None and streamed:
            self.ex.dlp.feed(data, self._body_type())
        if streamed and self.ex.content is not None:
            self.ex.content.request(data, self.ex.head.headers.get("content-type"), whole=False)

    def _unpacked(self, archives: Files, data: bytes, final: bool = False) -> None:
        """The files a body, or a multipart body's part, holds (`core/archives.py`,
        `core/zip_entries.py`): each unpacked, read by a leak scan of its own (a token in
        a `.env` of an uploaded `.tar.gz`), ended when it is."""
        try:
            files = archives.feed(data, final)
        except (EncodingError, Unreadable) as exc:  # (a bomb; a part head past its bound)
            raise _unreadable(EncodingError(str(exc))) from None
        for key, piece in files:
            scan = self._files.get(key)
            if scan is None:
                assert self.ex.scan is not None
                scan = self._files[key] = self.ex.scan.stream(  # (its runs: the body's
                    self._scanner().allowance)  # bound, one level)
            found = scan.feed(piece)
            if found is not None:
                raise self.ex.leak(found)
        live = archives.live() if not final else set()
        ended = [key for key in self._files if key not in live]
        self._ended(*(self._files.pop(key) for key in ended))  # (read to their end)

    def _archive_held(self) -> int:
        """The last bytes of an archive body (or part) whose files are not read yet
        (`archives.Undecided`: what the files' scan has not decided)."""
        archives = self._archives
        if archives is None or archives.idle:
            return 0  # (nothing being read: nothing held for it)
        undecided = archives.undecided
        return undecided.held(undecided.out - sum(
            scan.pending for scan in self._files.values()))

    def _ended(self, *scans: StreamScan | None) -> None:
        """The end of what `scans` read: a compressed run they follow, read to its end."""
        for scan in scans:
            found = scan.end() if scan is not None else None
            if found is not None:
                raise self.ex.leak(found)

    def _frames_end(self) -> None:
        if self._archives is not None and not self._archives.idle:  # (a body of fewer
            self._unpacked(self._archives, b"", final=True)  # bytes than a magic's, or
            # a file's end)
        self._ended(self._scan, *self._files.values())
        if self._frames is not None:
            try:
                self._frames.end()
            except EncodingError as exc:
                raise _unreadable(exc) from None

    def _trailers(self, trailers: list[tuple[bytes, bytes]] | None) -> None:
        """Trailers are scanned like headers."""
        if trailers:
            assert self.ex.scan is not None
            found = self.ex.scan.head("", "", trailers)
            if found is not None:
                raise self.ex.leak(found)
            if self.ex.dlp is not None:
                self.ex.dlp.trailers(trailers)

    def feed(self, chunk: bytes) -> bytes:
        """Scan a streamed chunk; returns the bytes that may go upstream now."""
        scanner = self._scanner()
        if self._decoder is not None:
            assert self._encoded is not None
            self._encoded.append(chunk)
            if sum(map(len, self._encoded)) > ENCODED_LIMIT:
                raise Refusal("bad_request", f"a compressed request body over "
                              f"{ENCODED_LIMIT} bytes cannot be checked; send it "
                              "uncompressed")
            try:
                for piece in self._decoder.feed(chunk):
                    self._check(scanner, piece)
            except EncodingError as exc:
                raise _unreadable(exc) from None
            return b""
        self._check(scanner, chunk)
        # (a compressed run's, or an archive's, bytes whose files are not read yet)
        keep = max(self.ex.scan.keep, scanner.held_back, self._archive_held()) \
            if self.ex.scan is not None else 0
        if self._frames is not None:  # (a message's prefix or compressed bytes not read)
            keep += self._frames.pending + 5
        if self.ex.dlp is not None:  # (what the detection has not decided stays too)
            keep = max(keep, self.ex.dlp.pending)
        out = self._release(chunk, keep)
        self.ex.bytes_out += len(out)
        return out

    def _release(self, chunk: bytes, keep: int) -> bytes:
        """`chunk` added to the held tail; what is now beyond the last `keep` bytes goes.
        The tail is kept as the chunks came (each byte copied once on its way out, not
        once per chunk: detection may hold back tens of KiB); a chunk's part that goes is
        joined from a view of it, not sliced first (a 256 KiB piece was copied twice)."""
        held = self._held
        held.append(chunk)
        self._held_size += len(chunk)
        release = self._held_size - keep
        if release <= 0:
            return b""
        out: list[bytes | memoryview] = []
        self._held_size = keep
        while release:
            first = held[0]
            if len(first) <= release:
                out.append(held.popleft())
                release -= len(first)
            else:
                out.append(memoryview(first)[:release])  # (released by the join below)
                held[0] = first[release:]
                release = 0
        return b"".join(out)

    def end(self, trailers: list[tuple[bytes, bytes]] | None) -> bytes:
        """The end of a streamed body; returns what was held back."""
        scanner = self._scanner()
        if self._decoder is not None:
            try:
                for piece in self._decoder.end():
                    self._check(scanner, piece)
            except EncodingError as exc:
                raise _unreadable(exc) from None
        self._frames_end()
        if self.ex.dlp is not None:
            self.ex.dlp.end()
        self._trailers(trailers)
        if self._encoded is not None:
            out = b"".join(self._encoded)
            self._encoded = []
        else:
            out = b"".join(self._held)
            self._held.clear()
            self._held_size = 0
        self.ex.bytes_out += len(out)
        return out

    def whole(self, body: bytes, trailers: list[tuple[bytes, bytes]] | None,
              limit: int) -> tuple[bytes | None, bool]:
        """Scan a whole body (decoded if compressed): (the body as the receiver reads
        it, or None when it decodes to more than `limit`: then it is only scanned, by
        outbound credential detection too, as a streamed body is, `_streamed`; and
        whether it was encoded)."""
        scanner = self._scanner()
        decoder = self._decoder
        if decoder is None:
            self._check(scanner, body, streamed=False)
            self._frames_end()
            self._trailers(trailers)
            return body, False
        pieces: list[bytes] = []
        size = 0
        try:
            for source in (decoder.feed(body), decoder.end()):
                for piece in source:
                    self._check(scanner, piece, streamed=False)
                    size += len(piece)
                    if size <= limit:
                        pieces.append(piece)
                    else:  # (past the hold limit decoded: read as it decodes)
                        self._streamed(pieces, piece)
                        pieces = []
        except EncodingError as exc:
            raise _unreadable(exc) from None
        self._frames_end()
        if size > limit and self.ex.dlp is not None:
            self.ex.dlp.end()
        self._decoder, self._encoded = None, None
        self._trailers(trailers)
        return (b"".join(pieces) if size <= limit else None), True

    def _streamed(self, before: list[bytes], piece: bytes) -> None:
        """A held coded body that decodes past the hold limit: outbound credential
        detection reads it as a streamed body's (on every engine: one that streamed
        it read it so; until the twenty-first session HTTP/1, which held it, refused
        it unread); `before`: its first pieces, not read yet."""
        dlp = self.ex.dlp
        if dlp is None:
            return
        for data in (*before, piece):
            dlp.feed(data, self._body_type(), dlp.passed(data))
