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
"""

from __future__ import annotations

import functools
import re

__all__ = ["GlobError", "compile_glob", "glob_regex", "validate_glob"]


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


def _segment(segment: str, classes: bool, within: str) -> str:
    """One segment's regex: `within` is what a wildcard may match (``[^/]`` or ``.``)."""
    out: list[str] = []
    at = 0
    while at < len(segment):
        char = segment[at]
        if char == "*":
            while at < len(segment) and segment[at] == "*":
                at += 1
            out.append(f"{within}*")
            continue
        if classes and char == "?":
            out.append(within)
        elif classes and char == "[" and (found := _class(segment, at)) is not None:
            regex, at = found
            out.append(f"(?!/){regex}" if within != "." else regex)
            continue
        else:
            out.append(re.escape(char))
        at += 1
    return "".join(out)


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
        if part == "**" and index == 0:
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


@functools.lru_cache(maxsize=4096)
def compile_glob(pattern: str, segments: bool = True, beneath: bool = False
                 ) -> re.Pattern[str]:
    """`pattern` compiled (`classes` on: the `mcp:` syntax); `beneath`: also what lies
    under a match. Raises GlobError."""
    if segments:
        validate_glob(pattern)
    regex = glob_regex(pattern, segments=segments)
    if beneath and segments:
        regex = f"(?:{regex})(?:/.*)?"
    return re.compile(regex, re.DOTALL)
