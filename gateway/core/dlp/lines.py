"""Base64 written in lines, as a decoder that skips line breaks reads it (pure).

`base64`, `openssl`, PEM and MIME write base64 in lines of 64 or 76 characters, and Go's,
Python's, Node's and Ruby's decoders skip the breaks: a key a break cuts is in no single
run of the alphabet (`decoding.runs`). `wrapped` finds each block of such lines among a
text's stretches (`decoding.stretches`), the breaks as sent or as JSON escapes them;
`stretches_and_blocks` finds both in one C call where `_gate.c` is built (`key_blocks`,
held to `wrapped` by tests/core/dlp/test_dlp_lines.py).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from gateway.core.dlp.decoding import MIN_BASE64, stretches
from gateway.core.dlp.fastscan import as_bytes

try:
    from gateway.core.dlp._gate import (  # type: ignore[import-not-found]
        key_blocks as _key_blocks,
    )
except ImportError:  # (not built: `wrapped` reads the stretches, the same blocks)
    _key_blocks = None

__all__ = ["line_start", "stretches_and_blocks", "wrapped"]

_LINE = re.compile(r"\r?\n([A-Za-z0-9+/_-]+)")  # (a line break and the next line)
_ESCAPED_LINE = re.compile(r"(?:\r?\n|\\r\\n|\\n)([A-Za-z0-9+/_-]+)")  # (JSON's too)
_WHOLE = re.compile(r"[A-Za-z0-9+/_-]+")  # (a whole line of the alphabet)


def wrapped(text: str, listed: Iterable[tuple[int, int]], escaped: bool = False,
            joins: Sequence[int] = ()) -> Iterator[tuple[int, int]]:
    """(start, end) of each block of base64 written in lines, from `listed` (the
    stretches, in order): a stretch, whole lines of the alphabet before it, and the
    lines after it, each after one line break (`\n` or `\r\n`; `escaped`: also as JSON
    writes them, in a JSON text as sent), while the line before is a stretch's length
    (`MIN_BASE64`) or more; the last may be shorter (after a single line, only where that
    line's length is a multiple of 4). Lines are as an encoder writes them (64, 76): a
    block of lines all shorter than `MIN_BASE64` is not read as one. `joins`: where the
    views a scan joins with newlines start (sorted): no block crosses into one."""
    reach, after_line = 0, _ESCAPED_LINE if escaped else _LINE
    breaks = "\r\n\\" if escaped else "\r\n"
    for start, end in listed:
        before, after_char = text[start - 1:start], text[end:end + 1]
        if (not after_char or after_char not in breaks) and before != "\n" and (
                not escaped or before != "\\"):
            continue  # (most: no line break on either side)
        if escaped and before == "\\" and text[start] in "nr":
            start += 1  # (an escaped break's letter is not the line's)
        if start < reach:
            continue  # (a line of the block before)
        lines = 1
        while (not joins or not _joined(joins, start)) and \
                (line_start := _line_before(text, start, reach, escaped)) is not None:
            start, lines = line_start, 2  # (a line of one case, not listed, before it)
        at, line = end, end - start
        while line >= MIN_BASE64 and (after := after_line.match(text, at)) is not None:
            if joins and _joined(joins, after.start(1)):
                break
            size = after.end() - after.start(1)
            if size < MIN_BASE64 and lines == 1 and line % 4:
                break  # (a short line after one line of a width no encoder writes: an
                # id and the next of the views a scan joins with newlines, not a block)
            line, at, lines = size, after.end(), lines + 1
        if at > end:
            reach = at
            yield start, at


def stretches_and_blocks(text: str, joins: Sequence[int] = ()
                         ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """`stretches(text)` and the blocks of base64 lines among them (`wrapped`, JSON's
    escaped breaks too), in one C call where built (`_gate.key_blocks`)."""
    if _key_blocks is not None:
        found: tuple[list[tuple[int, int]], list[tuple[int, int]]] = _key_blocks(
            as_bytes(text), joins)
        return found
    listed = list(stretches(text))
    return listed, list(wrapped(text, listed, True, joins)) if listed else []


def _joined(joins: Sequence[int], at: int) -> bool:
    """Whether a view starts at `at` (`joins`, sorted)."""
    if not joins:
        return False
    i = bisect_left(joins, at)
    return i < len(joins) and joins[i] == at


def line_start(text: str, lo: int, at: int, escaped: bool) -> int:
    """Where the line holding `at` starts: after the last line break before it, or
    `lo` (`escaped`: JSON's `\\n` a break too)."""
    first = max(text.rfind("\n", lo, at) + 1, lo)
    if escaped and (found := text.rfind("\\n", lo, at)) >= 0:
        first = max(first, found + 2)
    return first


def _line_before(text: str, start: int, reach: int, escaped: bool) -> int | None:
    """Where the line before a line break ending at `start` starts, if it is a whole
    line of `MIN_BASE64` alphabet characters or more after `reach`."""
    at = start - 1 if text[start - 1:start] == "\n" else -1
    if at > reach and text[at - 1] == "\r":
        at -= 1
    if at < 0 and escaped and text[start - 2:start] == "\\n":
        at = start - 4 if text[start - 4:start - 2] == "\\r" else start - 2
    if at - MIN_BASE64 < reach or not _WHOLE.fullmatch(text, at - MIN_BASE64, at):
        return None  # (most: a name, a word before the break)
    first = line_start(text, reach, at, escaped)
    return first if _WHOLE.fullmatch(text, first, at) else None
