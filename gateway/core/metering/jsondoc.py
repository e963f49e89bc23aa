"""One JSON document from bytes, strictly and cheaply (pure).

``json.loads`` on bytes first sniffs for UTF-16/32 and ``JSONDecoder.decode`` runs two
whitespace regexes around the document; on the relay path (each metered request body,
each response event with usage) those are a good part of the parse. Here: strict UTF-8,
``raw_decode`` from the first byte, and only JSON whitespace after the document.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["document"]

_SPACE = " \t\n\r"


def document(data: bytes, decoder: json.JSONDecoder) -> Any:
    """``data`` as one JSON document read by ``decoder``; ValueError if it is not one
    (UnicodeDecodeError, a ValueError, for bytes that are not UTF-8)."""
    text = data.decode()
    try:
        doc, end = decoder.raw_decode(text)
    except ValueError:  # leading whitespace (raw_decode does not skip it), or no document
        return decoder.decode(text)
    if end != len(text) and text[end:].strip(_SPACE):
        raise ValueError("extra data after the JSON document")
    return doc
