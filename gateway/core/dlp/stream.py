"""The scan of a body too large to hold: chunk by chunk, a window kept across chunks.

Each chunk is decoded (gzip, deflate, br, zstd as they stream, `core/encodings.py`) and
appended to the tail kept from the previous chunks. The window is scanned as one text;
a value is reported by the window it
starts in, provided at least `keep` characters follow it (the longest reach of any
detector), else the next window reports it: a key split across two chunks, or across
WebSocket fragments fed one by one, is found once and whole. Where a base64 or hex run
crosses the cut, the cut moves back to a multiple of 4 characters from the run's start,
so the run decodes in the next window at its own alignment. Offsets count characters of
the decoded stream. Findings are reported once per (detector, fingerprint) (the first
`SEEN` of them remembered: a hostile body of millions of distinct keys holds no more).

A body whose reader decodes it from UTF-16, UTF-32 or another charset ASCII is not its
own bytes in (its `Content-Type`'s charset, or a byte-order mark or a JSON reader's
sniffing of its first bytes: `decoding.text_codec`, `json_codec`) is transcoded to UTF-8
as it streams, so the window holds what the receiver reads; a charset without a codec
is unreadable. A JSON or form body's window holding an escape is also read with its
escapes undone, as the held body's reading undoes them (`prefilter.reader_texts`).

The window is kept as bytes and scanned `STEP` new characters at a time: a window without
an anchor and without 20 base64 characters in a row (most of a large upload) costs one
C-speed pass (`Prefilter.candidate`) and nothing else, no text made of it.

A streamed request body is also read by the leak guard, chunk by chunk: one pass of the
gate per chunk (`fastscan.ChunkPass`) answers both, `feed(chunk, flags)` taking its
answer. A window in which no chunk with a run or an anchor ends holds neither (each one
in it ends in one of its chunks), so its pass is not made; any other window is scanned
as without the answer. The answer is for the chunk's bytes as they are: a window holding
something else (transcoded, decoded here) or a detector without anchors (every window a
candidate) does not take it.
"""

from __future__ import annotations

import codecs
from itertools import chain

from gateway.core import encodings
from gateway.core.archives import Allowance
from gateway.core.dlp.archive_views import UNPACKED, Sharing
from gateway.core.dlp.decoding import Unreadable, body_kind, json_codec, text_codec
from gateway.core.dlp.fastscan import (
    BACKSLASH,
    ESCAPES_KNOWN,
    FOUND,
    PERCENT,
    PLUS,
    ChunkPass,
)
from gateway.core.dlp.files import Files, Key
from gateway.core.dlp.findings import Finding, Location, ScanResult
from gateway.core.dlp.multipart import StreamedParts, boundary
from gateway.core.dlp.prefilter import reader_texts
from gateway.core.dlp.run_reading import near_cut, stream_cut
from gateway.core.dlp.scanner import Scanner
from gateway.core.dlp.window import Window
from gateway.core.framing import reader_for
from gateway.core.streamed_runs import HELD, FollowedRun, open_run
from gateway.core.zip_entries import NO_SIGNATURE

__all__ = ["StreamScanner"]

MIN_KEEP = 4096
STEP = 64 * 1024  # new characters scanned at a time (at least: the window kept rescanned)
_WIDEST = 5  # bytes of a transcoded charset a byte of its UTF-8 may come from (UTF-7's "+AF8-")
_NO_LIMIT = 1 << 62  # a streamed body is not held: its decoded size is not bounded here
_SNIFF = 4  # bytes the first reading needs: a UTF-32 BOM, a JSON reader's NULs (RFC 4627)
SEEN = 1024  # distinct findings a stream remembers (to report each once): a body of
# millions of distinct keys holds no more than this (the caller bounds what it records)


class StreamScanner:
    """Feed chunks, then `end()`; each call returns the findings new since the last."""

    def __init__(self, scanner: Scanner, content_encoding: str | None = None,
                 where: str | Location = "body", content_type: str | None = None,
                 unpack: bool = False, allowance: Allowance | None = None) -> None:
        """`unpack`: a request body, read unpacked too where it, or a multipart part
        of it, is an archive (`files.Files`; an answer is not). `where`: the part
        findings are in, or their place (a run's file: `_followed`)."""
        self._scanner = scanner
        self._where = where if isinstance(where, Location) else Location(where)
        self.keep = max(MIN_KEEP, scanner.reach + 64)
        self._window = Window()
        self._base = 0
        # (what its runs may unpack to: `feed` grows it; an archive's files share their
        # body's, not grown by what they unpack to)
        self._allowance, self._grows = allowance or Allowance(0), allowance is None
        # (a compressed file's run crossing a cut, followed as it streams: its file's
        # scanner and name; not within a run's file, one level)
        self._follow: FollowedRun | None = None
        self._run_files: dict[int, StreamScanner] = {}
        self._seen: set[tuple[str, str]] = set()
        self.unreadable: str | None = None
        self._decoder: encodings.Decoder | None = None
        self._ctype = (content_type or "").lower()
        self._charset: codecs.IncrementalDecoder | None = None
        self._sniffed = False  # (the first bytes looked at for a byte-order mark)
        self._early = b""  # (the first bytes, while fewer than a sniff reads: `_text`)
        self._parts: StreamedParts | None = None  # (a multipart body's part heads)
        # (a request body, or its parts, that are archives: their files, `files.Files`)
        self._files: Files | None = None
        # (the files being read, each number's with the gate's pass over them)
        self._files_scan: dict[Key, tuple[StreamScanner, ChunkPass]] = {}
        self._frames = reader_for(content_type)  # (gRPC, a git push: its messages)
        self._kind = "text"  # (a JSON or form body: its escapes undone too, `_scan`)
        # where, in the stream, the last chunk the shared pass found something in ends
        # (`feed`'s `flags`; _NO_LIMIT: every window is scanned)
        self._hit = 0 if not scanner.prefilter.unanchored else _NO_LIMIT
        try:  # (read as text: a part's coding or charset it cannot undo is refused)
            delimiter = boundary(content_type or "") if "multipart/" in self._ctype else None
            self._parts = StreamedParts(delimiter) if delimiter is not None and \
                not unpack else None
            self._files = Files(delimiter, check=True) if unpack and \
                self._frames is None else None
        except Unreadable as exc:
            self.unreadable = str(exc)
        try:
            self._decoder = encodings.decoder_for(content_encoding, _NO_LIMIT)
        except encodings.EncodingError as exc:
            self.unreadable = str(exc)

    @property
    def pending(self) -> int:
        """Characters at the end of the stream not decided yet: a caller that forwards
        the stream as it goes holds back at least these (for a body with no content
        coding, characters are bytes; a transcoded one counts what the window's UTF-8
        may have come from, at most `_WIDEST` bytes a byte, and the decoder's tail)."""
        if self._bare():
            return self._window.size + len(self._early)  # (most streams: their window)
        held = self._frames.pending + 5 if self._frames is not None else 0
        files = self._files
        if files is not None:  # (an archive's bytes whose files are not read yet)
            undecided = files.undecided
            held = max(held, undecided.held(undecided.out - sum(
                scan.pending for scan, _ in self._files_scan.values())))
        held = max(held, self._run_held())
        if self._charset is None:
            return len(self._window) + len(self._early) + held
        return (len(self._window) + 4) * _WIDEST + held

    def feed(self, chunk: bytes, flags: int | None = None) -> ScanResult:
        """Scan one chunk (with the window kept from the ones before). `flags`: the
        shared pass's answer for `chunk` (`fastscan.ChunkPass` over this scanner's
        gate, with its escapes), None if not asked (see the module docstring)."""
        if self.unreadable is not None:
            return ScanResult((), self.unreadable)
        self._allowance.grow(len(chunk) if self._grows else 0)
        try:
            pieces = list(self._decoder.feed(chunk)) if self._decoder else [chunk]
            if self._frames is not None:  # (a gRPC body: its messages)
                pieces = [m for piece in pieces for m in self._frames.feed(piece)]
        except encodings.EncodingError as exc:
            self.unreadable = str(exc)
            return ScanResult((), self.unreadable)
        found: list[Finding] = []
        for piece in pieces:
            if self._parts is not None:
                try:
                    self._parts.feed(piece)
                except Unreadable as exc:
                    self.unreadable = str(exc)
                    return ScanResult((), self.unreadable)
            if self._files is not None and not self._files.skips(piece):
                try:  # (a body, or a part, that holds files: unpacked)
                    found += self._unpacked(self._files.feed(piece))
                except (Unreadable, encodings.EncodingError) as exc:
                    self.unreadable = str(exc)
                    return ScanResult((), self.unreadable)
            piece = self._text(piece, final=False)
            if self.unreadable is not None:
                return ScanResult((), self.unreadable)
            self._window.add(piece)
            if self._follow is not None:
                found += self._followed(piece)
                if self.unreadable is not None:
                    return ScanResult((), self.unreadable)
            if flags is None or self._decoder is not None or self._charset is not None \
                    or self._frames is not None:
                self._hit = _NO_LIMIT  # (not the chunk's bytes: scanned as before)
            elif flags & FOUND or flags & _HIDING[self._kind] or not flags & ESCAPES_KNOWN:
                # (a JSON or form body's escape may hide an anchor or a run: `_scan`)
                self._hit = max(self._hit, self._base + len(self._window))
            if len(self._window) >= self.keep + max(self.keep, STEP):
                found += self._scan(final=False)
        return ScanResult(tuple(found), self.unreadable)

    def _bare(self) -> bool:
        """Read as its bytes past its decoder: no charset, framing, followed run, files."""
        files = self._files
        return self._charset is None and self._frames is None and self._follow is None \
            and (files is None or (not files.reading and not self._files_scan))

    def passes(self, chunk: bytes, flags: int) -> bool:
        """`feed` for a piece the shared pass found nothing in (no anchor, run or escape
        that may hide one; `flags` as `feed`'s), of a stream read as its bytes (`_bare`,
        no coding, no parts) with nothing found before it left to scan: the piece joins
        the window, which lets go of what it need not keep, with no scan or result made
        (most pieces of a large upload). False, having done nothing, for any other."""
        if flags & FOUND or flags & _HIDING[self._kind] or not flags & ESCAPES_KNOWN \
                or self._hit > self._base or not self._sniffed or self._early \
                or self._decoder is not None or self._parts is not None \
                or not self._bare() or (self._files is not None and not self._files.skips(
                    chunk, bool(flags & NO_SIGNATURE))):
            return False  # (`skips` last: it takes the chunk where it says True)
        self._allowance.grow(len(chunk) if self._grows else 0)
        window = self._window
        window.add(chunk)
        if window.size >= self.keep + max(self.keep, STEP):
            cut = window.size - self.keep
            window.drop(cut)
            self._base += cut
        return True

    def end(self) -> ScanResult:
        """Scan what is left at the end of the stream."""
        if self.unreadable is not None:
            return ScanResult((), self.unreadable)
        try:
            rest = list(self._decoder.end()) if self._decoder else []
            if self._frames is not None:
                rest = [m for piece in rest for m in self._frames.feed(piece)]
                self._frames.end()
        except encodings.EncodingError as exc:
            self.unreadable = str(exc)
            return ScanResult((), self.unreadable)
        self._window.add(self._text(b"".join(rest), final=True))
        found: list[Finding] = []
        if self._files is not None:
            try:
                found = self._unpacked(self._files.feed(b"", final=True), final=True)
            except (Unreadable, encodings.EncodingError) as exc:
                self.unreadable = str(exc)
        if self.unreadable is not None:
            return ScanResult((), self.unreadable)
        found += self._scan(final=True)
        if self._follow is not None and self.unreadable is None:
            found += self._followed(b"", final=True)
        return ScanResult(tuple(found), self.unreadable)

    def _unpacked(self, files: list[tuple[Key, bytes]], final: bool = False
                  ) -> list[Finding]:
        """The files of the body (part 0) or of a multipart body's parts, each file's
        read by a stream scanner of its own (`body unpacked at offset N`, `body part 2
        unpacked at offset N`), ended when it is."""
        found: list[Finding] = []
        for key, data in files:
            reading = self._files_scan.get(key)
            if reading is None:
                number = key[0]
                reading = self._files_scan[key] = (StreamScanner(self._scanner, where=(
                    f"{self._where.part} part {number} unpacked" if number else
                    f"{self._where.part} unpacked"), allowance=self._allowance), ChunkPass(
                        self._scanner.prefilter.gate))
            scan, gate = reading  # (the gate's one pass says which windows to read)
            found += self._scanned(scan.feed(data, gate.flags(data, escapes=True)))
        # (a file ended: read to its end now, not at the body's, so that the body's
        # bytes after it are not held back)
        live = self._files.live() if not final and self._files is not None else set()
        for key in [key for key in self._files_scan if key not in live]:
            found += self._scanned(self._files_scan.pop(key)[0].end())
        return found

    def _run_held(self) -> int:
        """Characters of a followed run whose files' bytes are not decided yet."""
        follow = self._follow
        if follow is None:
            return 0
        return follow.held(follow.out - sum(file.pending for file in self._run_files.values()))

    def _run_end(self, live: frozenset[int] = frozenset()) -> list[Finding]:
        """The end of the followed run's files being read, but those still `live`."""
        found: list[Finding] = []
        for number in [number for number in self._run_files if number not in live]:
            found += self._scanned(self._run_files.pop(number).end())
        return found

    def _scanned(self, result: ScanResult) -> tuple[Finding, ...]:
        if result.unreadable is not None:
            self.unreadable = result.unreadable
        return result.findings

    def _text(self, piece: bytes, final: bool) -> bytes:
        """`piece` as its reader reads it: itself, or transcoded to UTF-8 (see the module
        docstring). The codec is chosen at the first non-empty piece."""
        if not self._sniffed and (piece or final):
            if len(self._early) + len(piece) < _SNIFF and not final:
                # (a first piece of 1-3 bytes cannot show a UTF-32 BOM or a JSON
                # reader's NULs: held until it can; the next piece's flags cover it,
                # `ChunkPass` reading the seam)
                self._early += piece
                return b""
            piece, self._early = self._early + piece, b""
            self._sniffed = True
            try:
                codec = text_codec(piece, self._ctype)
                self._kind = body_kind(piece, self._ctype)
                if self._kind == "form" and body_kind(piece, "") == "json":
                    self._kind = "either"  # (a JSON document sent as a form: `reader_texts`)
                if codec == "latin-1" and self._kind == "json":
                    codec = json_codec(piece)
            except Unreadable as exc:
                self.unreadable = str(exc)
                return b""
            if codec != "latin-1":
                self._charset = codecs.getincrementaldecoder(codec)("replace")
        if self._charset is None:
            return piece
        try:
            return self._charset.decode(piece, final).encode("utf-8", "surrogatepass")
        except UnicodeError as exc:  # (a UTF-16 stream without its byte-order mark)
            self.unreadable = f"the body cannot be read in its charset: {exc}"
            return b""

    def _scan(self, final: bool) -> list[Finding]:
        window = self._window
        cut = len(window) if final else len(window) - self.keep
        if self._hit <= self._base or not any(self._scanner.prefilter.candidate(
                window.read(), kind) for kind in _KINDS.get(self._kind, (self._kind,))):
            # Most windows: no anchor and no base64 run, no finding and no run to cut
            # by (what `text_hits` starts with, in one pass on the bytes as they are).
            window.drop(cut)
            self._base += cut
            return []
        text = window.read().decode("latin-1")
        where = self._where
        where = Location(where.part, where.name, self._base, where.via)
        raw = window.read()
        # (a compressed file's run crossing the cut: followed as it streams)
        start = open_run(raw, 0, cut) if not final and self._follow is None and \
            UNPACKED not in where.via else None
        try:  # (read now: a text the scan gives up on is unreadable, `Rule.spans`)
            if not final and near_cut(text, cut):  # (a run carried over starts at 0)
                cut = stream_cut(text, cut)
            found = self._found(text, where, cut)
        except Unreadable as exc:
            self.unreadable = str(exc)
            return []
        if start is not None:
            self._follow = FollowedRun(self._allowance)  # (its start is in the text kept)
            found += self._followed(bytes(raw[start:]))
        return found

    def _followed(self, data: bytes, final: bool = False) -> list[Finding]:
        """The followed run's next characters (`data`): its files' bytes read, each file
        by a scanner of its own (`body gzip file at offset N (in base64, archive)`: N in
        the file), ended with the run."""
        follow = self._follow
        assert follow is not None
        try:
            files = follow.end() if final else follow.feed(data)
        except encodings.EncodingError as exc:
            self.unreadable = str(exc)
            return []
        found: list[Finding] = []
        for number, name, piece in files:
            file = self._run_files.get(number)
            if file is None:
                at = self._where
                file = self._run_files[number] = StreamScanner(self._scanner, where=Location(
                    at.part, name, None, (*at.via, follow.encoding, UNPACKED)),
                    allowance=self._allowance)
            found += self._scanned(file.feed(piece))
        found += self._run_end(follow.live())
        if follow.ended:
            self._follow = None
        elif self._run_held() > HELD:
            self.unreadable = (f"a compressed file in a base64 or hex run that gives nothing "
                               f"for {HELD} bytes")
        return found

    def _found(self, text: str, where: Location, cut: int) -> list[Finding]:
        """The findings new in the window's text (those starting before `cut`), the
        window then let go up to `cut`."""
        hits = self._scanner.text_hits(text, where)
        for plain in reader_texts(text, self._kind):
            # A JSON or form body as its reader reads it too: `\\u0067hp_...` and
            # `%67hp_...` are `ghp_...` (offsets in that text are at most the stream's: a
            # value reported early is reported once, by its fingerprint).
            hits = chain(hits, self._scanner.text_hits(plain, where))
        out: list[Finding] = []
        with Sharing(self._allowance):  # (the stream's runs unpacked: one bound)
            found = self._scanner.findings(h for h in hits if h.location.offset is None
                                           or h.location.offset - self._base < cut)
        for finding in found:
            key = (finding.detector, finding.fingerprint)
            if key not in self._seen:
                if len(self._seen) < SEEN:  # (past it: reported again, never held)
                    self._seen.add(key)
                out.append(finding)
        self._window.drop(cut)
        self._base += cut
        return out


_HIDING = {"json": BACKSLASH, "form": PERCENT | PLUS,  # (a chunk's escapes, by kind)
           "either": BACKSLASH | PERCENT | PLUS, "text": BACKSLASH}
# (the readings a window is a candidate by: a text's JSON escapes are undone too)
_KINDS = {"either": ("json", "form"), "text": ("text", "json")}
