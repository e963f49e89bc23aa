"""One admitted request/response: what the engine forwards, and the checks on the way.

The gate hands an engine an `Exchange` for every request it admits. The engine sends
`head` (origin-form, carriers swapped, `Proxy-Authorization` gone) to `pinned`, then
passes every piece of the exchange through it, in order:

    request_data(chunk)* → request_end(trailers) → response(head)
      → response_data(chunk)* → response_end() → finish(status)

and WebSocket messages through `ws_message`. Any step may raise `Refusal`; the engine
then sends `abort(refusal)` if the client has no response yet (or closes the
connection), and the exchange is audited as refused. Upstream failures become
`upstream_failed(kind, detail)`: the detail (which may quote upstream bytes, an echoed
key) goes to the log only up to its first quote (`error_phrase`), never to the sandbox.

Request bodies are scanned as they stream; the tail of each chunk that could start a
marker is held back until the next chunk shows it clean: no part of a leaking token or
key goes out before the scan sees it whole. A compressed body is decoded for the scan
(and forwarded as sent, once whole, up to `ENCODED_LIMIT`). On a credential exchange
the upstream is asked for `Accept-Encoding: identity`; a response that comes encoded
anyway is decoded, and every echo of the key is redacted in headers and body.

A credential that signs requests (SigV4) installs a `Signer`: a request whose payload
is not signed is signed at once; otherwise the body is held whole (`SIGNED_BODY_LIMIT`)
and `request_whole` signs the head before the engine serialises it. An engine about to
stream a body calls `streaming()` first, which refuses such a request: it cannot be
signed before its head goes out.

**One hold limit.** `hold_limit` says how much of a request body every engine holds
before forwarding: `BODY_HOLD_LIMIT` where a check needs the body whole (an inference
call on a metered credential, a model allowlist reading the body, a signature over the
body), else `HOLD_LIMIT`. A body that ends within it goes through `request_whole`,
decoded first if compressed: the metering step reads it as the provider will, and a
body it rewrites is sent re-encoded in the coding its head names.

On metered WebSocket sessions each message from the sandbox goes through the metering
step: a refused one raises `MessageRefused` (audited; the engine answers the provider's
error event, the session goes on). On a rule with `mcp:` each message from the sandbox
is judged as a POST's body would be (`core/mcp.py`; refused the same way, answered with
JSON-RPC errors), and every answer of the server, on HTTP or a WebSocket, is read before
the client sees it (`core/mcp_answers.py`).

Its parts (sides, metering, MCP) hold it weakly (`me`): in a reference cycle, every
request's ~35 objects waited for a garbage collection (a 30-40 MiB sawtooth under load).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from gateway.core import mcp
from gateway.core.encodings import encode
from gateway.core.messages import ResponseHead
from gateway.core.metering import MODEL_BODY_LIMIT
from gateway.core.phrases import error_phrase
from gateway.core.policy import Decision, Policy
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.ports import Metering, Signer
from gateway.core.refusal import GATEWAY_ERROR, Answer, Refusal
from gateway.core.secret_value import SecretValue
from gateway.core.target import DEFAULT_PORTS
from gateway.core.unpack_bounds import charge_to
from gateway.pipeline.exchange_mcp import McpCalls
from gateway.pipeline.exchange_metering import Held, MeteredSteps
from gateway.pipeline.exchange_request import ENCODED_LIMIT, RequestSide
from gateway.pipeline.exchange_response import ResponseSide, no_body, upstream_refusal
from gateway.pipeline.exchange_state import ExchangeState, leak_refusal, source_of

log = logging.getLogger("sandbox_gateway")

__all__ = ["BODY_HOLD_LIMIT", "ENCODED_LIMIT", "HOLD_LIMIT", "SIGNED_BODY_LIMIT", "Exchange",
           "Held", "leak_refusal", "no_body"]

HOLD_LIMIT = 1024 * 1024  # a request body that ends within this is checked whole first
BODY_HOLD_LIMIT = MODEL_BODY_LIMIT  # held whole where a check needs the body (see above)
SIGNED_BODY_LIMIT = BODY_HOLD_LIMIT  # a body signed whole (SigV4) is held up to this


class Exchange(ExchangeState):
    """See the module docstring. Its parts: the MCP side (`exchange_mcp.McpCalls`, on a
    rule with `mcp:`), the metering side (`exchange_metering.MeteredSteps`, on a
    credential rule), the answer's way back (`exchange_response.ResponseSide`)."""

    def __post_init__(self) -> None:
        self.me: Exchange = weakref.proxy(self)  # (its parts' reference: see the docstring)
        self._secret: tuple[str, SecretValue] | None = None
        self._request = RequestSide(self.me)
        self._signer: Signer | None = None  # signs the head once the body is whole
        self.signed = False  # the head was signed after the gate returned (SigV4)
        self.head_changed = False  # request_whole changed the head (signed over the body)
        self._metering: MeteredSteps | None = None
        self._mcp: McpCalls | None = None
        self._response = ResponseSide(self.me)
        # ask mode: asks a person about a model the allowlist refuses (raises the refusal)
        self.asks: Callable[[str, Refusal], Awaitable[None]] | None = None

    # -- the body stage's parts, set up by the gate ---------------------------------------

    def meter(self, metering: Metering, policy: Policy, preset: str | None) -> None:
        """Meter this credential exchange."""
        self._metering = MeteredSteps(self.me, metering, policy, preset)

    def mcp(self, rule: McpRule, session: mcp.Session, *, report: bool,
            pins: mcp.Pinned | None = None) -> None:
        """Decide this exchange's JSON-RPC calls by `rule`, within its MCP `session`;
        `pins`: its server's tool pins (`pin_descriptions`); a method no MCP transport
        uses is refused (raises Refusal)."""
        self._mcp = McpCalls(self.me, rule, session, report=report, pins=pins)

    @property
    def hold_limit(self) -> int:
        """How much of the request body every engine holds before forwarding (see the
        module docstring): BODY_HOLD_LIMIT for a metered inference call, a model
        allowlist reading the body, or a signature over it; else HOLD_LIMIT."""
        if self._signer is not None or self._reads_mcp:
            return BODY_HOLD_LIMIT
        if self._metering is not None and self._metering.reads_body():
            return BODY_HOLD_LIMIT
        return HOLD_LIMIT

    @property
    def _reads_mcp(self) -> bool:
        return self._mcp is not None and self._mcp.reads

    def _admit(self, body: bytes | None, granted: str | None = None) -> bytes | None:
        """The metering step before forwarding (`MeteredSteps.admit`): the body to
        forward instead, or None; once (a later call does nothing)."""
        part = self._metering
        if part is None or part.metered is not None:
            return None
        out, goes_on = part.admit(body, granted=granted, asks=self.asks is not None)
        if not goes_on:
            self._metering = None  # (mode: report: recorded, not metered)
        return out

    def _no_unread_body(self, body: bytes) -> None:
        if self._mcp is not None:
            self._mcp.no_unread_body(body)

    # -- the credential ---------------------------------------------------------------------

    def injected(self, credential: str, secret: str, value: SecretValue) -> None:
        self.credential = credential
        self._secret = (secret, value)
        self.trail.telemetry.count("credentials_injected", credential)
        self.head.headers.set("Accept-Encoding", "identity")  # (echoes redacted on plain)

    def sign_with(self, signer: Signer) -> None:
        """Sign the request with a minted credential: now if its payload is unsigned,
        else in `request_whole`, once the body is known (raises Refusal)."""
        if signer.needs_body(self.head):
            self._signer = signer
        else:
            signer.sign(self.head, self.target, None)

    @property
    def signing(self) -> bool:
        """True while the head waits to be signed over the whole body."""
        return self._signer is not None

    def streaming(self) -> None:
        """The engine is about to send the head and stream the body after it (or a head
        with no body to hold: a WebSocket upgrade, an HTTP/2 GET). The metering step runs
        now, before anything goes out, with no body held (a model named in the query is
        checked; a model expected in the body cannot be). Refused, too, if the request
        must be signed over its whole body (raises Refusal)."""
        self._admit(None)
        if self._mcp is not None and self._mcp.reads:
            self._mcp.check(None)  # (a body streamed is never held whole: refused)
        if self._signer is not None:
            raise Refusal("unsupported", f"credential {self.credential!r} signs requests "
                          "(AWS SigV4) over their whole body, and this body is over "
                          f"{self.hold_limit} bytes or of unknown length; send it with a "
                          "Content-Length within that, or sign it with "
                          "x-amz-content-sha256: UNSIGNED-PAYLOAD")

    def forward_path(self, path: str) -> None:
        """The request line goes out origin-form, built from the target; a Host header
        is always present (HTTP/1.0 and absolute-form requests may have had none)."""
        self.head.target = path
        if self.head.headers.get("host") is None and self.head.authority is None:
            tgt = self.target
            default = DEFAULT_PORTS[tgt.scheme]
            host = f"[{tgt.host}]" if ":" in tgt.host else tgt.host
            self.head.headers.set("Host", host if tgt.port == default else
                                  f"{host}:{tgt.port}")

    # -- request body ------------------------------------------------------------------------

    def request_data(self, chunk: bytes) -> bytes:
        """Scan a request body chunk; returns the bytes that may go upstream now."""
        charge_to(self.excess)  # (what its compressed data unpacks to: `unpacking`)
        self.streaming()
        self._admit(None)  # streamed: the body is not held (a models check refuses)
        if chunk:
            self._no_unread_body(chunk)
        return self._request.feed(chunk)

    def request_end(self, trailers: list[tuple[bytes, bytes]] | None = None) -> bytes:
        """The end of the request body (and its trailers, scanned like headers);
        returns what was held back."""
        charge_to(self.excess)
        return self._request.end(trailers)

    def request_whole(self, body: bytes, trailers: list[tuple[bytes, bytes]] | None = None
                      ) -> bytes:
        """A buffered request body, checked whole (engines that read bodies at once);
        returns the body to forward. The metering step reads it decoded; a body it
        rewrites (`stream_options.include_usage` added) goes out re-encoded, and the
        engine frames it by this length (`head_changed`: re-read the head, signed)."""
        return self._whole_out(body, *self._whole_checked(body, trailers))

    async def request_decided(self, body: bytes,
                              trailers: list[tuple[bytes, bytes]] | None = None) -> bytes:
        """`request_whole`, where a model the rule's allowlist refuses waits for a
        person's answer (ask mode, `asks` set by the gate) instead: allowed, it goes on
        as if the rule listed it; else the person's refusal is raised."""
        checked = self._whole_checked(body, trailers)
        try:
            return self._whole_out(body, *checked)
        except Held as held:
            assert self.asks is not None
            try:
                await self.asks(held.model, held)
            except Refusal:
                raise
            except Exception:  # (a bug; the store away is a Refusal): fail closed
                log.exception("asking about model %r failed; refusing", held.model[:100])
                raise Refusal(GATEWAY_ERROR.code, "the gateway could not ask a person about "
                              f"model {held.model[:100]!r} (see its log)", held.rule) from None
            return self._whole_out(body, *checked, granted=held.model)

    def granted(self, source: str, reason: str) -> None:
        """A person's grant let this exchange through (ask mode): its audit line names
        the grant as the rule."""
        was = self.decision
        assert was.rule is not None
        self.decision = Decision(was.result, reason, replace(was.rule, source=source, ask=None),
                                 was.inspect, was.credential)

    def _whole_checked(self, body: bytes, trailers: list[tuple[bytes, bytes]] | None
                       ) -> tuple[bytes | None, bool, bytes | None, bool]:
        """The leak, credential detection and MCP checks of a whole body: (it decoded,
        redacted if dlp: says so; whether it was encoded; the body an MCP relay sends
        instead; whether it was redacted)."""
        charge_to(self.excess)
        if body:
            self._no_unread_body(body)
        plain, encoded = self._request.whole(body, trailers, self.hold_limit)
        redacted = None
        if self.dlp is not None and (plain is not None or not encoded):
            # (decoded past the hold limit: read as it decoded, `RequestSide.whole`)
            redacted = self.dlp.whole(plain, self.body_type)
            plain = redacted if redacted is not None else plain
        relayed = self._mcp.check(plain) if self._mcp is not None and self._mcp.reads \
            else None
        if self.content is not None:
            self.content.request(plain, self.head.headers.get("content-type"))
        return plain, encoded, relayed, redacted is not None

    def _whole_out(self, body: bytes, plain: bytes | None, encoded: bool,
                   relayed: bytes | None, redacted: bool = False,
                   granted: str | None = None) -> bytes:
        """The metering step and the signature over a checked whole body: what goes."""
        whole = body
        replaced = self._admit(plain, granted) if relayed is None else relayed
        if replaced is None and redacted:
            replaced = plain
        if replaced is not None:  # in the coding the head names (it may be on its way)
            whole = encode(self.head.headers.joined("content-encoding"),
                           replaced) if encoded else replaced
        if self._signer is not None:
            self._signer.sign(self.head, self.target, whole)
            self._signer, self.signed, self.head_changed = None, True, True
        self.bytes_out = len(whole)
        return whole

    # -- response ------------------------------------------------------------------------

    def response(self, head: ResponseHead) -> ResponseHead:
        """Check and adjust the response head (`ResponseSide.head`): on a credential
        exchange echoes of the key are redacted (headers now, body as it streams), an
        encoded body is decoded, and the length is dropped where redaction may change
        it."""
        return self._response.head(head, self._secret, self._mcp, self._metering)

    def response_data(self, chunk: bytes) -> bytes:
        """One response body chunk as it should reach the client."""
        return self._response.data(chunk, self._mcp, self._metering)

    def response_end(self) -> bytes:
        """What is still held back at the end of the response body."""
        return self._response.end(self._mcp, self._metering)

    def response_trailers(self, fields: list[tuple[bytes, bytes]]
                          ) -> list[tuple[bytes, bytes]]:
        """Response trailers as they should reach the client (echoes redacted)."""
        return self._response.trailers(fields)

    # -- WebSocket messages ----------------------------------------------------------------

    def ws_message(self, from_client: bool, data: bytes) -> bytes:
        """A WebSocket message: from the client it must not leak, and on a rule with
        mcp: it is judged like a POST's body; from the upstream an echoed key is
        redacted, a metered session's events are metered and an MCP server's message is
        read like an answer. Raises Refusal, or MessageRefused for one message."""
        charge_to(self.excess)  # (both ways: an answer's runs are its sandbox's too)
        if from_client:
            assert self.scan is not None
            found = self.scan.whole(data, self.dlp.gate if self.dlp is not None else None)
            if found is not None:
                self.trail.telemetry.count("exfiltration_blocked", "websocket")
                raise self.leak(found)
            if self.dlp is not None:  # (after the leak scan: the gateway's own first)
                data = self.dlp.message(data)
            if self._mcp is not None:
                data = self._mcp.sent(data)
            if self._metering is not None:  # (a model outside the allowlist, a budget)
                self._metering.message(data)
            self.bytes_out += len(data)
        else:
            data = self._response.message(data, self._secret, self._mcp, self._metering)
        if self.content is not None:  # (as relayed: the content its policy exports)
            self.content.message(from_client, data)
        return data

    # -- ends ----------------------------------------------------------------------------

    def upstream_failed(self, kind: str, detail: str = "") -> Answer:
        """The upstream failed before a response reached the client: log the detail's
        words (never the bytes it quotes), audit, and answer with a reason from fixed
        sentences only."""
        log.info("upstream %s failed (%s): %s", self.where(), kind, error_phrase(detail))
        self.unsent = kind in ("connect", "tls", "tls_handshake")  # (the request never left)
        refusal = upstream_refusal(kind, detail, self.where())
        self.finish(refusal.status, error=refusal.code)
        return self.trail.render(refusal, self.target.host)

    def upstream_proxy_failed(self, reason: str) -> Answer:
        """The upstream proxy (network.upstream_proxy) did not open the tunnel: the
        request never left. `reason` names the proxy's status, never its words."""
        self.unsent = True
        refusal = Refusal("upstream_proxy_failed", reason)
        self.finish(refusal.status, error=refusal.code)
        return self.trail.render(refusal, self.target.host)

    def abort(self, refusal: Refusal) -> Answer:
        """Refuse the exchange part-way (a leak in the body, a bad response)."""
        if not self.done:
            self.done = True
            if self._mcp is not None:
                self._mcp.note_answers()
            self.trail.refuse(self.client, refusal, method=self.head.method,
                              scheme=self.target.scheme, host=self.target.host,
                              port=self.target.port, path=self.target.path,
                              started=self.started, usage=self._complete(),
                              mcp=self.mcp_calls, models=self.models, trace=self.trace,
                              trace_sent=self.trace_sent,
                              dlp=self.dlp_found, content=self._content())
        return self.trail.render(refusal, self.target.host)

    def finish(self, status: int | None, error: str | None = None,
               usage: dict[str, Any] | None = None) -> None:
        """The exchange ended (response relayed, or failed): one audit line."""
        if self.done:
            return
        self.done = True
        charge_to(None)  # (nothing more of it is read)
        self.trail.telemetry.count("bytes", "in", by=self.bytes_in)
        if self._metering is not None and self._metering.metered is not None:
            usage = self._complete()
        decision, report = self.decision, self.report
        relayed = self._mcp.refusal() if self._mcp is not None else None
        result, reason, rule = decision.result, decision.reason, source_of(decision)
        if relayed:
            result, reason = "deny", relayed.reason
        elif report is not None:  # (as stage 1 renders report mode, and evaluate does)
            result, reason, rule = "report", report.reason, report.rule or rule
        self.trail.audit(
            self.client, identity=self.identity, decision=result, reason=reason, rule=rule,
            method=self.head.method, scheme=self.target.scheme, host=self.target.host,
            port=self.target.port, path=self.target.path, status=status,
            error=relayed.code if relayed and error is None else error,
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, started=self.started,
            path_taken="intercept", credential=self.credential, usage=usage,
            mcp=self.mcp_calls, models=self.models, trace=self.trace, trace_sent=self.trace_sent,
            dlp=self.dlp_found, content=self._content())

    def _complete(self) -> dict[str, Any] | None:
        """The metering step at the end (`finish` or `abort`, whichever comes first and
        only once): the audit line's ``usage``."""
        return self._metering.complete() if self._metering is not None else None

    def _content(self) -> dict[str, str] | None:
        return self.content.export() if self.content is not None else None
