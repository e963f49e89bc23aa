"""Error phrases safe to log: a library's own words, never the bytes it quotes.

Parsers quote what they reject, and an upstream (or a sandbox) chooses those bytes: h11
says ``illegal status line: bytearray(b'HTTP/1.1 OK sk-…')``, mitmproxy ``Bad HTTP
response line: b'…'`` or ``Invalid transfer encoding header: 'Bearer sk-…'``. An upstream
that echoes the key it was sent would write it to the gateway's log. `error_phrase`
keeps the words before the first quote and says that the rest was withheld. (The
logging boundary, `gateway/observability/logs.py`, also redacts every known secret and token: this
keeps unknown ones out, and the log lines short.)
"""

from __future__ import annotations

import re

__all__ = ["WITHHELD", "error_phrase"]

WITHHELD = "[quoted data withheld]"
_QUOTE_OPENER = re.compile(r"(?:bytearray\(|bytes\()?b?$")


def error_phrase(detail: str, limit: int = 200) -> str:
    """``detail`` up to its first quoted value (`'…'`, `"…"`, `b'…'`), printable
    characters only, at most ``limit`` of them; the rest is named withheld."""
    cut = min((i for i in (detail.find("'"), detail.find('"')) if i >= 0), default=-1)
    text = detail if cut < 0 else _QUOTE_OPENER.sub("", detail[:cut])
    text = "".join(c if c.isprintable() else "?" for c in text).strip()
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if cut < 0:
        return text or "error"
    return f"{text.rstrip(' :(') or 'error'} {WITHHELD}"
