"""A compressed file in a base64 or hex run, read as the run streams (pure).

A body streamed past the hold limit may carry a file in a string: GitHub's contents and
blob APIs take base64, and a coding agent pushes a `.jar`, a `.whl` or a `.tar.gz` of
megabytes that way. What the file holds is nowhere in the run's characters. From where a
stream's check finds such a run start (the leak guard's `leak_readings.open_start`,
detection's `run_reading.stream_cut`), a `FollowedRun` decodes its characters as they
come into a `Sniffed` (`core/zip_entries.py`: the compressed file it is, a zip's
entries), whose files the check reads with a stream scan of its own each: a run of any
length is read once, in pieces, as a decoder reads it.

The run's characters are base64's (both alphabets) or hex's (said by its first: a
compressed file's base64 starts `H4sI`, `UEsDB`, `Qlpo`, `/Td6`, `KLUv`; its hex `1f8b`,
`504b`, `425a`, `fd37`, `28b5`); line breaks, as sent or JSON-escaped (`\\n`, `\\r\\n`), are
skipped as Go's, Python's, Node's and Ruby's decoders skip them, and a JSON `\\/` is a
`/`. The run ends at the first other byte (a quote, `=` padding).

What of the run may go on (`held`): the request side holds back the bytes whose files'
bytes the check has not decided yet. A raw byte's bits may be decoded only with the next
bytes (a deflate symbol across pieces, a bzip2 block of up to 900 kB), so the bytes of
a piece go once the files' bytes of the next piece that gave any are decided. A run that
gives nothing for `HELD` bytes (a deflate stream of empty blocks, spacing a key's halves
apart) is unreadable: its bytes would be held without bound.
"""

from __future__ import annotations

import binascii
import re

from gateway.core.archives import Allowance, Undecided, archive_kind
from gateway.core.zip_entries import Sniffed, local_header

__all__ = ["HEAD", "HELD", "HEX_FIRST", "HEX_HEAD", "File", "FollowedRun", "open_run",
           "signed_start"]

HELD = 4 * 1024 * 1024  # bytes of a run held back while they give nothing (a bzip2 block's
# base64 is 1.2 MB at most)
_BASE64 = re.compile(rb"[A-Za-z0-9+/_-]*+(?:(?:\\r\\n|\\n|\\/|\r?\n)[A-Za-z0-9+/_-]*+)*+")
_HEX = re.compile(rb"[0-9a-fA-F]*+(?:(?:\\r\\n|\\n|\r?\n)[0-9a-fA-F]*+)*+")
_SKIPPED = re.compile(rb"\\r\\n|\\n|\r?\n|\\(?=/)")  # (breaks; a `\/`'s backslash)
_PARTIAL = frozenset((b"\r", b"\\", b"\\r", b"\\r\\"))  # (a break cut by a piece's end)
# (a compressed file's first characters, base64 or hex: `leak_readings.ARCHIVE_MARKERS`)
_STARTS = (rb"H4sI|UEsDB|Qlpo|(?:\\/|[/_])Td6WFo|KLUv(?:\\/|[/_])"  # (a `/` JSON-escaped too)
           rb"|[UVWX][CSiy]pNG"  # (a zstd skippable frame)
           rb"|(?i:1f8b08|504b0304|425a68|fd377a585a00|28b52ffd|5[0-9a-f]2a4d18)")
HEAD = re.compile(_STARTS)
HEX_HEAD = re.compile(rb"(?i:1f8b08|504b0304|425a68|fd377a585a00|28b52ffd|5[0-9a-f]2a4d18)")
# (a zip's local header inside a run, after other bytes (`core/zip_entries.py`): its
# base64 from a 3-byte group's first byte, second or third, the group beginning 0, 1 or
# 3 characters before; its hex. A signature a line break cuts is not looked for here.)
_SIGNED = re.compile(rb"UEsDB|[FVl1]BLAw[QRST]|QSwME|(?i:504b0304)")
_HEXISH = re.compile(rb"[0-9a-fA-F]{1,11}")
_AFTER_BREAK = re.compile(rb"(?:\\r\\n|\\n|\r?\n)(?=" + _STARTS + rb")")
_RUN_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-\\\r\n"
_URLSAFE = bytes.maketrans(b"-_", b"+/")
File = tuple[int, str, bytes]  # (a file's number, its name, its next bytes)
HEX_FIRST = b"1245fF"  # (a compressed file's hex; its base64 starts with none of these)
_MAGIC = 6  # bytes that say what a compressed file is (`archive_kind`)


def signed_start(data: bytes | bytearray, at: int) -> int | None:
    """Where the group of a run's characters holding a zip's local header whose encoded
    signature is at `at` begins (`_SIGNED`), or None if none is there."""
    match = _SIGNED.match(data, at)
    if match is None:
        return None
    first = match.group()[:1]
    back = 3 if first == b"Q" else 0 if first in b"U5" else 1
    return at - back if at >= back else None


def open_run(data: bytes | bytearray, since: int = 0, cut: int | None = None) -> int | None:
    """Where a compressed file's run in `data` that goes on past `cut` (to `data`'s end
    where None: the stream may bring more of it) starts, if one does, at `since` or
    after (a start before was looked for in the data before); None if none; or where
    the group of it holding a zip's local header begins (`signed_start`: a run of an
    image that is also a zip, read from there). Its
    characters as `FollowedRun` reads them: base64 or hex, in lines or not, with JSON's
    `\\/` (PHP's `json_encode` and Java's writers escape every `/`: a run read only as
    the alphabet's characters in a row stopped at each)."""
    end = len(data) if cut is None else min(cut, len(data))
    if not end or data[end - 1] not in _RUN_BYTES:
        return None
    region = len(data[:end].rstrip(_RUN_BYTES))  # (the characters a run may have, to `end`)
    # (a run starts where the characters do, after a quote, a comma, a space; or after a
    # line break: a decoder reads a string from its start, not from inside a word)
    starts = [region] if HEAD.match(data, region) else []
    starts += [m.end() for m in _AFTER_BREAK.finditer(data, region, end)]
    starts += sorted(start for m in _SIGNED.finditer(data, region, end)
                     if (start := signed_start(data, m.start())) is not None)
    for start in starts:
        if start < since or start >= end:
            continue
        match = _BASE64.match(data, start)  # (hex's characters are base64's)
        assert match is not None
        reach = match.end()
        if reach > end or reach == len(data) or bytes(data[reach:]) in _PARTIAL:
            return start
    return None


class FollowedRun:
    """One run, fed as it streams (`feed`, then `end` at the stream's end): the files'
    bytes it unpacks to, each with its number and name (`Sniffed`: `gzip file`, `zip
    entry .env`), within the stream's `allowance` (EncodingError past it). `ended`: the
    run is over (or is no compressed file), `taken` of the last piece's bytes were its;
    `live()`: the files still being read."""

    __slots__ = ("_allowance", "_carry", "_files", "_head", "_hex", "_waiting", "ended",
                 "kind", "taken", "undecided")

    def __init__(self, allowance: Allowance) -> None:
        self._allowance = allowance
        self._hex: bool | None = None  # (said by the run's first character)
        self._carry = b""  # (characters of a group not whole yet; a break cut in two)
        self._waiting = b""  # (a break's first bytes, at a piece's end)
        self._head = bytearray()  # (the first decoded bytes, fewer than a magic's)
        self._files: Sniffed | None = None
        self.undecided = Undecided()  # (of the run's bytes: what may go on)
        self.ended = False
        self.taken = 0
        self.kind = ""  # (what compressed file: `archive_kind`, once its bytes say)

    @property
    def out(self) -> int:
        """Bytes the run's files gave."""
        return self.undecided.out

    @property
    def raw(self) -> int:
        """Bytes of the run read."""
        return self.undecided.raw

    @property
    def encoding(self) -> str:
        """`base64` or `hex`."""
        return "hex" if self._hex else "base64"

    def live(self) -> frozenset[int]:
        """The numbers of the files still being read."""
        return self._files.live() if self._files is not None and not self.ended \
            else frozenset()

    def feed(self, data: bytes) -> list[File]:
        """The files' bytes that `data`, the stream's next bytes, adds; `ended` once
        the run stops in it (`taken`: its bytes that were the run's)."""
        if self.ended:
            self.taken = 0
            return []
        if self._hex is None and data:  # (a start inside a run, `signed_start`, may be
            self._hex = data[:1] in HEX_FIRST and (  # any character: its magic says)
                HEX_HEAD.match(data) is not None or _HEXISH.fullmatch(data[:12]) is not None)
        data = self._waiting + data if self._waiting else data
        before = len(self._waiting)
        match = (_HEX if self._hex else _BASE64).match(data)
        assert match is not None  # (`*+`: matches the empty string)
        end = match.end()
        rest = data[end:]
        self._waiting = rest if rest in _PARTIAL else b""
        stopped = bool(rest) and not self._waiting
        self.taken = end - before + len(self._waiting) if not stopped else max(end - before, 0)
        chars = data[:end]
        if b"\n" in chars or b"\\" in chars:
            chars = _SKIPPED.sub(b"", chars)
        files = self._decode(self._carry + chars, final=stopped)
        self.undecided.fed(self.taken, sum(len(piece) for _, _, piece in files))
        if self._files is not None and not self._files.reading:
            self.undecided.settle()  # (no file being read: its bytes give no more)
        if stopped:
            self.ended = True
        return files

    def end(self) -> list[File]:
        """The stream ended: the run's last characters (padding taken as read)."""
        if self.ended:
            return []
        self.ended = True
        files = self._decode(self._carry, final=True)
        self.undecided.fed(0, sum(len(piece) for _, _, piece in files))
        return files

    def held(self, decided: int) -> int:
        """Bytes of the run (its last) not to go on yet, where the first `decided`
        bytes its files gave are read (`archives.Undecided`)."""
        return self.undecided.held(decided)

    def _decode(self, chars: bytes, final: bool) -> list[File]:
        """`chars` decoded, whole groups (at the end all, padded as a decoder pads
        them), and unpacked; the rest carried to the next piece."""
        if self._hex:
            whole = len(chars) // 2 * 2
            data = binascii.unhexlify(chars[:whole])
        else:
            whole = len(chars) // 4 * 4
            part = chars[:whole] if not final or len(chars) % 4 == 1 else chars
            data = binascii.a2b_base64(part.translate(_URLSAFE) + b"=" * (-len(part) % 4))
        self._carry = b"" if final else chars[whole:]
        return self._unpacked(data, final)

    def _unpacked(self, data: bytes, final: bool) -> list[File]:
        """What `data`, the run's next bytes, unpacks to (its first bytes say whether it
        is a compressed file: `archive_kind`; a zip's entries are read wherever they are
        in it)."""
        if self._files is None:
            self._head += data
            if len(self._head) < _MAGIC and not final:
                return []
            head = bytes(self._head[:_MAGIC])
            kind = archive_kind(head) or ("zip" if local_header(head) >= 0 else None)
            if kind is None:
                self.ended = True  # (no compressed file: nothing to unpack)
                return []
            self._files, self.kind = Sniffed(self._allowance), kind
            data, self._head = bytes(self._head), bytearray()
        files = self._files
        return [(number, files.name(number), piece)
                for number, piece in files.feed(data, final)] if data or final else []
