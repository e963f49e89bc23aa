"""The one glob matcher of policy files, by `/`-separated segment (pure).

Used by `paths:` (`paths.py`) and by `mcp:` resource and argument globs (`mcp_rule.py`):

* ``*`` as a whole segment = exactly one non-empty segment (``org/*`` matches ``org/api``,
  not ``org/a/b`` nor ``org/``);
* ``*`` inside a segment = any characters within that segment (``v*.json``);
* ``**`` as a whole segment = any number of segments, including none (``org/**`` matches
  ``org``, ``org/a`` and ``org/a/b``; ``a/**/z`` matches ``a/z`` and ``a/b/c/z``); ``**``
  inside a segment is refused where the pattern is read;
* with ``classes`` (the `mcp:` globs, not `paths:`): ``?`` = one character and ``[...]``
  (``[!...]`` negated) = one character of a set, never ``/``.

`segments` False reads the value as one opaque name (MCP tool and prompt names): ``*``
then matches any characters, as `fnmatch` does. `beneath` (deny globs) also matches
everything under what the pattern matches (a deny of ``repo://org/secret*`` refuses
``repo://org/secrets/key``).

A glob is matched by Python's regular expressions where that takes linear time: at most
one wildcard that reads a variable stretch (a ``**``, a ``*`` inside a segment, the
`beneath` tail; a whole-segment ``*`` reads its segment and no more). With two or more,
backtracking tries every way to share the text between them, and the text is the
sandbox's: ``/a/**/b/**/c/**/d`` against an 8 KB path of ``/b`` and ``/c`` took 12 s,
the GIL held. Such a glob is matched by `Glob` instead: the wildcard matcher that keeps
only its last star (per segment for ``*``, per path for ``**``), in time of the text's
length times the pattern's.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

__all__ = ["Glob", "GlobError", "Matcher", "compile_glob", "glob_regex", "linear",
           "validate_glob"]


class GlobError(ValueError):
    """A glob that cannot be used; the message says what to change."""


def validate_glob(pattern: str) -> str:
    """`pattern` unchanged if its ``**`` are whole segments, else raise GlobError."""
    for segment in pattern.split("/"):
        if "**" in segment and segment != "**":
            raise GlobError(f"glob {pattern!r}: '**' must be a whole segment (e.g. org/**); "
                            "'*' matches within one segment")
    return pattern


def _class(pattern: str, at: int) -> tuple[str, int] | None:
    """The regex of the ``[...]`` starting at `at`, and the index after it (None: no
    closing bracket, so the ``[`` is literal, as in fnmatch)."""
    end = at + 1
    if end < len(pattern) and pattern[end] == "!":
        end += 1
    if end < len(pattern) and pattern[end] == "]":
        end += 1
    end = pattern.find("]", end)
    if end < 0:
        return None
    body = pattern[at + 1:end]
    negate = body.startswith("!")
    body = body[1:] if negate else body
    escaped = body.replace("\\", "\\\\").replace("^", "\\^").replace("[", "\\[")
    return f"[{'^' if negate else ''}{escaped}]", end + 1


def _units(segment: str, classes: bool, within: str) -> list[str | tuple[str] | None]:
    """A segment read once: `_STAR` for a run of ``*``, a one-character regex in a
    1-tuple (``?``, a class), else a literal character. `within` is what a wildcard
    may match (``[^/]`` or ``.``)."""
    out: list[str | tuple[str] | None] = []
    at = 0
    while at < len(segment):
        char = segment[at]
        if char == "*":
            while at < len(segment) and segment[at] == "*":
                at += 1
            out.append(_STAR)
            continue
        if classes and char == "?":
            out.append((within,))
        elif classes and char == "[" and (found := _class(segment, at)) is not None:
            regex, at = found
            out.append((f"(?!/){regex}" if within != "." else regex,))
            continue
        else:
            out.append(char)
        at += 1
    return out


def _segment(segment: str, classes: bool, within: str) -> str:
    """One segment's regex (`_units`)."""
    return "".join(f"{within}*" if unit is _STAR else unit[0] if isinstance(unit, tuple)
                   else re.escape(unit) for unit in _units(segment, classes, within))


_STAR = None  # a `*` among a segment's characters; `**` among a path's segments


def glob_regex(pattern: str, *, segments: bool = True, classes: bool = True) -> str:
    """The regex source `pattern` means (see the module docstring); fullmatch it."""
    if not segments:
        return _segment(pattern, classes, ".")
    parts = pattern.split("/")
    if parts == ["**"]:
        return r"[^/]*(?:/[^/]*)*"
    out: list[str] = []
    joined = False  # (the separator before the next segment is already in the regex)
    for index, part in enumerate(parts):
        if part == "**" and (index == 0 or joined):  # (`**/**/x` matches `x`)
            out.append(r"(?:[^/]*/)*")
            joined = True
            continue
        if part == "**":
            out.append(r"(?:/[^/]*)*")  # (takes the separator before it, or none)
            joined = False
            continue
        if index > 0 and not joined:
            out.append("/")
        joined = False
        out.append(r"[^/]+" if part == "*" else _segment(part, classes, "[^/]"))
    return "".join(out)


class Matcher(Protocol):
    """What a compiled glob answers: a match (truthy) of the whole text, or None/False."""

    def fullmatch(self, text: str, /) -> object: ...


def linear(pattern: str, *, segments: bool = True, beneath: bool = False) -> bool:
    """Whether `glob_regex(pattern)` runs in linear time on any text: at most one wildcard
    reading a variable stretch (see the module docstring)."""
    if not segments:
        return len(re.findall(r"\*+", pattern)) <= 1
    stretches = int(beneath)
    for part in pattern.split("/"):
        if part == "**":
            stretches += 1
        elif part != "*":
            stretches += len(re.findall(r"\*+", part))
    return stretches <= 1


_Chars = tuple[str | re.Pattern[str] | None, ...]  # a character, a class, or `_STAR`


def _starred(units: Sequence[Any], size: int, one: Callable[[Any, int], bool]) -> bool:
    """The wildcard match keeping only the last star: `units` (`_STAR` or a unit that
    `one(unit, i)` matches at the text's i-th place) against `size` places. Each unit
    but the star takes exactly one place, so the earliest place for what follows a
    star is always as good as any later: `size` times `units` steps at most."""
    match = one  # (a local name: called in the loop)
    at = done = 0
    star, mark = -1, 0
    count = len(units)
    while at < size:
        if done < count and units[done] is _STAR:
            star, mark = done, at
            done += 1
        elif done < count and match(units[done], at):
            done += 1
            at += 1
        elif star >= 0:
            done, mark = star + 1, mark + 1
            at = mark
        else:
            return False
    while done < count and units[done] is _STAR:
        done += 1
    return done == count


def _chars(segment: str, classes: bool, within: str) -> _Chars:
    """A segment's units (`_units`), each one-character regex compiled."""
    return tuple(re.compile(unit[0], re.DOTALL) if isinstance(unit, tuple) else unit
                 for unit in _units(segment, classes, within))


def _chars_match(units: _Chars, text: str) -> bool:
    def one(unit: str | re.Pattern[str], at: int) -> bool:
        char = text[at]
        if isinstance(unit, str):
            return unit == char
        return unit.fullmatch(char) is not None

    return _starred(units, len(text), one)


class Glob:
    """A glob matched without backtracking (see the module docstring): `fullmatch`
    answers as `compile_glob`'s regex would, in time of the text's length times
    the pattern's."""

    __slots__ = ("_parts", "pattern", "segments")

    def __init__(self, pattern: str, *, segments: bool = True, beneath: bool = False,
                 classes: bool = True) -> None:
        self.pattern = pattern
        self.segments = segments
        within = "[^/]" if segments else "."
        if not segments:
            self._parts: tuple[Any, ...] = (_chars(pattern, classes, within),)
            return
        parts: list[Any] = []
        for part in pattern.split("/") + (["**"] if beneath else []):
            parts.append(_STAR if part == "**" else "*" if part == "*"
                         else _chars(part, classes, within))
        self._parts = tuple(parts)

    def fullmatch(self, text: str) -> bool:
        if not self.segments:
            return _chars_match(self._parts[0], text)
        pieces = text.split("/")

        def one(part: _Chars | str, at: int) -> bool:
            piece = pieces[at]
            if isinstance(part, str):  # (a whole-segment `*`: one segment, not empty)
                return piece != ""
            return _chars_match(part, piece)

        return _starred(self._parts, len(pieces), one)


@functools.lru_cache(maxsize=4096)
def compile_glob(pattern: str, segments: bool = True, beneath: bool = False) -> Matcher:
    """`pattern` compiled (`classes` on: the `mcp:` syntax); `beneath`: also what lies
    under a match: Python's regex where it is linear, else `Glob`. Raises GlobError."""
    if segments:
        validate_glob(pattern)
    if not linear(pattern, segments=segments, beneath=beneath):
        return Glob(pattern, segments=segments, beneath=beneath)
    regex = glob_regex(pattern, segments=segments)
    if beneath and segments:
        regex = f"(?:{regex})(?:/.*)?"
    return re.compile(regex, re.DOTALL)
