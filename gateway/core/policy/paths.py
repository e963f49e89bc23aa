"""Path patterns and request-path normalisation.

Pattern syntax (validated at load, compiled once to one regex per rule; the policy files'
one glob matcher, `globs.py`, which `mcp:` resource and argument globs use too):

* a pattern without ``*`` is exact (``/v1/responses`` matches only that path);
* ``*`` as a whole segment = exactly one non-empty segment (``/repos/*/issues``);
* ``*`` inside a segment = any characters within that segment (``/files/*.json``);
* ``**`` as a whole segment = any number of segments, including zero
  (``/repos/**`` matches ``/repos``, ``/repos/`` and ``/repos/a/b``).

Request paths are matched as a provider's router reads them, one reading for every
check (``paths`` here, the meter's endpoint classification, the model check): the
query string stripped, percent-encoded *unreserved* characters decoded (RFC 3986
section 6.2.2.2, so ``%63hat`` is ``chat``), repeated slashes collapsed and a trailing
slash dropped (``/v1//chat/completions/`` is ``/v1/chat/completions``). Patterns are
read the same way (``/simple/`` is ``/simple``). A path an upstream could interpret as
a different path -- ``.``/``..`` segments (also encoded), encoded separators
``%2f``/``%5c``, backslashes, NUL, or a path not starting with ``/`` -- is
*suspicious*: it matches no rule at all. So is a path hiding a dot segment the way
Tomcat, Spring or Jetty would resolve it
(`/api/..;/admin`, `..%3b`, `%2e%2e;`, `%u002e`, overlong UTF-8 `%c0%ae`, fullwidth dots).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, field

from gateway.core.policy.globs import Glob, glob_regex, linear

__all__ = [
    "PathPatternError",
    "PathSet",
    "compile_paths",
    "normalize_path",
    "validate_path_pattern",
]


class PathPatternError(ValueError):
    """A path pattern that cannot be used; the message says what to change."""


_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
_PERCENT_BYTES = re.compile(rb"%([0-9A-Fa-f]{2})")
_PERCENT_U = re.compile(r"%[uU][0-9A-Fa-f]{4}")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def validate_path_pattern(pattern: str) -> str:
    """Return the pattern unchanged if valid, else raise PathPatternError."""
    if not pattern.startswith("/"):
        raise PathPatternError(f"path pattern {pattern!r} must start with '/'")
    if "?" in pattern or "#" in pattern:
        raise PathPatternError(
            f"path pattern {pattern!r} contains '?' or '#'; query strings are not matched, "
            "remove them"
        )
    if "\\" in pattern or "\x00" in pattern or any(c.isspace() for c in pattern):
        raise PathPatternError(
            f"path pattern {pattern!r} contains a backslash, NUL or whitespace; remove it"
        )
    if "%" in pattern:
        raise PathPatternError(
            f"path pattern {pattern!r} contains '%'; write the decoded path instead"
        )
    for segment in pattern.split("/")[1:]:
        if segment in (".", ".."):
            raise PathPatternError(
                f"path pattern {pattern!r} contains a '{segment}' segment; write the "
                "normalised path"
            )
        if "**" in segment and segment != "**":
            raise PathPatternError(
                f"path pattern {pattern!r}: '**' must be a whole segment (e.g. /repos/**)"
            )
    return pattern


@dataclass(frozen=True, slots=True)
class PathSet:
    """The compiled ``paths:`` of one rule: a set of exact paths, one combined regex of
    the globs it matches in linear time, and the others (`globs.Glob`)."""

    patterns: tuple[str, ...]
    exact: frozenset[str] = field(compare=False, repr=False)
    regex: re.Pattern[str] | None = field(compare=False, repr=False)
    globs: tuple[Glob, ...] = field(default=(), compare=False, repr=False)

    def matches(self, path: str) -> bool:
        """Match an already normalised path (see ``normalize_path``)."""
        if path in self.exact:
            return True
        regex = self.regex
        if regex is not None and regex.fullmatch(path) is not None:
            return True
        return any(glob.fullmatch(path) for glob in self.globs) if self.globs else False


def compile_paths(patterns: tuple[str, ...] | list[str]) -> PathSet:
    """Validate and compile a rule's path patterns (raises PathPatternError).

    Cached: rules often share the same paths, and a PathSet is immutable.
    """
    return _compile_paths(tuple(patterns))


@functools.lru_cache(maxsize=4096)
def _compile_paths(patterns: tuple[str, ...]) -> PathSet:
    exact: set[str] = set()
    alternatives: list[str] = []
    globs: list[Glob] = []
    for written in patterns:
        validate_path_pattern(written)
        pattern = _route(written)
        if "*" not in pattern:
            exact.add(pattern)
        elif linear(pattern):
            alternatives.append(glob_regex(pattern, classes=False))
        else:  # (two wildcards or more: backtracking would be polynomial in the path)
            globs.append(Glob(pattern, classes=False))
    regex = re.compile("|".join(f"(?:{a})" for a in alternatives)) if alternatives else None
    return PathSet(patterns=patterns, exact=frozenset(exact), regex=regex, globs=tuple(globs))


def _decode_unreserved(match: re.Match[str]) -> str:
    byte = int(match.group(1), 16)
    if byte in _UNRESERVED:
        return chr(byte)
    return "%" + match.group(1).upper()


_SLASHES = re.compile(r"//+")


def _route(path: str) -> str:
    """Repeated slashes collapsed, a trailing slash dropped (the root stays ``/``)."""
    if "//" in path:
        path = _SLASHES.sub("/", path)
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


@functools.lru_cache(maxsize=4096)  # agents repeat their paths; the result is immutable
def normalize_path(raw: str | None) -> tuple[str, str | None]:
    """Return ``(path, problem)``: the path as the provider's router reads it (see the
    module docstring), or a problem that makes it match nothing.

    ``problem`` is None for a clean path, else a short phrase for the deny reason.
    """
    path, problem = _normalize(raw)
    return (path, problem) if problem is not None else (_route(path), None)


def _normalize(raw: str | None) -> tuple[str, str | None]:
    if not raw:
        return "/", None
    path = raw.split("?", 1)[0] if "?" in raw else raw
    if not path.startswith("/"):
        return path, "does not start with '/'"
    if "\\" in path:
        return path, "contains a backslash"
    if "\x00" in path:
        return path, "contains a NUL byte"
    if "%" in path:
        path = _PERCENT.sub(_decode_unreserved, path)
        if "%2F" in path or "%5C" in path:
            return path, "contains an encoded '/' or '\\' (%2f, %5c)"
        if "%00" in path:
            return path, "contains an encoded NUL byte (%00)"
    if "/." in path:
        for segment in path.split("/"):
            if segment == "." or segment == "..":
                return path, "contains a '.' or '..' segment"
    if "%" in path or ";" in path or not path.isascii():
        problem = _hidden_segment(path)
        if problem is not None:
            return path, problem
    return path, None


def _hidden_segment(path: str) -> str | None:
    """A dot segment or separator hidden from a plain check, the way servers resolve
    them: Tomcat, Spring and Jetty drop `;parameters` (`/api/..;/admin` is `/admin`),
    some decode `%XX` again, `%uXXXX`, overlong UTF-8 (`%c0%ae`) or fullwidth forms
    (U+FF0E U+FF0E). Such a path is ambiguous: it matches no rule."""
    if _PERCENT_U.search(path):
        return "contains a %u escape, which some servers decode"
    raw = path.encode("utf-8", "surrogateescape")
    for _ in range(2):
        decoded = _PERCENT_BYTES.sub(lambda m: bytes([int(m.group(1), 16)]), raw)
        if decoded == raw:
            break
        raw = decoded
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "contains bytes that are not UTF-8 (overlong or broken encodings)"
    text = unicodedata.normalize("NFKC", text)
    if "\\" in text or "\x00" in text or text.count("/") != path.count("/"):
        return "contains an encoded '/', '\\' or NUL (double-encoded or fullwidth)"
    for segment in text.split("/"):
        if segment.split(";", 1)[0] in (".", ".."):
            return "hides a '.' or '..' segment (path parameters or encodings)"
    return None
