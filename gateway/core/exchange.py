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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from gateway import metrics
from gateway.core.addresses import Pinned
from gateway.core.encodings import Decoder, EncodingError, decoder_for
from gateway.core.leaks import LeakScan, Redactor, StreamScan
from gateway.core.messages import RequestHead, ResponseHead
from gateway.core.phrases import error_phrase
from gateway.core.refusal import Answer, Refusal
from gateway.core.target import DEFAULT_PORTS, Target
from gateway.metering import MODEL_BODY_LIMIT, Metering, model_in_body
from gateway.metering import Exchange as MeteredExchange
from gateway.policy import Decision, Policy
from gateway.secrets.value import SecretValue
from gateway.tokens import Identity

if TYPE_CHECKING:
    from gateway.core.gate import Client, Gate

log = logging.getLogger("sandbox_gateway")

__all__ = ["ENCODED_LIMIT", "SIGNED_BODY_LIMIT", "Exchange", "Signer", "no_body"]

ENCODED_LIMIT = 8 * 1024 * 1024  # a compressed request body is held whole up to this size
HOLD_LIMIT = 1024 * 1024  # a request body that ends within this is checked whole first
SIGNED_BODY_LIMIT = MODEL_BODY_LIMIT  # a body signed whole (SigV4) is held up to this
_UPSTREAM_KINDS = {
    "connect": "the upstream {where} could not be reached ({detail})",
    "tls": "the TLS handshake with the upstream {where} failed ({detail}); if it uses a "
           "private CA, add it to network.upstream_ca",
    "protocol": "the upstream {where} sent an invalid HTTP response",
    "closed": "the upstream {where} closed the connection without a complete response",
    "encoding": "the upstream {where} answered with a content coding the gateway cannot "
                "decode to check for keys",
}


class Signer(Protocol):
    """Signs a request with a minted credential (SigV4), replacing the client's
    signature. Both methods raise `Refusal` for a request it cannot sign."""

    def needs_body(self, head: RequestHead) -> bool:
        """True if the signature covers the body (then `sign` needs it whole)."""
        ...

    def sign(self, head: RequestHead, target: Target, body: bytes | None) -> None:
        """Sign `head` in place (`body`: the whole body as forwarded, or None)."""
        ...


def no_body(method: str, status: int) -> bool:
    """A response that has no body whatever its headers say."""
    return method == "HEAD" or status in (204, 304) or 100 <= status < 200


class Exchange:
    """See the module docstring."""

    def __init__(self, gate: Gate, client: Client, identity: Identity, head: RequestHead,
                 target: Target, decision: Decision, pinned: Pinned, started: float) -> None:
        self.gate = gate
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
        self._metered: MeteredExchange | None = None
        self._meter_feed: Callable[[bytes], None] | None = None  # the meter's, per chunk
        self._report: str | None = None  # a would-refuse reason under mode: report
        self._signer: Signer | None = None  # signs the head once the body is whole
        self.signed = False  # the head was signed after the gate returned (SigV4)

    # -- metering (model allowlists, budgets, usage) --------------------------------------

    def meter(self, metering: Metering, policy: Policy, preset: str | None) -> None:
        """Meter this credential exchange (set up by the gate)."""
        self._metering = (metering, policy, preset)

    @property
    def hold_limit(self) -> int:
        """How much of the request body an engine holds before forwarding: a model
        allowlist that reads the body needs it whole (up to MODEL_BODY_LIMIT)."""
        rule = self.decision.rule
        if self._metering is not None and rule is not None and \
                model_in_body(rule, self.head.method, self.target.path):
            return MODEL_BODY_LIMIT
        return SIGNED_BODY_LIMIT if self._signer is not None else HOLD_LIMIT

    def _admit(self, body: bytes | None) -> bytes | None:
        """The metering step before forwarding: the model allowlist (403), budgets (429);
        returns the body to forward instead (usage requested on a stream), or None."""
        if self._metering is None or self._metered is not None:
            return None
        metering, policy, preset = self._metering
        rule = self.decision.rule
        assert rule is not None
        step = metering.admit(sandbox=self.identity.sandbox, policy=policy, rule=rule,
                              preset=preset, method=self.head.method, path=self.target.path,
                              body=body, now=time.time())
        if not isinstance(step, MeteredExchange):
            refusal = Refusal(step.code, step.reason, step.rule, retry_after=step.retry_after)
            if self.decision.result != "report":
                raise refusal
            self._report = refusal.reason  # mode: report: forward, record the would-deny
            self._metering = None
            return None
        self._metered = step
        if step.meter is not None:
            self._meter_feed = step.meter.feed
        return step.body

    # -- set up by the gate ----------------------------------------------------------------

    def injected(self, credential: str, secret: str, value: SecretValue) -> None:
        self.credential = credential
        self._secret = (secret, value)
        metrics.child(metrics.CREDENTIALS_INJECTED, credential).inc()
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
        metrics.child(metrics.EXFILTRATION_BLOCKED, kind).inc()
        what = "a gateway token" if kind == "token" else "a real API key"
        return Refusal("exfiltration_blocked", f"the request carries {what} to "
                       f"{self.target.host}, which is not bound to it; keys and tokens go "
                       "only to the hosts of their credential (send the token only in the "
                       "credential's own header, on a rule with credential:)")

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
        returns the body to forward (metering may add `stream_options.include_usage`:
        the engine then frames it by this length)."""
        scanner = self._scanner()
        if self._decoder is None:
            self._check(scanner, body)
        else:
            self._encoded = [body]
            try:
                for piece in self._decoder.feed(body):
                    self._check(scanner, piece)
            except EncodingError as exc:
                raise Refusal("bad_request", f"the request body cannot be checked: "
                              f"{exc}") from None
        self._request_scan = scanner
        end = self.request_end(trailers) if self._decoder is not None or trailers else b""
        whole = end if self._decoder is not None else body
        replaced = self._admit(whole if self._decoder is None else None)
        if replaced is not None:
            whole = replaced
        if self._signer is not None:
            self._signer.sign(self.head, self.target, whole)
            self._signer, self.signed = None, True
        self.bytes_out = len(whole)
        return whole

    # -- response ------------------------------------------------------------------------

    def response(self, head: ResponseHead) -> ResponseHead:
        """Check and adjust the response head: on a credential exchange echoes of the
        key are redacted (headers now, body as it streams), an encoded body is decoded,
        and the length is dropped where redaction may change it."""
        self.response_head = head
        if self._secret is None:
            return head
        name, value = self._secret
        if head.status == 401:
            self.gate.secrets.invalidate(name, rejected=value)
        redactor = self._redactor = Redactor(value.variants())
        head.reason = redactor.redact(head.reason.encode("latin-1", "replace")).decode(
            "latin-1")
        fields = []
        for k, v in head.headers.fields:
            if any(m in v for m in redactor.variants):
                v = redactor.redact(v)
            fields.append((k, v))
        head.headers.fields = fields
        if no_body(self.head.method, head.status) or head.headers.get("content-length") == "0":
            return head
        coding = head.headers.get("content-encoding")
        try:
            self._response_decoder = decoder_for(coding)
        except EncodingError:
            raise Refusal("upstream_failed", _UPSTREAM_KINDS["encoding"].format(
                where=self._where())) from None
        if self._response_decoder is not None:
            head.headers.remove("content-encoding")
        head.headers.remove("content-length")  # redaction may change the length
        return head

    def response_data(self, chunk: bytes) -> bytes:
        """One response body chunk as it should reach the client."""
        self.bytes_in += len(chunk)
        redactor = self._redactor
        if redactor is None:
            return chunk
        if self._response_decoder is not None:
            try:
                chunk = b"".join(self._response_decoder.feed(chunk))
            except EncodingError:
                raise Refusal("upstream_failed", _UPSTREAM_KINDS["encoding"].format(
                    where=self._where())) from None
        if self._meter_feed is not None:
            self._meter_feed(chunk)
        return redactor.feed(chunk)

    def response_end(self) -> bytes:
        """What is still held back at the end of the response body."""
        redactor = self._redactor
        if redactor is None:
            return b""
        out = b""
        if self._response_decoder is not None:
            try:
                tail = b"".join(self._response_decoder.end())
                if self._meter_feed is not None:
                    self._meter_feed(tail)
                out = redactor.feed(tail)
            except EncodingError:
                raise Refusal("upstream_failed", _UPSTREAM_KINDS["encoding"].format(
                    where=self._where())) from None
        return out + redactor.end()

    def response_trailers(self, fields: list[tuple[bytes, bytes]]
                          ) -> list[tuple[bytes, bytes]]:
        """Response trailers as they should reach the client (echoes redacted)."""
        redactor = self._redactor
        if redactor is None:
            return fields
        return [(k, redactor.redact(v)) for k, v in fields]

    def ws_message(self, from_client: bool, data: bytes) -> bytes:
        """A WebSocket message: from the client it must not leak; from the upstream an
        echoed key is redacted, and a metered session's events are metered. Raises
        Refusal."""
        if from_client:
            assert self.scan is not None
            found = self.scan.find(data)
            if found is not None:
                metrics.child(metrics.EXFILTRATION_BLOCKED, "websocket").inc()
                raise self.leak(found)
            if self._metered is not None and self._metering is not None:
                exceeded = self._metering[0].check_open(self._metered, time.time())
                if exceeded is not None:  # the session's responses used up a budget
                    raise Refusal(exceeded.code, exceeded.reason, exceeded.rule,
                                  retry_after=exceeded.retry_after)
            self.bytes_out += len(data)
            return data
        self.bytes_in += len(data)
        if self._meter_feed is not None:  # a Realtime session's server event
            self._meter_feed(data)
        if self._secret is not None:
            redactor = self._redactor or Redactor(self._secret[1].variants())
            return redactor.redact(data)
        metrics.child(metrics.BYTES, "websocket").inc(len(data))
        return data

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
        code = "upstream_timeout" if kind == "timeout" else "upstream_failed"
        if kind == "timeout":
            reason = f"the upstream {self._where()} sent nothing for too long ({detail})"
        refusal = Refusal(code, reason)
        self.finish(refusal.status, error=code)
        from gateway.core.refusal import answer

        return answer(refusal, shape=self.gate.shape(self.target.host), close=True)

    def abort(self, refusal: Refusal) -> Answer:
        """Refuse the exchange part-way (a leak in the body, a bad response)."""
        if not self.done:
            self.done = True
            self.gate.refuse(self.client, refusal, method=self.head.method,
                             scheme=self.target.scheme, host=self.target.host,
                             port=self.target.port, path=self.target.path,
                             started=self.started, usage=self._complete(refusal.status))
        from gateway.core.refusal import answer

        return answer(refusal, shape=self.gate.shape(self.target.host), close=True)

    def finish(self, status: int | None, error: str | None = None,
               usage: dict[str, Any] | None = None) -> None:
        """The exchange ended (response relayed, or failed): one audit line."""
        if self.done:
            return
        self.done = True
        metrics.child(metrics.BYTES, "in").inc(self.bytes_in)
        if self._metered is not None:
            usage = self._complete(status or 0)
        decision = self.decision
        self.gate.audit(
            self.client, identity=self.identity, decision=decision.result,
            reason=self._report or decision.reason,
            rule=decision.rule.source if decision.rule is not None else None,
            method=self.head.method, scheme=self.target.scheme, host=self.target.host,
            port=self.target.port, path=self.target.path, status=status, error=error,
            bytes_in=self.bytes_in, bytes_out=self.bytes_out, started=self.started,
            path_taken="intercept", credential=self.credential, usage=usage)

    def _complete(self, status: int) -> dict[str, Any] | None:
        """The metering step at the end (`finish` or `abort`, whichever comes first and
        only once): the audit line's ``usage``."""
        if self._metered is None or self._metering is None:
            return None
        return self._metering[0].complete(self._metered, status, time.time()).as_record()

    @property
    def elapsed(self) -> float:
        return time.time() - self.started


def _clean_detail(detail: str) -> str:
    """An OS or TLS error phrase (fixed library text), never bytes from the upstream."""
    text = detail.split(":", 1)[0] if "b'" in detail or 'b"' in detail else detail
    return "".join(c for c in text if c.isalnum() or c in " ._-()")[:120] or "error"
