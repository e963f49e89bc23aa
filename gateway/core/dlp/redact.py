"""`action: redact`: the body with every value found replaced by `[REDACTED]`, still in
its encoding - or the reason it cannot be, and the caller refuses instead.

Each value is replaced in every form a receiver reads it from: as is, JSON-escaped
(also with `\\/`), percent-encoded; inside base64 and hex runs, the run is decoded,
redacted and encoded again in its own alphabet. Content codings are undone first and
applied again after (so a gzip body goes out gzip). JSON stays JSON (`[REDACTED]` holds
no character a JSON string must escape) and a form stays a form (there the mark is
percent-encoded). The result is scanned again: if any value is still found (an encoding this
module does not rewrite), there is no redaction. The caller sets Content-Length anew.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import quote, quote_plus

from gateway.core.dlp.archive_views import Sharing
from gateway.core.dlp.decoding import (
    Unreadable,
    decode_content,
    decode_run,
    encode_content,
    encode_run,
    runs,
)
from gateway.core.dlp.findings import Location
from gateway.core.dlp.scanner import Scanner

__all__ = ["REDACTED", "Redaction", "redact_body", "redact_text"]

REDACTED = "[REDACTED]"


@dataclass(frozen=True, slots=True)
class Redaction:
    """The rewritten body (None if it cannot be) and the values replaced."""

    body: bytes | None
    replaced: int = 0
    reason: str | None = None


def _forms(value: str) -> list[str]:
    raw = value.encode("utf-8", "surrogatepass").decode("latin-1")
    escaped = json.dumps(value)[1:-1]
    forms = {raw, escaped, escaped.replace("/", "\\/"), quote_plus(value, safe=""),
             quote(value, safe="")}
    return sorted((f for f in forms if f), key=len, reverse=True)


def _replace(text: str, forms: list[str], form_body: bool, depth: int) -> tuple[str, int]:
    count = 0
    mark = quote_plus(REDACTED) if form_body else REDACTED
    for form in forms:
        if form in text:
            count += text.count(form)
            text = text.replace(form, mark)
    if depth <= 0:
        return text, count
    pieces: list[str] = []
    last = 0
    for run in list(runs(text)):
        data = decode_run(text, run)
        if data is None:
            continue
        inner, n = _replace(data.decode("latin-1"), forms, False, depth - 1)
        if n:
            pieces += [text[last:run.start], encode_run(text, run, inner.encode("latin-1"))]
            last = run.end
            count += n
    return "".join(pieces) + text[last:], count


def redact_text(scanner: Scanner, text: str, where: Location) -> tuple[str, int] | None:
    """A header value or request target with its values replaced; None if a value is
    still found after (the caller refuses)."""
    try:
        with Sharing(len(text)):  # (its compressed runs: the bound of a request's head)
            values = {h.value for h in scanner.text_hits(text, where)}
            if not values:
                return text, 0
            forms = [f for v in sorted(values, key=len, reverse=True) for f in _forms(v)]
            out, count = _replace(text, forms, False, scanner.depth)
            if any(True for _ in scanner.text_hits(out, where)):
                return None
    except Unreadable:  # (a compressed run past its bound: not rewritten, refused)
        return None
    return out, count


def redact_body(scanner: Scanner, body: bytes, content_type: str | None = None,
                content_encoding: str | None = None) -> Redaction:
    """The body with the values `scanner` finds replaced, in its content coding."""
    try:
        plain = decode_content(body, content_encoding, scanner.limit) if content_encoding \
            else body
        values = {h.value for h in scanner.body_hits(plain, content_type, None)}
    except Unreadable as exc:
        return Redaction(None, 0, f"the body cannot be read: {exc}")
    if not values:
        return Redaction(body)
    forms = [f for v in sorted(values, key=len, reverse=True) for f in _forms(v)]
    form_body = "x-www-form-urlencoded" in (content_type or "").lower()
    text, count = _replace(plain.decode("latin-1"), forms, form_body, scanner.depth)
    out = text.encode("latin-1")
    if scanner.body_hits(out, content_type, None):
        return Redaction(None, 0, "a credential is encoded in a way the gateway cannot "
                         "rewrite")
    try:
        return Redaction(encode_content(out, content_encoding) if content_encoding else out,
                         count)
    except Unreadable as exc:
        return Redaction(None, 0, str(exc))
