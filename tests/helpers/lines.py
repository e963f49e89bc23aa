"""Random texts of base64-alphabet lines and line breaks (as sent and JSON-escaped), for
the tests holding the C block finders to the Python ones (`core/dlp/lines.py`,
`core/leak_readings.py`)."""

from __future__ import annotations

import random

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
BREAKS = ("\n", "\r\n", "\\n", "\\r\\n", " ", "\\", "\\r", "\r", "\n\n", "=\n")


def random_lines(r: random.Random, widths: tuple[int, ...], most: int = 7) -> str:
    """Up to `most` lines, each of one of `widths` alphabet characters and a break (or
    another byte a block stops at)."""
    pieces = []
    for _ in range(r.randint(1, most)):
        pieces.append("".join(r.choice(ALPHABET) for _ in range(r.choice(widths))))
        pieces.append(r.choice(BREAKS))
    return "".join(pieces)
