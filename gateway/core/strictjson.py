"""One strict JSON reader: a document that every reader reads the same way, or a refusal
(pure, no I/O).

Python's `json` module reads some documents that other readers read differently, or not
at all, and a gateway that decides on its reading while a server acts on its own can
be talked around. `loads` refuses each of those instead of picking a reading:

* bytes that are not UTF-8 (`json.loads` on bytes sniffs UTF-16/32 and lets encoded
  surrogates through; a client decoding with replacement reads something else), a BOM;
* a key repeated in an object, at any depth (Python keeps the last copy, many readers
  the first); with `fold`, also two keys equal once case-folded (`"method"` and
  `"METHOD"`, `"name"` and `"Name"`: Go's `encoding/json` matches keys without regard
  to case, folding U+017F (long s) to `s` and U+212A (Kelvin) to `k`, as `str.casefold`
  does);
* `NaN`, `Infinity`, `-Infinity` (not JSON; Python reads them by default), numbers too
  large for a double (`1e400`), integers beyond ±(2^53 - 1) (JavaScript and every
  reader that stores numbers as doubles round them: `9007199254740993` is read as
  `9007199254740992` there);
* `\\ud800` escapes not paired as UTF-16 (a lone surrogate: Python keeps it, others
  replace it or refuse the document);
* anything after the document but JSON whitespace; nesting too deep to read.

`dumps` writes a document back in one canonical form (ASCII only, compact, no NaN): what
the gateway passes on after reading is exactly what it read.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["MAX_INTEGER", "StrictJsonError", "dumps", "loads"]

MAX_INTEGER = 2 ** 53 - 1  # the largest integer every double-based reader reads exactly
_SPACE = " \t\n\r"  # JSON's whitespace (str.strip() would take more)
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # an escape of U+D800..U+DFFF


class StrictJsonError(ValueError):
    """The bytes are not one JSON document every reader reads the same way; the message
    says why (a fixed sentence: never the bytes)."""


def _constant(name: str) -> Any:
    raise StrictJsonError(f"{name} is not a JSON number")


def _number(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise StrictJsonError("a number too large for a double")
    return value


def _integer(text: str) -> int:
    value = int(text)
    if not -MAX_INTEGER <= value <= MAX_INTEGER:
        raise StrictJsonError("an integer beyond 2^53 - 1 (readers storing doubles round it)")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise StrictJsonError("a key repeated in an object")
    return doc


def _folded_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise StrictJsonError("a key repeated in an object")
    if len(doc) > 1:
        keys = "".join(doc)
        # (keys already case-folded cannot fold onto each other: the set is built only
        # for an object with a key that folding changes)
        if keys.casefold() != keys and len({k.casefold() for k in doc}) != len(doc):
            raise StrictJsonError("two keys of an object differ only in case")
    return doc


def _decoder(fold: bool) -> json.JSONDecoder:
    return json.JSONDecoder(object_pairs_hook=_folded_object if fold else _object,
                            parse_float=_number, parse_constant=_constant,
                            parse_int=_integer)


_DECODERS = {False: _decoder(False), True: _decoder(True)}


def loads(data: bytes, *, fold: bool = False) -> Any:
    """`data` as one JSON document (objects as dicts), read strictly (see the module
    docstring); `fold`: two keys of an object may not differ only in case either.
    Raises StrictJsonError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise StrictJsonError("bytes that are not UTF-8") from None
    decoder = _DECODERS[fold]
    start = len(text) - len(text.lstrip(_SPACE))
    try:
        doc, end = decoder.raw_decode(text, start)
    except StrictJsonError:
        raise
    except RecursionError:
        raise StrictJsonError("nesting too deep to read") from None
    except ValueError as exc:  # json.JSONDecodeError, int() past its digit limit
        raise StrictJsonError(_what(exc)) from None
    if text[end:].strip(_SPACE):
        raise StrictJsonError("data after the JSON document")
    if _SURROGATE_ESCAPE.search(data) is not None and not _paired(doc):
        raise StrictJsonError("an unpaired UTF-16 surrogate escape (\\ud800 alone)")
    return doc


def _what(exc: ValueError) -> str:
    """A fixed sentence for a decoding error (its message names a position, no bytes)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON ({exc.msg} at character {exc.pos})"
    return "not JSON (a number too long to read)"


def _paired(doc: Any) -> bool:
    """No string of `doc`, keys included, holds a lone surrogate (Python's reader joins
    a paired escape into one character, so a surrogate left is a lone one)."""
    todo = [doc]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(value, dict):
            todo.extend(value)
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return True


def dumps(doc: Any) -> bytes:
    """`doc` in the canonical form: ASCII only (every other character escaped, so no
    reader splits a line at U+2028 or NEL), compact, NaN refused (ValueError)."""
    return json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
