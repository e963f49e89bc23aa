"""The content of an exchange whose policy exports it (`telemetry: {content: true}`):
the request body (held whole, or as it streamed through: an inference call's prompt, an
MCP message's arguments, an upload), the answer as relayed to the client (the
completion, the tool's result), and a WebSocket session's messages each way (a
Realtime or Responses-WebSocket session's events: the sandbox's as input, the
provider's as output, one a line), for the OpenTelemetry exporter only, never for the
audit line.

Redacted before it leaves the exchange: every credential outbound detection finds is
replaced (the rule's `dlp:` detectors, else the default ones), as `dlp: {action:
redact}` replaces it in a body, read by its content type and in every form
(`core/dlp/redact.redact_body`); a part in which a found value cannot be cut out is
withheld whole. The runtime then applies the log's redaction (keys,
minted secrets, gateway tokens) where it hands the content to the exporter. Each part is
kept up to `KEEP` bytes and exported up to `CAP` characters, cut only after redaction,
so a value that straddles the cut is still found whole. A body the gateway relays
still encoded (`Content-Encoding`) is not exported.
"""

from __future__ import annotations

from gateway.core.dlp.redact import redact_body
from gateway.core.dlp.scanner import Scanner

__all__ = ["CAP", "KEEP", "WITHHELD", "ContentCapture"]

CAP = 16 * 1024  # characters exported per part
KEEP = CAP + 4096  # bytes kept per part: a value cut at KEEP starts after CAP
WITHHELD = "[content withheld: it held a credential that could not be cut out]"
ENCODED = "[content not exported: the {what} was relayed encoded ({coding})]"
CUT = "…[cut]"


class _Part:
    """One direction's bytes as relayed, kept up to KEEP."""

    __slots__ = ("chunks", "content_type", "encoding", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.content_type: str | None = None
        self.encoding: str | None = None

    def add(self, data: bytes, content_type: str | None, encoding: str | None) -> None:
        if encoding:
            self.encoding = encoding
            return
        self.content_type = content_type
        if self.size < KEEP and data:
            piece = bytes(data[:KEEP - self.size])
            self.chunks.append(piece)
            self.size += len(piece)


class ContentCapture:
    """One exchange's exported content (see the module docstring)."""

    __slots__ = ("_answer", "_request", "scanner")

    def __init__(self, scanner: Scanner | None) -> None:
        self.scanner = scanner
        self._request = _Part()
        self._answer = _Part()

    def request(self, body: bytes | None, content_type: str | None = None, *,
                whole: bool = True) -> None:
        """The request body held whole, as forwarded (decoded, after the DLP step), once;
        or (`whole` False) the next piece of a body streamed through, decoded."""
        if body and (not whole or not self._request.chunks):
            self._request.add(body, content_type, None)

    def answer(self, chunk: bytes, encoding: str | None = None,
               content_type: str | None = None) -> None:
        """A chunk of the answer as relayed; `encoding`: its Content-Encoding, if it is
        relayed encoded (then nothing of it is exported)."""
        self._answer.add(chunk, content_type, encoding)

    def message(self, from_client: bool, data: bytes) -> None:
        """A WebSocket message as relayed (the sandbox's: input; the upstream's:
        output), one a line."""
        part = self._request if from_client else self._answer
        if data and part.size < KEEP:
            part.add(bytes(data[:KEEP - part.size]) + b"\n", None, None)

    def export(self) -> dict[str, str]:
        """``{"input": ..., "output": ...}`` (what there is), redacted and cut."""
        out: dict[str, str] = {}
        for key, part, what in (("input", self._request, "request"),
                                ("output", self._answer, "answer")):
            if part.encoding:
                out[key] = ENCODED.format(what=what, coding=part.encoding[:40])
            elif part.chunks:
                out[key] = self._text(b"".join(part.chunks), part.content_type)
        return out

    def _text(self, data: bytes, content_type: str | None) -> str:
        if self.scanner is not None:
            redacted = redact_body(self.scanner, data, content_type)
            if redacted.body is None:
                return WITHHELD
            data = redacted.body
        text = data.decode("utf-8", "replace")
        return text if len(text) <= CAP else text[:CAP] + CUT
