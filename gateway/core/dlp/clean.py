"""Whether a body holds nothing outbound credential detection could find, as its receiver
reads it (issue 43: a request without candidates costs next to nothing).

Most bodies are decided by the gate's one pass (`fastscan.Gate`), which the leak guard
has already made over the same body: no base64 run and no anchor in its bytes, and no
escape its reader undoes that could hide one. What a reader undoes depends on how it
reads the body (`prefilter.ESCAPES`): a JSON reader `\\uXXXX` and `\\/`, a form reader
`%XX` and `+`, a text reader nothing; and in which characters (a UTF-16 body's bytes are
not its text). A client sends a few Content-Types again and again, so what each type
says about the reading is worked out once (`reading`); the C pass's flags say the rest
(the escapes' bytes, and whether the body starts with a byte-order mark or a NUL). A
request's clean body so costs a dictionary read and a few bit tests beside the pass.

Without the C pass (no AVX2), each question is asked on its own, as the scanner reads.
"""

from __future__ import annotations

from gateway.core.archives import FIRST_BYTES, archive_kind
from gateway.core.dlp.decoding import Unreadable, body_kind, json_codec, text_codec
from gateway.core.dlp.fastscan import (
    BACKSLASH,
    ESCAPES_KNOWN,
    FOUND,
    PERCENT,
    PLUS,
    UNMARKED,
)
from gateway.core.dlp.prefilter import JSON_ESCAPE, Prefilter
from gateway.core.framing import is_framed

__all__ = ["CleanBodies", "reading"]

_TYPES: dict[str | None, str] = {}  # Content-Type as sent → `reading`
_TYPES_KEPT = 256  # types remembered, at most
_READ = ESCAPES_KNOWN | UNMARKED  # (the C pass read the whole body, which has no BOM)


def reading(content_type: str | None) -> str:
    """How a receiver reads a body of this Content-Type, as far as the type says: `json`,
    `form`, `text` (as it is, or as JSON where it starts like JSON: `body_kind`), or
    `other` (multipart, whose parts have their own; gRPC, whose messages may be
    compressed; a charset in which ASCII is not its own bytes, or that no codec
    reads). Remembered per type."""
    found = _TYPES.get(content_type)
    if found is not None:
        return found
    ctype = (content_type or "").lower()
    if "multipart/" in ctype or is_framed(ctype):  # (parts, messages: read by their own)
        found = "other"
    elif "json" in ctype and "x-www-form-urlencoded" not in ctype:
        found = "json"  # (a JSON reader takes its charset from the bytes)
    else:
        try:
            as_bytes = text_codec(b"", ctype) == "latin-1"
        except Unreadable:
            as_bytes = False
        found = ("form" if "x-www-form-urlencoded" in ctype else "text") if as_bytes \
            else "other"
    if len(_TYPES) >= _TYPES_KEPT:
        _TYPES.clear()
    _TYPES[content_type] = found
    return found


class CleanBodies:
    """One prefilter's check of whole bodies (`Scanner.body_clean`)."""

    __slots__ = ("native", "prefilter")

    def __init__(self, prefilter: Prefilter) -> None:
        self.prefilter = prefilter
        # (the C pass knows the escapes' bytes; a rule without anchors reads every body)
        self.native = prefilter.gate.native and not prefilter.unanchored

    def clean(self, body: bytes, content_type: str | None) -> bool:
        """Whether `body` (its content codings undone) holds no candidate as its reader
        reads it: one gate pass over its bytes (its answer taken where the leak guard
        asked first). A multipart body is not decided here (each part has its own type
        and coding), nor one whose reader decodes it from UTF-16, UTF-32 or another
        charset ASCII is not its own bytes in. False means: read it (the scan decides)."""
        if not body:
            return True
        how = _TYPES.get(content_type) or reading(content_type)
        gate = self.prefilter.gate
        if how == "other" or (body[0] in FIRST_BYTES and archive_kind(body[:6])):
            # (its parts, messages or files are read by their own: `Scanner.body_views`)
            gate.forget()  # (the leak guard's answer: not asked for)
            return False
        if not self.native:
            return self._asked(body, how)
        flags = gate.flags(body, escapes=True)
        if flags & FOUND or flags & _READ != _READ:
            return False
        if how == "form" and flags & (PERCENT | PLUS):
            return False  # (and a JSON document sent as a form, read as JSON too: as text)
        # (JSON's escapes start with one; a text's are undone too, as a lenient JSON
        # reader undoes them: `Scanner.body_views`)
        return not flags & BACKSLASH or JSON_ESCAPE.search(body) is None

    def _asked(self, body: bytes, how: str) -> bool:
        """`clean` without the C pass: the codec, then the prefilter's candidate."""
        kind = body_kind(body, "") if how == "text" else how
        if (json_codec(body) if kind == "json" else text_codec(body, "")) != "latin-1":
            self.prefilter.gate.forget()
            return False
        # (every body is read with JSON's escapes undone too: `clean`)
        return not self.prefilter.candidate(body, kind) and \
            not self.prefilter.candidate(body, "json")
