"""MCP resource URIs and tool arguments as `mcp:` globs read them (pure).

A server reads ``org/../evil/secret`` as ``evil/secret`` and ``repo://org/%2e%2e/vault``
as ``repo://vault``, so a glob is matched against the value as such a server reads it,
one reading: percent-escapes decoded once, ``.`` and ``..`` segments resolved, repeated
slashes collapsed. A value that cannot be read one way only is refused, not matched:
``..`` above its root, an escape that decodes to ``/``, ``\\``, ``%`` or NUL (a second
decoding would change it again), a backslash, NUL, bytes that are not UTF-8 once
decoded, or a segment some servers read as a dot segment (``..;x``, fullwidth dots).

A URI (``scheme://authority/path?query#fragment``) keeps its scheme and authority as
written; its path is resolved from the root; its query and fragment are not path: their
``/`` are read as ``%2F`` (within the last segment), so ``..`` there resolves nothing.
Any other value is a path, relative (``org/api``) or absolute (``/srv/data``).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["normalize_value"]

_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_URI = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/?#]*)(.*)", re.DOTALL)
_ENCODED = {0x2F: "'/'", 0x5C: "'\\'", 0x25: "'%'", 0x00: "NUL"}


def _decoded(value: str) -> tuple[str, str | None]:
    """`value` with its percent-escapes decoded once, or why it cannot be."""
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        return value, "is not valid UTF-8"
    problem: list[str] = []

    def byte(match: re.Match[bytes]) -> bytes:
        code = int(match.group(1), 16)
        if code in _ENCODED and not problem:
            problem.append(f"has an escape that decodes to {_ENCODED[code]} "
                           f"(%{match.group(1).decode()})")
        return bytes([code])

    decoded = _ESCAPE.sub(byte, raw) if b"%" in raw else raw
    if problem:
        return value, problem[0]
    try:
        text = decoded.decode("utf-8")
    except UnicodeDecodeError:
        return value, "is not valid UTF-8 once its escapes are decoded"
    if _ESCAPE.search(decoded):
        return value, "is encoded twice (a second decoding would change it)"
    return text, None


def _resolved(path: str, absolute: bool) -> tuple[str, str | None]:
    """`path` with ``.``, ``..`` and empty segments resolved; a trailing ``/`` kept."""
    parts = path.split("/")
    kept: list[str] = []
    for part in parts:
        if (";" in part or not part.isascii()) and \
                unicodedata.normalize("NFKC", part).split(";", 1)[0] in (".", ".."):
            return path, "hides a '.' or '..' segment (path parameters or look-alike dots)"
        if part in ("", "."):
            continue
        if part == "..":
            if not kept:
                return path, "goes above its root with '..'"
            kept.pop()
            continue
        kept.append(part)
    trailing = bool(kept) and (parts[-1] in ("", ".", ".."))
    text = "/".join(kept) + ("/" if trailing else "")
    return ("/" + text if absolute else text), None


def normalize_value(value: str) -> tuple[str, str | None]:
    """``(value as read, None)``, or ``(value, why it is refused)`` (a phrase after "it")."""
    if "\x00" in value:
        return value, "contains a NUL byte"
    if "\\" in value:
        return value, "contains a backslash"
    text, problem = _decoded(value)
    if problem is not None:
        return value, problem
    uri = _URI.fullmatch(text)
    if uri is None:
        resolved, problem = _resolved(text, text.startswith("/"))
        return (value, problem) if problem else (resolved, None)
    head, rest = uri.groups()
    cut = min((at for at in (rest.find("?"), rest.find("#")) if at >= 0), default=len(rest))
    path, tail = rest[:cut], rest[cut:].replace("/", "%2F")
    if not path:
        return head + tail, None
    resolved, problem = _resolved(path, True)
    return (value, problem) if problem else (head + resolved + tail, None)
