"""What the leak guard reads of data beyond its bytes as they are (pure): base64 written in
lines, and base64 or hex runs that are a compressed file.

* **Lines.** `base64`, `openssl`, PEM and MIME write base64 in lines of 64 or 76
  characters, and Go's, Python's, Node's and Ruby's decoders skip the breaks: a marker
  (a token's or a key's base64) cut by a break is in no line. Each block of such lines
  (a line of 20 characters or more, a break, the next line, and on; the break as the
  bytes are or JSON-escaped, `\\n` or `\\r\\n`) is read again joined (`joined`).
* **Compressed runs.** A run that decodes to a gzip, bzip2, xz or zstd file or a zip archive (a
  file sent in a JSON string, as GitHub's contents API takes it) holds what it
  compresses nowhere in its bytes: where the markers' pass saw the start of one
  (`ARCHIVE_MARKERS`, found in the same pass), or a zip's local header inside a run (an
  image that is also a zip, `streamed_runs.signed_start`), each such run is decoded
  (from that header's group) and unpacked (`unpacked`), bounded by the body's
  `Allowance` (`core/archives.py`, `core/zip_entries.py`).

One level each: what a run unpacks to is read for markers, not unpacked again. As data
streams, a compressed run (or its block of lines) the window ends in is followed from
its start as it goes on (`leak_stream`, `streamed_runs`).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterator

from gateway.core.archives import Allowance
from gateway.core.dlp.fastscan import LITERAL, UNDECIDED
from gateway.core.encodings import EncodingError
from gateway.core.streamed_runs import HEAD, HEX_HEAD, signed_start
from gateway.core.unpack_bounds import ExcessError
from gateway.core.zip_entries import holds_files, unpacked_files

__all__ = ["ARCHIVE_MARKERS", "TILE", "archive_starts", "beyond", "joined", "unpacked"]

TILE = 8  # characters of a marker's tiles: any 16 of a marker in a row hold one
_WRAP_LINE = 20  # characters a line of a block has, but its last (`_gate.c`'s WRAP_LINE)

# The first characters of a compressed file's base64 (gzip `1f 8b 08`: `H4sI`; zip
# `PK\3\4`: `UEsDB`; bzip2 `BZh`: `Qlpo`; xz `fd 37 7a 58 5a 00`: `/Td6WFoA`, `_` in the
# URL alphabet; zstd `28 b5 2f fd`: `KLUv/`, or a skippable frame first, `5? 2a 4d 18`:
# `UCpNG` to `XypNG`) and hex, as the markers' canonical form has them (lowercased).
ARCHIVE_MARKERS = (b"h4si", b"uesdb", b"qlpo", b"/td6wfo", b"_td6wfo", b"kluv/", b"kluv_",
                   b"1f8b08", b"504b0304", b"425a68", b"fd377a585a00", b"28b52ffd",
                   *(b"%c%cpng" % (first, second) for first in b"uvwx" for second in b"csiy"),
                   *(b"5%x2a4d18" % low for low in range(16)),
                   # (a zip's local header inside a run, from a group's second or third
                   # byte: `streamed_runs.signed_start`; from its first, `uesdb`)
                   b"fblaw", b"vblaw", b"lblaw", b"1blaw", b"qswme")
_RUN = re.compile(rb"[A-Za-z0-9+/_-]+")
_HEX_RUN = re.compile(rb"[0-9a-fA-F]+")
_BREAKS = re.compile(rb"\\r\\n|\\n|\r?\n")
_LINE = re.compile(  # (a line from its start, after a break or another byte: each run
    # tried once, `_blocks`; an escaped break's letter is not a line's)
    rb"(?:(?<![A-Za-z0-9+/_-])|(?<=\\[nr]))(?!(?<=\\)[nr])"
    rb"[A-Za-z0-9+/_-]{20,}+(?:\\r\\n|\\n|\r?\n)(?=[A-Za-z0-9+/_-])")
_NEXT = re.compile(rb"[A-Za-z0-9+/_-]{20,}+(?:\\r\\n|\\n|\r?\n)(?=[A-Za-z0-9+/_-])")
_REST = re.compile(rb"[A-Za-z0-9+/_-]*+")

try:
    from gateway.core.dlp import _gate

    _wrapped_blocks = _gate.wrapped_blocks
except ImportError:  # (not built: the same blocks by expressions, slower)
    _gate = _wrapped_blocks = None
try:  # (the C gate's pass for the starts alone: no alphabet, so never a run)
    _STARTS = _gate.Gate(b"", 1, [(m, True) for m in ARCHIVE_MARKERS]) if _gate else None
except ValueError:  # (no AVX2)
    _STARTS = None


def beyond(kept: bytes, blocks: list[bytes], starts: list[int], allowance: Allowance,
           read: Callable[[bytes], str | None], find: Callable[[bytes], str | None]
           ) -> str | None:
    """What `kept` (data with its escapes undone, its case kept) holds beyond its bytes:
    each of its `blocks` of base64 lines (`joined`) read (`read`: markers, no deeper);
    the runs at `starts` (and in each block) that are a compressed file, their files
    read (`find`); `unreadable` past `allowance`."""
    found = next((k for flat in blocks if (k := read(flat))), None)
    packed = [(flat, archive_starts(flat.lower())) for flat in blocks] + [(kept, starts)]
    try:
        return found or next((k for data, at in packed for file in unpacked(
            data, at, allowance) if (k := find(file)) is not None), None)
    except ExcessError:  # (its sandbox's bucket spent: `unpack_bounds.Excess`)
        return "excess"
    except EncodingError:  # (past the bound: a bomb, refused as unreadable)
        return "unreadable"


def archive_starts(text: bytes) -> list[int]:
    """Where canonical `text` holds a compressed file's encoded start (the markers' pass
    finds them where it runs: this is for data it did not read, each start by `find`,
    where the C gate's one pass, `_STARTS`, says one is there)."""
    if _STARTS is not None and not _STARTS.flags(text) & (LITERAL | UNDECIDED):
        return []
    out = []
    for marker in ARCHIVE_MARKERS:
        at = text.find(marker)
        while at >= 0:
            out.append(at)
            at = text.find(marker, at + 1)
    return out


def joined(data: bytes) -> list[bytes]:
    """Each block of base64 lines in `data`, its breaks taken out."""
    return [_BREAKS.sub(b"", data[lo:hi]) for lo, hi in _blocks(data)]


def _blocks(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each block of base64 lines in `data` (`_gate.wrapped_blocks`; the
    same by expressions where it is not built)."""
    if _wrapped_blocks is not None:
        found: list[tuple[int, int]] = _wrapped_blocks(data)
        return found
    out: list[tuple[int, int]] = []
    for line in _LINE.finditer(data):
        if out and line.start() < out[-1][1]:
            continue  # (a line of the block before)
        end = line.end()
        while (more := _NEXT.match(data, end)) is not None:
            end = more.end()
        last = _REST.match(data, end)
        assert last is not None
        if end == line.end() and last.end() - end < _WRAP_LINE and (
                len(_BREAKS.sub(b"", line.group())) % 4):
            continue  # (a short line after a single one of a width no encoder writes)
        out.append((line.start(), last.end()))
    return out


def unpacked(data: bytes, starts: list[int], allowance: Allowance) -> Iterator[bytes]:
    """The files of each run in `data` (as sent, its case kept) from one of `starts`
    (`archive_starts`' or the markers' pass's) that decodes to a compressed file; raises
    EncodingError past `allowance`."""
    for at in sorted(set(starts)):
        if HEAD.match(data, at) is None:  # (a start of one case only: `canonical`
            signed = signed_start(data, at)  # lowercased it; or a zip's local header
            if signed is None:  # inside a run: read from its group)
                continue
            at = signed
        hexed = HEX_HEAD.match(data, at) is not None
        run = (_HEX_RUN if hexed else _RUN).match(data, at)
        decoded = _decoded(run.group(), hexed) if run is not None else None
        if decoded is None or not holds_files(decoded):
            continue
        for _, file in unpacked_files(decoded, allowance):
            yield file


def _decoded(text: bytes, hexed: bool) -> bytes | None:
    try:
        if hexed:
            return binascii.unhexlify(text[:len(text) // 2 * 2])
        text = text.replace(b"-", b"+").replace(b"_", b"/")
        # (all of it, its last group padded as its `=` or a decoder pads it: a zstd
        # block gives nothing until its last byte)
        text = text[:-1] if len(text) % 4 == 1 else text
        return base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        return None

