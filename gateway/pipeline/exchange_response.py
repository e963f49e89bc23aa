"""The answer of an exchange as it should reach the client: on a credential exchange every
echo of the key redacted (head now, body as it streams, trailers), an encoded body
decoded (the length dropped where a rewrite may change it), an MCP server's answers read
(`exchange_mcp`), a metered answer's usage read and a provider-minted secret's answer
held (`exchange_metering`); under `dlp: {answers: report}` the answer as relayed is
scanned for credentials, and what is found recorded (`exchange_dlp`)."""

from __future__ import annotations

from gateway.core.encodings import Decoder, EncodingError, decoder_for
from gateway.core.leaks import Redactor
from gateway.core.messages import ResponseHead
from gateway.core.metering.streams import streamed
from gateway.core.refusal import Refusal
from gateway.core.secret_value import SecretValue
from gateway.core.unpack_bounds import charge_to
from gateway.pipeline.exchange_mcp import McpCalls
from gateway.pipeline.exchange_metering import MeteredSteps
from gateway.pipeline.exchange_state import ExchangeState

__all__ = ["ResponseSide", "no_body", "upstream_refusal"]

ENCODING_FAILED = ("the upstream {where} answered with a content coding the gateway "
                   "cannot decode to check for keys")


_UPSTREAM_KINDS = {
    "connect": "the upstream {where} could not be reached ({detail})",
    "tls": "the TLS handshake with the upstream {where} failed ({detail}); if it uses a "
           "private CA, add it to network.upstream_ca",
    "tls_handshake": "the upstream {where} did not complete a TLS handshake ({detail})",
    "protocol": "the upstream {where} sent an invalid HTTP response",
    "closed": "the upstream {where} closed the connection without a complete response",
    "encoding": ENCODING_FAILED,
}


def upstream_refusal(kind: str, detail: str, where: str) -> Refusal:
    """The refusal of an upstream failure of `kind` (connect, tls, timeout...): a reason
    from fixed sentences only, `detail` reduced to the words of an OS or TLS error."""
    if kind == "timeout":
        return Refusal("upstream_timeout", f"the upstream {where} sent nothing for too long "
                       f"({detail})")  # (the engine's own words: how long it waited)
    return Refusal("upstream_failed", _UPSTREAM_KINDS.get(kind, _UPSTREAM_KINDS["connect"])
                   .format(where=where, detail=_clean_detail(detail)))


def _clean_detail(detail: str) -> str:
    """An OS or TLS error phrase (fixed library text), never bytes from the upstream."""
    text = detail.split(":", 1)[0] if "b'" in detail or 'b"' in detail else detail
    return "".join(c for c in text if c.isalnum() or c in " ._-()")[:120] or "error"


def no_body(method: str, status: int) -> bool:
    """A response that has no body whatever its headers say."""
    return method == "HEAD" or status in (204, 304) or 100 <= status < 200


class ResponseSide:
    """The answer's way back (see the module docstring); the exchange hands it the parts
    that read the answer (MCP, metering) at each step."""

    def __init__(self, ex: ExchangeState) -> None:
        self.ex = ex
        self.redactor: Redactor | None = None
        self._decoder: Decoder | None = None

    def head(self, head: ResponseHead, secret: tuple[str, SecretValue] | None,
             mcp: McpCalls | None, metered: MeteredSteps | None) -> ResponseHead:
        """Check and adjust the response head (`secret`: the key injected, whose
        echoes are redacted; a 401 tells the secret store the key was rejected)."""
        charge_to(self.ex.excess)  # (what the answer's runs unpack to: its sandbox's)
        head = self._head(head, secret, mcp, metered)
        dlp = self.ex.dlp
        if dlp is not None and dlp.answers:  # (the head as sent)
            dlp.answer_head(head.headers.fields)
        return head

    def _head(self, head: ResponseHead, secret: tuple[str, SecretValue] | None,
              mcp: McpCalls | None, metered: MeteredSteps | None) -> ResponseHead:
        ex = self.ex
        ex.response_head = head
        if ex.oauth is not None:  # (the server refused the gateway's token: not relayed)
            ex.oauth.answered(head)
        if metered is not None and metered.metered is not None:
            if metered.metered.meter is not None:
                metered.metered.head(head.headers.get)
            metered.streamed = streamed(ex.target.path, head.headers.get("content-type"))
        if mcp is not None and not no_body(ex.head.method, head.status):
            mcp.read_answers(head)
        if secret is None:
            if mcp is not None and mcp.answers is not None:
                self._decode(head)
            return head
        name, value = secret
        if head.status == 401:
            ex.secrets.invalidate(name, rejected=value)
        redactor = self.redactor = Redactor(value.variants(), value.pieces())
        head.reason = redactor.redact(head.reason.encode("latin-1", "replace")).decode(
            "latin-1")
        if redactor.found_in(v for _, v in head.headers.fields):
            head.headers.fields = [(k, redactor.redact(v)) for k, v in head.headers.fields]
        if no_body(ex.head.method, head.status) or head.headers.get("content-length") == "0":
            return head
        self._decode(head)
        return head

    def _decode(self, head: ResponseHead) -> None:
        """The body is rewritten (echoes redacted, tool lists filtered): decoded if it
        is encoded, and its length dropped (raises Refusal)."""
        try:
            self._decoder = decoder_for(head.headers.joined("content-encoding"))
        except EncodingError:
            raise self._undecodable() from None
        if self._decoder is not None:
            head.headers.remove("content-encoding")
        head.headers.remove("content-length")  # redaction may change the length

    def _undecodable(self) -> Refusal:
        return Refusal("upstream_failed", ENCODING_FAILED.format(where=self.ex.where()))

    def data(self, chunk: bytes, mcp: McpCalls | None,
             metered: MeteredSteps | None) -> bytes:
        """One response body chunk as it should reach the client."""
        charge_to(self.ex.excess)
        self.ex.bytes_in += len(chunk)
        if metered is not None and metered.first_chunk is None and chunk:
            metered.first_chunk = self.ex.trail.clock()  # (time to first token)
        out = self._relayed(chunk, mcp, metered)
        if self.ex.content is not None:
            self._keep(out)
        if self.ex.dlp is not None and self.ex.dlp.answers and out:
            self._scan(out)
        return out

    def _scan(self, out: bytes) -> None:
        """A piece of the answer as relayed, to `answers: report`'s scan (with the
        head's coding and type as sent: decoded where the answer is rewritten)."""
        dlp, head = self.ex.dlp, self.ex.response_head
        if dlp is not None:
            dlp.answer_data(out, *_type_and_coding(head))

    def _keep(self, out: bytes) -> None:
        """The answer as relayed, for the content its policy exports (if it does)."""
        content = self.ex.content
        if content is not None and out:  # (the caller checked; mypy did not)
            ctype, coding = _type_and_coding(self.ex.response_head)
            content.answer(out, coding, ctype)

    def _relayed(self, chunk: bytes, mcp: McpCalls | None,
                 metered: MeteredSteps | None) -> bytes:
        answers = mcp.answers if mcp is not None else None
        redactor = self.redactor
        if redactor is None and answers is None:
            return chunk
        if self._decoder is not None:
            try:
                chunk = b"".join(self._decoder.feed(chunk))
            except EncodingError:
                raise self._undecodable() from None
        if metered is not None and metered.feed is not None:
            metered.feed(chunk)
        out = redactor.feed(chunk) if redactor is not None else chunk
        if answers is not None:
            out = answers.feed(out)
        return metered.hold(out) if metered is not None else out

    def end(self, mcp: McpCalls | None, metered: MeteredSteps | None) -> bytes:
        """What is still held back at the end of the response body."""
        charge_to(self.ex.excess)
        out = self._end(mcp, metered)
        dlp = self.ex.dlp
        if dlp is not None and dlp.answers:
            if out:
                self._scan(out)
            dlp.answer_end()
        return out

    def _end(self, mcp: McpCalls | None, metered: MeteredSteps | None) -> bytes:
        answers = mcp.answers if mcp is not None else None
        redactor = self.redactor
        if redactor is None and answers is None:
            return b""
        out = b""
        if self._decoder is not None:
            try:
                tail = b"".join(self._decoder.end())
            except EncodingError:
                raise self._undecodable() from None
            if metered is not None and metered.feed is not None:
                metered.feed(tail)
            out = redactor.feed(tail) if redactor is not None else tail
        if redactor is not None:
            out += redactor.end()
        if answers is not None and mcp is not None:
            out = answers.feed(out) + answers.end()
            mcp.note_answers()
        out = metered.release(out) if metered is not None else out
        if self.ex.content is not None:
            self._keep(out)
        return out

    def message(self, data: bytes, secret: tuple[str, SecretValue] | None,
                mcp: McpCalls | None, metered: MeteredSteps | None) -> bytes:
        """A WebSocket message from the upstream as it should reach the client: a
        metered session's event metered, an echoed key redacted, an MCP server's message
        read like an answer, and (`answers: report`) scanned as relayed."""
        ex = self.ex
        ex.bytes_in += len(data)
        if metered is not None:  # a session's event
            metered.event(data)
        if secret is not None:
            data = (self.redactor or Redactor(secret[1].variants(), secret[1].pieces())
                    ).redact(data)
        else:
            ex.trail.telemetry.count("bytes", "websocket", by=len(data))
        data = mcp.received(data) if mcp is not None else data
        if ex.dlp is not None and ex.dlp.answers:  # (never refused)
            ex.dlp.answer_message(data)
        return data

    def trailers(self, fields: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Response trailers as they should reach the client (echoes redacted)."""
        redactor = self.redactor
        out = fields if redactor is None else [(k, redactor.redact(v)) for k, v in fields]
        if self.ex.dlp is not None and self.ex.dlp.answers:
            self.ex.dlp.answer_end(out)
        return out


def _type_and_coding(head: ResponseHead | None) -> tuple[str | None, str | None]:
    """An answer's Content-Type and its Content-Encoding list (every line of it) as sent."""
    if head is None:
        return None, None
    return head.headers.get("content-type"), head.headers.joined("content-encoding")
