"""A JSON body as detection reads it: every string of the document (values and keys) by
its JSON path, in document order, a key written twice read twice (readers differ on
which one counts), and a value found in the raw text read as a JSON reader reads it.

The strings are read first as one text (`joined`), in C where `_jsontext.c` was built
(no document made: a coding agent's 13 KB request in about 2 µs against json.loads' 16
and a walk of the objects); the paths only where that text holds something."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

try:  # (built by `pip install` where a C compiler is: setup.py)
    from gateway.core.dlp import _jsontext  # type: ignore[attr-defined]
except ImportError:
    _jsontext = None

__all__ = ["NATIVE", "joined", "json_text", "load", "native", "strings", "texts"]

NATIVE: bool = _jsontext is not None

_PATH_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NOT_JSON = object()  # (`load`: the body is not a JSON document)


def native() -> Any:
    """The C reading's module (`_jsontext`), or None where it is not built."""
    return _jsontext


def load(body: bytes) -> Any:
    """The document, each object a tuple of all its pairs (arrays are lists: a tuple
    made in C, where a class of our own costs a Python call an object), or `NOT_JSON`."""
    try:
        return json.loads(body, object_pairs_hook=tuple)
    except (ValueError, RecursionError):
        return NOT_JSON


def joined(body: bytes) -> str | None:
    """The document's strings (`texts`) joined by newlines, or None where `body` is not
    a JSON document: read in C where built; what it declines (see `_jsontext.c`: not
    UTF-8, nested deeper than 256, not JSON), with `json` (`load`)."""
    if _jsontext is not None:
        found: str | None = _jsontext.texts(body)
        if found is not None:
            return found
    document = load(body)
    return None if document is NOT_JSON else "\n".join(texts(document))


def strings(node: Any, path: str) -> list[tuple[str, str]]:
    """(string, its JSON path) for every string of a document, in document order; a
    key's path ends in " (key)". Paths are made once a document, steps of a repeated
    key once a process."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(node, path)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            out.append((item, at))
        elif type(item) is tuple:  # every pair: a key repeated is read twice
            for key, value in reversed(item):  # (popped in document order)
                sub = at + _step(key)
                stack.append((value, sub))
                stack.append((key, sub + " (key)"))
        elif type(item) is list:
            stack.extend((item[i], f"{at}[{i}]") for i in range(len(item) - 1, -1, -1))
    return out


def texts(node: Any) -> list[str]:
    """The strings of `strings`, in its order (document order), without their paths (a
    document is read for a finding first, and its paths made only where there is
    one)."""
    out: list[str] = []
    stack: list[Any] = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif type(item) is tuple:
            for key, value in reversed(item):
                stack.append(value)
                stack.append(key)
        elif type(item) is list:
            stack.extend(reversed(item))
    return out


@functools.lru_cache(maxsize=4096)
def _step(key: str) -> str:
    """A key's step in a JSON path (a document repeats its keys: "role", "content")."""
    return f".{key}" if _PATH_KEY.fullmatch(key) else f"[{json.dumps(key)[:60]}]"


def json_text(value: str) -> str:
    """A value found in raw JSON text as a JSON reader reads it (escapes undone), so
    that it fingerprints like the same value found in the parsed document."""
    try:
        out = json.loads(f'"{value}"')
    except ValueError:
        return value
    return out if isinstance(out, str) else value
