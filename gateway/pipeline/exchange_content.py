"""The content of an exchange whose policy exports it (`telemetry: {content: true}`):
the request body the gateway held whole (an inference call's prompt, an MCP message's
arguments) and the answer as relayed to the client (the completion, the tool's result),
for the OpenTelemetry exporter only, never for the audit line.

Redacted before it leaves the exchange: every credential outbound detection finds is
replaced (the rule's `dlp:` detectors, else the default ones), as `dlp: {action:
redact}` replaces it in a body, read by its content type and in every form
(`core/dlp/redact.redact_body`); a part in which a found value cannot be cut out is
withheld whole. The runtime then applies the log's redaction (keys,
minted secrets, gateway tokens) where it hands the content to the exporter. Each part is
kept up to `KEEP` bytes and exported up to `CAP` characters, cut only after redaction,
so a value that straddles the cut is still found whole. An answer the gateway relays
still encoded (`Content-Encoding`) is not exported.
"""

from __future__ import annotations

from gateway.core.dlp.redact import redact_body
from gateway.core.dlp.scanner import Scanner

__all__ = ["CAP", "KEEP", "WITHHELD", "ContentCapture"]

CAP = 16 * 1024  # characters exported per part
KEEP = CAP + 4096  # bytes kept per part: a value cut at KEEP starts after CAP
WITHHELD = "[content withheld: it held a credential that could not be cut out]"
ENCODED = "[content not exported: the answer was relayed encoded ({coding})]"
CUT = "…[cut]"


class ContentCapture:
    """One exchange's exported content (see the module docstring)."""

    __slots__ = ("_answer", "_answer_type", "_encoding", "_request", "_request_type",
                 "_size", "scanner")

    def __init__(self, scanner: Scanner | None) -> None:
        self.scanner = scanner
        self._request: bytes | None = None
        self._request_type: str | None = None
        self._answer: list[bytes] = []
        self._answer_type: str | None = None
        self._size = 0
        self._encoding: str | None = None

    def request(self, body: bytes | None, content_type: str | None = None) -> None:
        """The request body as forwarded (decoded, after the DLP step), once."""
        if self._request is None and body:
            self._request = bytes(body[:KEEP])
            self._request_type = content_type

    def answer(self, chunk: bytes, encoding: str | None = None,
               content_type: str | None = None) -> None:
        """A chunk of the answer as relayed; `encoding`: its Content-Encoding, if it is
        relayed encoded (then nothing of it is exported)."""
        if encoding:
            self._encoding = encoding
            return
        self._answer_type = content_type
        if self._size < KEEP and chunk:
            part = bytes(chunk[:KEEP - self._size])
            self._answer.append(part)
            self._size += len(part)

    def export(self) -> dict[str, str]:
        """``{"input": ..., "output": ...}`` (what there is), redacted and cut."""
        out: dict[str, str] = {}
        if self._request:
            out["input"] = self._text(self._request, self._request_type)
        if self._encoding:
            out["output"] = ENCODED.format(coding=self._encoding[:40])
        elif self._answer:
            out["output"] = self._text(b"".join(self._answer), self._answer_type)
        return out

    def _text(self, data: bytes, content_type: str | None) -> str:
        if self.scanner is not None:
            redacted = redact_body(self.scanner, data, content_type)
            if redacted.body is None:
                return WITHHELD
            data = redacted.body
        text = data.decode("utf-8", "replace")
        return text if len(text) <= CAP else text[:CAP] + CUT
