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
key among them) goes to the log only up to its first quote (`phrases.error_phrase`),
never to the sandbox.

Request bodies are scanned as they stream; the tail of each chunk that could start a
marker is held back until the next chunk shows it is clean, so no part of a leaking
token or key goes out before the scan sees it whole. A compressed body is decoded for
the scan (and forwarded as sent, once whole, up to `ENCODED_LIMIT`). On a credential
exchange the upstream is asked for `Accept-Encoding: identity`; a response that comes
encoded anyway is decoded, and every echo of the key is redacted in headers and body.

A credential that signs requests (SigV4) installs a `Signer`: a request whose payload
is not signed is signed at once; otherwise the body is held whole (up to
`SIGNED_BODY_LIMIT`) and `request_whole` signs the head before the engine serialises
it. An engine about to stream a body calls `streaming()` first, which refuses such a
request: it cannot be signed before its head goes out.

**One hold limit.** `hold_limit` says how much of a request body every engine holds
before forwarding: `BODY_HOLD_LIMIT` where a check needs the body whole (an inference
call on a metered credential, a model allowlist reading the body, a signature over the
body), else `HOLD_LIMIT`. A body that ends within it goes through `request_whole`,
decoded first if compressed: the metering step reads it as the provider will, and a
body it rewrites is sent re-encoded in the coding its head names.

On metered WebSocket sessions each message from the sandbox goes through the metering
step: a refused one raises `MessageRefused` (audited; the engine drops it and answers the
provider's error event while the session goes on). On a rule with `mcp:` each message
from the sandbox is judged as a POST's body would be (`core/mcp.py`; refused the same
way, answered with JSON-RPC errors), and every answer of the server, on HTTP or a
WebSocket, is read before the client sees it (`core/mcp_answers.py`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from gateway.core import mcp, strictjson
from gateway.core.addresses import Pinned
from gateway.core.body_stage import NO_CALLS, Stage, mcp_stage, metering_stage
from gateway.core.client import Client
from gateway.core.encodings import Decoder, EncodingError, decoder_for, encode
from gateway.core.evaluate import UNSEEN
from gateway.core.identity import Identity
from gateway.core.leaks import LeakScan, Redactor, StreamScan
from gateway.core.mcp import Call
from gateway.core.mcp_answers import JSON, SSE, Answers, media_type
from gateway.core.messages import RequestHead, ResponseHead
from gateway.core.metering import MODEL_BODY_LIMIT, classify, model_in_body
from gateway.core.metering.models import named_models
from gateway.core.metering.refusals import refusal as step_refusal
from gateway.core.metering.usage import RESPONSE_HOLD
from gateway.core.phrases import error_phrase
from gateway.core.policy import Decision, Policy
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.policy.model import records_only
from gateway.core.ports import MeteredCall, Metering, Secrets, Signer
from gateway.core.refusal import (
    ERROR_HEADER,
    GATEWAY_ERROR,
    Answer,
    MessageRefused,
    Refusal,
    rpc_error,
    ws_error,
)
from gateway.core.secret_value import SecretValue
from gateway.core.target import DEFAULT_PORTS, Target
from gateway.core.trail import Trail, rule_of

log = logging.getLogger("sandbox_gateway")

__all__ = ["BODY_HOLD_LIMIT", "ENCODED_LIMIT", "HOLD_LIMIT", "SIGNED_BODY_LIMIT", "Exchange",
           "no_body"]

ENCODED_LIMIT = 8 * 1024 * 1024  # a compressed request body is held whole up to this size
HOLD_LIMIT = 1024 * 1024  # a request body that ends within this is checked whole first
BODY_HOLD_LIMIT = MODEL_BODY_LIMIT  # held whole where a check needs the body (see above)
SIGNED_BODY_LIMIT = BODY_HOLD_LIMIT  # a body signed whole (SigV4) is held up to this
_UPSTREAM_KINDS = {
    "connect": "the upstream {where} could not be reached ({detail})",
    "tls": "the TLS handshake with the upstream {where} failed ({detail}); if it uses a "
           "private CA, add it to network.upstream_ca",
    "tls_handshake": "the upstream {where} did not complete a TLS handshake ({detail})",
    "protocol": "the upstream {where} sent an invalid HTTP response",
    "closed": "the upstream {where} closed the connection without a complete response",
    "encoding": "the upstream {where} answered with a content coding the gateway cannot "
                "decode to check for keys",
}


def no_body(method: str, status: int) -> bool:
    """A response that has no body whatever its headers say."""
    return method == "HEAD" or status in (204, 304) or 100 <= status < 200


class Exchange:
    """See the module docstring."""

    def __init__(self, trail: Trail, secrets: Secrets, client: Client, identity: Identity,
                 head: RequestHead, target: Target, decision: Decision, pinned: Pinned,
                 started: float) -> None:
        self.trail = trail
        self.secrets = secrets
        self.client = client
        self.identity = identity
        self.head = head
        self.target = target
        self.decision = decision
        self.pinned = pinned
        self.started = started
        self.scan: LeakScan | None = None
        self.credential: str | None = None
        self._secret: tuple[str, SecretValue] | None = None
        self._request_scan: StreamScan | None = None
        self._decoder: Decoder | None = None
        self._encoded: list[bytes] | None = None
        self._held = b""
        self._redactor: Redactor | None = None
        self._response_decoder: Decoder | None = None
        self.response_head: ResponseHead | None = None
        self.bytes_out = 0
        self.bytes_in = 0
        self.done = False
        self._metering: tuple[Metering, Policy, str | None] | None = None
        self._metered: MeteredCall | None = None
        self._meter_feed: Callable[[bytes], None] | None = None  # the meter's, per chunk
        self._report: Refusal | None = None  # what mode: report only recorded
        self._signer: Signer | None = None  # signs the head once the body is whole
        self.signed = False  # the head was signed after the gate returned (SigV4)
        self.head_changed = False  # request_whole changed the head (signed over the body)
        self._response_held: list[bytes] | None = None  # an answer read before relaying
        self._unsent = False  # the request never reached the upstream (connect failed)
        self._mcp: McpRule | None = None  # the rule's mcp: (its POST bodies are JSON-RPC)
        self._mcp_mode = "enforce"  # its policy's mode (report: refusals only recorded)
        self._mcp_session: mcp.Session | None = None
        self._mcp_pins: mcp.Pinned | None = None  # pin_descriptions: the server's pins
        self._mcp_pending: dict[mcp.Key, Any] = {}  # requests sent, waiting for answers
        self._mcp_batch = False  # they went as a batch
        self._mcp_asks: dict[mcp.Key, dict[str, Any]] = {}  # a WebSocket's refused asks
        self._answers: Answers | None = None  # reads the server's answers
        self.mcp_calls: list[dict[str, Any]] | None = None  # the audit line's `mcp`
        self.models: list[str] | None = None  # the audit line's `models` (an allowlist's)
        self._relayed: Refusal | None = None  # refused, answered through the server (mcp.relay)
        # ask mode: asks a person about a model the allowlist refuses (raises the refusal)
        self.asks: Callable[[str, Refusal], Awaitable[None]] | None = None

    # -- metering (model allowlists, budgets, usage) --------------------------------------

    def meter(self, metering: Metering, policy: Policy, preset: str | None) -> None:
        """Meter this credential exchange (set up by the gate)."""
        self._metering = (metering, policy, preset)

    @property
    def hold_limit(self) -> int:
        """How much of the request body every engine holds before forwarding (see the
        module docstring): BODY_HOLD_LIMIT for a metered inference call, a model
        allowlist reading the body, or a signature over it; else HOLD_LIMIT."""
        if self._signer is not None or self._reads_mcp:
            return BODY_HOLD_LIMIT
        rule = self.decision.rule
        if self._metering is not None and rule is not None:
            method, path = self.head.method, self.target.path
            if classify(method, path) is not None or model_in_body(rule, method, path):
                return BODY_HOLD_LIMIT
        return HOLD_LIMIT

    def _admit(self, body: bytes | None, granted: str | None = None) -> bytes | None:
        """The metering step before forwarding: the model allowlist and what cannot be
        metered (403), budgets (429); returns the body to forward instead (usage asked
        for on a stream), or None. `granted`: a model a person allowed besides the
        rule's (ask mode); a model the allowlist refuses that a person may allow raises
        `Held` (a Refusal) when the gate gave the exchange someone to ask (`asks`)."""
        if self._metering is None or self._metered is not None:
            return None
        metering, policy, preset = self._metering
        rule = self.decision.rule
        assert rule is not None
        if (rule.models is not None or policy.mode == "learn") and self.models is None:
            # (replay decides them again; `policy learn` lists them)
            self.models = list(named_models(self.head.method, self.target.path, body))
        stage = metering_stage(metering, policy, rule, sandbox=self.identity.sandbox,
                               preset=preset, method=self.head.method,
                               path=self.target.path, body=body, now=self.trail.clock(),
                               granted=granted)
        if stage.refusal is not None:
            if stage.report:  # mode: report: forward, record the would-deny
                self._report = stage.refusal
                self._metering = None
                return None
            if self.asks is not None and stage.ask is not None:
                raise Held(stage.refusal, stage.ask)
            raise stage.refusal
        step = stage.admitted
        assert step is not None
        self._metered = step
        if step.capture is not None:
            self._meter_feed = step.feed
        elif step.meter is not None:
            self._meter_feed = step.meter.feed
        if step.holds_response:
            self._response_held = []
        return step.body

    # -- MCP calls (a rule with mcp:) -----------------------------------------------------

    def mcp(self, rule: McpRule, session: mcp.Session, *, report: bool,
            pins: mcp.Pinned | None = None) -> None:
        """Decide this exchange's JSON-RPC calls by `rule`, within its MCP `session`
        (set up by the gate); `pins`: its server's tool pins (`pin_descriptions`); a
        method no MCP transport uses is refused (raises Refusal)."""
        self._mcp, self._mcp_session = rule, session
        self._mcp_mode = "report" if report else "enforce"
        self._mcp_pins = pins
        self._mcp_refused(mcp_stage(rule, self._mcp_mode, self.head.method, UNSEEN,
                                    frozenset(), _source(self.decision)))

    def _mcp_refused(self, stage: Stage) -> None:
        """A body-stage refusal of the request before any call was read: recorded under
        mode: report, else raised."""
        if stage.refusal is None:
            return
        self.mcp_calls = [dict(c) for c in NO_CALLS]
        if stage.report:
            self._report = stage.refusal
            return
        raise stage.refusal

    def _no_unread_body(self, body: bytes) -> None:
        """On a rule with mcp: a GET or DELETE carrying a body is refused
        (`mcp.body_refusal`; raises Refusal)."""
        if self._mcp is None or self.head.method == "POST":
            return
        self._mcp_refused(mcp_stage(self._mcp, self._mcp_mode, self.head.method, body,
                                    frozenset(), _source(self.decision)))

    @property
    def _reads_mcp(self) -> bool:
        """A body of JSON-RPC calls to decide (what an MCP client POSTs)."""
        return self._mcp is not None and self.head.method == "POST"

    def _check_mcp(self, body: bytes | None) -> bytes | None:
        """Every call in the body allowed by the rule's `mcp:`, or the body refused whole
        (raises Refusal, answered as JSON-RPC errors); for a client of the older HTTP+SSE
        transport (one that does not accept an event stream in answer to its POST) the
        refused requests are relayed as pings instead, and the body to send returned.
        The client's answers to server requests the gateway refused are rewritten into
        those refusals (`mcp.answer_asks`): the body to send is returned then too."""
        assert self._mcp is not None and self._mcp_session is not None
        found, refusal = self._judge(body)
        self._mcp_pending = {mcp.key(c.id): c.id for c in found if c.is_request}
        self._mcp_batch = bool(found) and (body or b"").lstrip(b" \t\r\n")[:1] == b"["
        if refusal is None or self._mcp_mode == "report":
            asks = self._mcp_session.asks
            return mcp.answer_asks(body, asks) if asks and body is not None else None
        accept = (self.head.headers.get("accept") or "").lower()
        if refusal.rpc is None or not refusal.rpc[0] or "text/event-stream" in accept:
            raise refusal
        self._relayed = refusal
        relayed = mcp.relay(self._mcp_session, refusal)
        self._mcp_pending = {mcp.key(ping["id"]): ident  # (the pings' answers are awaited)
                             for ping, ident in zip(mcp.read(relayed)[0], refusal.rpc[0],
                                                    strict=True)}
        return relayed

    def _judge(self, body: bytes | None) -> tuple[list[Call], Refusal | None]:
        """The body stage's MCP step on a body (or WebSocket message, judged as a POST's
        body would be), its calls on the audit line and counted; under `mode: report` a
        refusal is only recorded (returned, not to be raised)."""
        assert self._mcp is not None and self._mcp_session is not None
        stage = mcp_stage(self._mcp, self._mcp_mode, "POST", body,
                          self._mcp_session.changed if self._mcp_pins is None
                          else self._mcp_pins, _source(self.decision))
        found = list(stage.calls)
        called = [c for c in found if c.method is not None]
        records = [c.record() for c in called] if found else [dict(c) for c in NO_CALLS]
        self.mcp_calls = ((self.mcp_calls or []) + records)[:mcp.MAX_AUDITED]
        for record in records:
            self.trail.telemetry.count("mcp_calls", self.identity.policy,
                                       str(record["decision"]))
        if stage.report:
            self._report = stage.refusal
        return found, stage.refusal

    # -- set up by the gate ----------------------------------------------------------------

    def injected(self, credential: str, secret: str, value: SecretValue) -> None:
        self.credential = credential
        self._secret = (secret, value)
        self.trail.telemetry.count("credentials_injected", credential)
        # Ask for an uncompressed answer: echoes are redacted on plain bytes.
        self.head.headers.set("Accept-Encoding", "identity")

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
        if self._reads_mcp:
            self._check_mcp(None)  # (a body streamed is never held whole: refused)
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

    def leak(self, kind: str) -> Refusal:
        self.trail.telemetry.count("exfiltration_blocked", kind)
        return leak_refusal(kind, self.target.host)

    # -- request body ------------------------------------------------------------------------

    def _scanner(self) -> StreamScan:
        if self._request_scan is None:
            assert self.scan is not None
            self._request_scan = self.scan.stream()
            coding = self.head.headers.get("content-encoding")
            try:
                self._decoder = decoder_for(coding)
            except EncodingError as exc:
                raise Refusal("bad_request", f"the request body cannot be checked: {exc}; "
                              "send it uncompressed or with gzip, deflate or br") from None
            if self._decoder is not None:
                self._encoded = []
        return self._request_scan

    def _check(self, scanner: StreamScan, data: bytes) -> None:
        found = scanner.feed(data)
        if found is not None:
            raise self.leak(found)

    def request_data(self, chunk: bytes) -> bytes:
        """Scan a request body chunk; returns the bytes that may go upstream now."""
        self.streaming()
        self._admit(None)  # streamed: the body is not held (a models check refuses)
        if chunk:
            self._no_unread_body(chunk)
        scanner = self._scanner()
        if self._decoder is not None:
            assert self._encoded is not None
            self._encoded.append(chunk)
            if sum(map(len, self._encoded)) > ENCODED_LIMIT:
                raise Refusal("bad_request", f"a compressed request body over "
                              f"{ENCODED_LIMIT} bytes cannot be checked; send it "
                              "uncompressed")
            try:
                for piece in self._decoder.feed(chunk):
                    self._check(scanner, piece)
            except EncodingError as exc:
                raise Refusal("bad_request", f"the request body cannot be checked: "
                              f"{exc}") from None
            return b""
        self._check(scanner, chunk)
        data = self._held + chunk if self._held else chunk
        keep = self.scan.keep if self.scan is not None else 0
        if len(data) <= keep:
            self._held = data
            return b""
        self._held = data[len(data) - keep:] if keep else b""
        out = data[: len(data) - keep] if keep else data
        self.bytes_out += len(out)
        return out

    def request_end(self, trailers: list[tuple[bytes, bytes]] | None = None) -> bytes:
        """The end of the request body (and its trailers, scanned like headers);
        returns what was held back."""
        scanner = self._scanner()
        if self._decoder is not None:
            try:
                for piece in self._decoder.end():
                    self._check(scanner, piece)
            except EncodingError as exc:
                raise Refusal("bad_request", f"the request body cannot be checked: "
                              f"{exc}") from None
        if trailers:
            assert self.scan is not None
            found = self.scan.head("", "", trailers)
            if found is not None:
                raise self.leak(found)
        if self._encoded is not None:
            out = b"".join(self._encoded)
            self._encoded = []
        else:
            out, self._held = self._held, b""
        self.bytes_out += len(out)
        return out

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
            except Exception:  # (the state store, a bug): fail closed, as a refusal
                log.exception("asking about model %r failed; refusing", held.model[:100])
                raise Refusal(GATEWAY_ERROR.code, "the gateway could not ask a person about "
                              f"model {held.model[:100]!r} (see its log)", held.rule) from None
            return self._whole_out(body, *checked, granted=held.model)

    def granted(self, source: str, reason: str) -> None:
        """A person's grant let this exchange through (ask mode): its audit line names
        the grant as the rule."""
        rule = self.decision.rule
        assert rule is not None
        self.decision = replace(self.decision, reason=reason,
                                rule=replace(rule, source=source, ask=None))

    def _whole_checked(self, body: bytes, trailers: list[tuple[bytes, bytes]] | None
                       ) -> tuple[bytes | None, bool, bytes | None]:
        """The leak and MCP checks of a whole body: (it decoded, whether it was encoded,
        the body an MCP relay sends instead)."""
        if body:
            self._no_unread_body(body)
        scanner = self._scanner()
        plain: bytes | None = body
        encoded = self._decoder is not None
        if encoded:
            plain = self._decode_whole(scanner, body)
        else:
            self._check(scanner, body)
        if trailers:
            assert self.scan is not None
            found = self.scan.head("", "", trailers)
            if found is not None:
                raise self.leak(found)
        relayed = self._check_mcp(plain) if self._reads_mcp else None
        return plain, encoded, relayed

    def _whole_out(self, body: bytes, plain: bytes | None, encoded: bool,
                   relayed: bytes | None, granted: str | None = None) -> bytes:
        """The metering step and the signature over a checked whole body: what goes."""
        whole = body
        replaced = self._admit(plain, granted) if relayed is None else relayed
        if replaced is not None:  # in the coding the head names (it may be on its way)
            whole = encode(self.head.headers.get("content-encoding"),
                           replaced) if encoded else replaced
        if self._signer is not None:
            self._signer.sign(self.head, self.target, whole)
            self._signer, self.signed, self.head_changed = None, True, True
        self.bytes_out = len(whole)
        return whole

    def _decode_whole(self, scanner: StreamScan, body: bytes) -> bytes | None:
        """Scan a whole compressed body decoded; returns it decoded, or None when it
        decodes to more than the hold limit (then it is not read, only scanned)."""
        assert self._decoder is not None
        limit = self.hold_limit
        pieces: list[bytes] = []
        size = 0
        try:
            for source in (self._decoder.feed(body), self._decoder.end()):
                for piece in source:
                    self._check(scanner, piece)
                    size += len(piece)
                    if size <= limit:
                        pieces.append(piece)
        except EncodingError as exc:
            raise Refusal("bad_request", f"the request body cannot be checked: "
                          f"{exc}") from None
        self._decoder, self._encoded = None, None
        return b"".join(pieces) if size <= limit else None

    # -- response ------------------------------------------------------------------------

    def response(self, head: ResponseHead) -> ResponseHead:
        """Check and adjust the response head: on a credential exchange echoes of the
        key are redacted (headers now, body as it streams), an encoded body is decoded,
        and the length is dropped where redaction may change it."""
        self.response_head = head
        if self._metered is not None and self._metered.meter is not None:
            self._metered.head(head.headers.get)
        if self._mcp is not None and not no_body(self.head.method, head.status):
            self._read_answers(head)
        if self._secret is None:
            if self._answers is not None:
                self._decode_response(head)
            return head
        name, value = self._secret
        if head.status == 401:
            self.secrets.invalidate(name, rejected=value)
        redactor = self._redactor = Redactor(value.variants())
        head.reason = redactor.redact(head.reason.encode("latin-1", "replace")).decode(
            "latin-1")
        if redactor.found_in(v for _, v in head.headers.fields):
            head.headers.fields = [(k, redactor.redact(v)) for k, v in head.headers.fields]
        if no_body(self.head.method, head.status) or head.headers.get("content-length") == "0":
            return head
        self._decode_response(head)
        return head

    def _decode_response(self, head: ResponseHead) -> None:
        """The body is rewritten (echoes redacted, tool lists filtered): decoded if it
        is encoded, and its length dropped (raises Refusal)."""
        coding = head.headers.get("content-encoding")
        try:
            self._response_decoder = decoder_for(coding)
        except EncodingError:
            raise Refusal("upstream_failed", _UPSTREAM_KINDS["encoding"].format(
                where=self._where())) from None
        if self._response_decoder is not None:
            head.headers.remove("content-encoding")
        head.headers.remove("content-length")  # redaction may change the length

    def _read_answers(self, head: ResponseHead) -> None:
        """The server's answers are read before the client sees them (`core/mcp_answers`):
        a POST's, which must be JSON or an event stream answering its requests, and the
        event stream a GET opens. A status other than 2xx is an HTTP error, no answer
        (clients do not read its body as JSON-RPC): it passes, as does a DELETE's answer
        and a GET's that no event stream was asked for. An answer of another content
        type is replaced whole: by the JSON-RPC errors of the requests waiting (an empty
        event stream on a GET), its head saying why (`X-Sandbox-Gateway-Error`)."""
        assert self._mcp is not None and self._mcp_session is not None
        method = self.head.method
        if not 200 <= head.status < 300 or method not in ("POST", "GET"):
            return
        kind = media_type(head.headers.get_all("content-type"))
        asked = "text/event-stream" in (self.head.headers.get("accept") or "").lower()
        if method == "GET" and kind != SSE and not asked:
            return
        pending: dict[mcp.Key, Any] | None = None if method == "GET" else self._mcp_pending
        drop = method == "POST" and (head.status == 202 or (  # (no answer: 202 Accepted,
            kind not in (JSON, SSE) and not pending))  # or one to notifications only)
        answers = self._answers = Answers(
            self._mcp, self._mcp_session, sse=kind == SSE, pending=pending,
            batch=self._mcp_batch, source=_source(self.decision), where=self._where(),
            drop=drop, pins=self._mcp_pins)
        if drop:
            return
        if kind not in (JSON, SSE):
            answers.refuse_whole("a content type other than application/json or "
                                 "text/event-stream")
            kind = SSE if method == "GET" else JSON
            head.headers.set(ERROR_HEADER, "upstream_failed")
        head.headers.set("Content-Type", kind)  # (as read: no parameter goes on)

    def response_data(self, chunk: bytes) -> bytes:
        """One response body chunk as it should reach the client."""
        self.bytes_in += len(chunk)
        redactor = self._redactor
        if redactor is None and self._answers is None:
            return chunk
        if self._response_decoder is not None:
            try:
                chunk = b"".join(self._response_decoder.feed(chunk))
            except EncodingError:
                raise Refusal("upstream_failed", _UPSTREAM_KINDS["encoding"].format(
                    where=self._where())) from None
        if self._meter_feed is not None:
            self._meter_feed(chunk)
        out = redactor.feed(chunk) if redactor is not None else chunk
        if self._answers is not None:
            out = self._answers.feed(out)
        held = self._response_held
        if held is None:
            return out
        held.append(out)
        if sum(map(len, held)) > RESPONSE_HOLD:
            raise Refusal("upstream_failed", f"the upstream {self._where()} answered a "
                          f"secret-minting call with more than {RESPONSE_HOLD} bytes")
        return b""

    def response_end(self) -> bytes:
        """What is still held back at the end of the response body."""
        redactor = self._redactor
        if redactor is None and self._answers is None:
            return b""
        out = b""
        if self._response_decoder is not None:
            try:
                tail = b"".join(self._response_decoder.end())
                if self._meter_feed is not None:
                    self._meter_feed(tail)
                out = redactor.feed(tail) if redactor is not None else tail
            except EncodingError:
                raise Refusal("upstream_failed", _UPSTREAM_KINDS["encoding"].format(
                    where=self._where())) from None
        if redactor is not None:
            out += redactor.end()
        answers = self._answers
        if answers is not None:
            out = answers.feed(out) + answers.end()
            self._note_answers(answers)
        held = self._response_held
        if held is not None and self._metered is not None and self._metering is not None:
            body = b"".join(held) + out
            self._response_held = None
            status = self.response_head.status if self.response_head is not None else 0
            released = self._metering[0].release(self._metered, status, body, self.trail.clock())
            if isinstance(released, str):
                raise Refusal("minted_secret_refused", released, rule_of(self.decision))
            return released
        return out

    def _note_answers(self, answers: Answers) -> None:
        """What the answers showed, on the audit line: tools whose description changed
        in this session, the server's own requests and their decisions."""
        changed = answers.lists.changed
        verdict = "hidden" if self._mcp is not None and self._mcp.pin_descriptions \
            else "changed"
        records = [*answers.calls, *({"method": "tools/list", "name": name[:200],
                                      "decision": f"description_{verdict}"}
                                     for name in changed)]
        for record in answers.calls:
            self.trail.telemetry.count("mcp_calls", self.identity.policy,
                                       str(record["decision"]))
        answers.calls, answers.lists.changed = [], []
        if records:
            self.mcp_calls = ((self.mcp_calls or []) + records)[:mcp.MAX_AUDITED]

    def response_trailers(self, fields: list[tuple[bytes, bytes]]
                          ) -> list[tuple[bytes, bytes]]:
        """Response trailers as they should reach the client (echoes redacted)."""
        redactor = self._redactor
        if redactor is None:
            return fields
        return [(k, redactor.redact(v)) for k, v in fields]

    def ws_message(self, from_client: bool, data: bytes) -> bytes:
        """A WebSocket message: from the client it must not leak, and on a rule with
        mcp: it is judged like a POST's body; from the upstream an echoed key is
        redacted, a metered session's events are metered and an MCP server's message is
        read like an answer. Raises Refusal, or MessageRefused for one message."""
        if from_client:
            assert self.scan is not None
            found = self.scan.find(data)
            if found is not None:
                self.trail.telemetry.count("exfiltration_blocked", "websocket")
                raise self.leak(found)
            if self._mcp is not None:
                data = self._mcp_sent(data)
            if self._metered is not None and self._metering is not None:
                step = self._metering[0].session_message(self._metered, data, self.trail.clock())
                if step is not None:  # a model outside the allowlist, a used-up budget
                    self._refuse_message(step_refusal(step), data)
            self.bytes_out += len(data)
            return data
        self.bytes_in += len(data)
        if self._metered is not None and self._metering is not None:  # a session's event
            self._metering[0].session_event(self._metered, data, self.trail.clock())
        if self._secret is not None:
            redactor = self._redactor or Redactor(self._secret[1].variants())
            data = redactor.redact(data)
        else:
            self.trail.telemetry.count("bytes", "websocket", by=len(data))
        return self._mcp_received(data) if self._mcp is not None else data

    def _mcp_sent(self, data: bytes) -> bytes:
        """A client's WebSocket message on a rule with mcp:, judged as a POST's body: a
        refused one is answered with its JSON-RPC errors while the session goes on
        (raises MessageRefused); its requests then wait for their answers."""
        found, refusal = self._judge(data)
        if refusal is not None and self._mcp_mode != "report":
            ids, batch = refusal.rpc or ([], False)
            errors = [rpc_error(refusal, i) for i in ids] or \
                ([] if found else [rpc_error(refusal, None)])  # (notifications: no answer)
            reply = strictjson.dumps(errors if batch else errors[0]) if errors else b""
            self._refuse_mcp(refusal, reply, [c.record() for c in found if c.method] or
                             [{"method": None, "name": None, "decision": "deny"}])
        for call in found:
            if call.is_request:
                self._mcp_pending[mcp.key(call.id)] = call.id
        while len(self._mcp_pending) > mcp.RELAYS * 16:  # (a client that never hears back)
            del self._mcp_pending[next(iter(self._mcp_pending))]
        if self._mcp_asks:
            return mcp.answer_asks(data, self._mcp_asks) or data
        return data

    def _mcp_received(self, data: bytes) -> bytes:
        """A server's WebSocket message on a rule with mcp:, read as an answer: what the
        client may read, or (unreadable) dropped while every request waiting gets its
        JSON-RPC error (raises MessageRefused)."""
        assert self._mcp is not None and self._mcp_session is not None
        if self._answers is None:
            self._answers = Answers(self._mcp, self._mcp_session, sse=False,
                                    pending=self._mcp_pending, asks=self._mcp_asks,
                                    source=_source(self.decision), where=self._where(),
                                    pins=self._mcp_pins)
        try:
            out = self._answers.message(data)
        except mcp.Unreadable as exc:
            refusal = self._answers.refused(str(exc))
            errors = self._answers.errors(refusal)
            self._refuse_mcp(refusal, strictjson.dumps(errors[0] if len(errors) == 1
                                                        else errors) if errors else b"", None)
        self._note_answers(self._answers)
        return out

    def _refuse_mcp(self, refusal: Refusal, reply: bytes,
                    calls: list[dict[str, Any]] | None) -> None:
        """One MCP message of a WebSocket refused: audited with its `calls` (the session
        goes on, its own line comes when it ends), `reply` sent to the client (raises
        MessageRefused)."""
        self.trail.refuse(self.client, refusal, method=self.head.method,
                          scheme=self.target.scheme, host=self.target.host,
                          port=self.target.port, path=self.target.path,
                          started=self.trail.clock(), mcp=calls)
        raise MessageRefused(refusal, reply)

    def _refuse_message(self, refusal: Refusal, data: bytes) -> None:
        """One message of a session refused: audited (the session goes on, its own line
        comes when it ends), answered as the provider's error event (raises
        MessageRefused). Under ``mode: report`` it is only recorded."""
        if self._metering is not None and records_only(self._metering[1].mode):
            self._report = refusal
            return
        self.trail.refuse(self.client, refusal, method=self.head.method,
                          scheme=self.target.scheme, host=self.target.host,
                         port=self.target.port, path=self.target.path, started=self.trail.clock())
        meter = self._metered.meter if self._metered is not None else None
        session = meter.format if meter is not None else "realtime"
        raise MessageRefused(refusal, ws_error(refusal, session, stream_id=_lane(data)))

    # -- ends ----------------------------------------------------------------------------

    def _where(self) -> str:
        return f"{self.target.host}:{self.target.port}"

    def upstream_failed(self, kind: str, detail: str = "") -> Answer:
        """The upstream failed before a response reached the client: log the detail's
        words (never the bytes it quotes), audit, and answer with a reason from fixed
        sentences only."""
        log.info("upstream %s failed (%s): %s", self._where(), kind, error_phrase(detail))
        reason = _UPSTREAM_KINDS.get(kind, _UPSTREAM_KINDS["connect"]).format(
            where=self._where(), detail=_clean_detail(detail))
        self._unsent = kind in ("connect", "tls", "tls_handshake")  # (the request never left)
        code = "upstream_timeout" if kind == "timeout" else "upstream_failed"
        if kind == "timeout":
            reason = f"the upstream {self._where()} sent nothing for too long ({detail})"
        refusal = Refusal(code, reason)
        self.finish(refusal.status, error=code)
        return self.trail.render(refusal, self.target.host)

    def upstream_proxy_failed(self, reason: str) -> Answer:
        """The upstream proxy (network.upstream_proxy) did not open the tunnel: the
        request never left. `reason` names the proxy's status, never its words."""
        self._unsent = True
        refusal = Refusal("upstream_proxy_failed", reason)
        self.finish(refusal.status, error=refusal.code)
        return self.trail.render(refusal, self.target.host)

    def abort(self, refusal: Refusal) -> Answer:
        """Refuse the exchange part-way (a leak in the body, a bad response)."""
        if not self.done:
            self.done = True
            if self._answers is not None:
                self._note_answers(self._answers)
            self.trail.refuse(self.client, refusal, method=self.head.method,
                              scheme=self.target.scheme, host=self.target.host,
                              port=self.target.port, path=self.target.path,
                              started=self.started, usage=self._complete(),
                              mcp=self.mcp_calls, models=self.models)
        return self.trail.render(refusal, self.target.host)

    def finish(self, status: int | None, error: str | None = None,
               usage: dict[str, Any] | None = None) -> None:
        """The exchange ended (response relayed, or failed): one audit line."""
        if self.done:
            return
        self.done = True
        self.trail.telemetry.count("bytes", "in", by=self.bytes_in)
        if self._metered is not None:
            usage = self._complete()
        decision, relayed, report = self.decision, self._relayed, self._report
        if self._answers is not None:
            self._note_answers(self._answers)
            relayed = relayed or self._answers.refusal  # (an answer not passed on)
        result, reason, rule = decision.result, decision.reason, _source(decision)
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
            mcp=self.mcp_calls, models=self.models)

    def _complete(self) -> dict[str, Any] | None:
        """The metering step at the end (`finish` or `abort`, whichever comes first and
        only once): the audit line's ``usage``. It counts what the upstream answered (0:
        no answer, a stream that may still have used its reservation), not the status
        the gateway put on the line."""
        if self._metered is None or self._metering is None:
            return None
        head = self.response_head
        return self._metering[0].complete(self._metered, head.status if head else 0,
                                          self.trail.clock(), sent=not self._unsent).as_record()

    @property
    def elapsed(self) -> float:
        return self.trail.clock() - self.started


class Held(Refusal):
    """A model the rule's allowlist refuses that a person may allow (ask mode); a
    Refusal, so what cannot wait for the answer refuses it."""

    def __init__(self, refusal: Refusal, model: str) -> None:
        super().__init__(refusal.code, refusal.reason, refusal.rule,
                         retry_after=refusal.retry_after)
        self.model = model


def leak_refusal(kind: str, host: str) -> Refusal:
    """The refusal of a request carrying a key or token (`kind`) to `host`."""
    what = "a gateway token" if kind == "token" else \
        "a real API key (or a provider-minted secret, or its alias)"
    return Refusal("exfiltration_blocked", f"the request carries {what} to {host}, which "
                   "is not bound to it; keys and tokens go only to the hosts of their "
                   "credential (send the token only in the credential's own header, on a "
                   "rule with credential:)")


def _source(decision: Decision) -> str | None:
    return decision.rule.source if decision.rule is not None else None


def _lane(data: bytes) -> str | None:
    """The ``stream_id`` a refused Responses WebSocket event named (its answer's lane)."""
    if b'"stream_id"' not in data:
        return None
    try:
        lane = json.loads(data).get("stream_id")
    except (ValueError, AttributeError):
        return None
    return lane if isinstance(lane, str) else None


def _clean_detail(detail: str) -> str:
    """An OS or TLS error phrase (fixed library text), never bytes from the upstream."""
    text = detail.split(":", 1)[0] if "b'" in detail or 'b"' in detail else detail
    return "".join(c for c in text if c.isalnum() or c in " ._-()")[:120] or "error"
