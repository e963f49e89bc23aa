"""A JSON body as detection reads it: every string of the document (values and keys) by
its JSON path, a key written twice read twice (readers differ on which one counts), and
a value found in the raw text read as a JSON reader reads it."""

from __future__ import annotations

import functools
import json
import re
from typing import Any

__all__ = ["json_text", "load", "strings", "texts"]

_PATH_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NOT_JSON = object()  # (`load`: the body is not a JSON document)


def load(body: bytes) -> Any:
    """The document, each object a tuple of all its pairs (arrays are lists: a tuple
    made in C, where a class of our own costs a Python call an object), or `NOT_JSON`."""
    try:
        return json.loads(body, object_pairs_hook=tuple)
    except (ValueError, RecursionError):
        return NOT_JSON


def strings(node: Any, path: str) -> list[tuple[str, str]]:
    """(string, its JSON path) for every string of a document; a key's path ends in
    " (key)". Paths are made once a document, steps of a repeated key once a process."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(node, path)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            out.append((item, at))
        elif type(item) is tuple:  # every pair: a key repeated is read twice
            for key, value in item:
                sub = at + _step(key)
                out.append((key, sub + " (key)"))
                stack.append((value, sub))
        elif type(item) is list:
            stack.extend((value, f"{at}[{i}]") for i, value in enumerate(item))
    return out


def texts(node: Any) -> list[str]:
    """The strings of `strings`, in its order, without their paths (a document is read
    for a finding first, and its paths made only where there is one)."""
    out: list[str] = []
    stack: list[Any] = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif type(item) is tuple:
            for key, value in item:
                out.append(key)
                stack.append(value)
        elif type(item) is list:
            stack.extend(item)
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
