"""Step 5, inject: the sandbox's token out, the real key in — only where it is bound.

On a request whose rule names a credential, the carrier (the header or query
parameter the provider expects) must hold a gateway token of this same sandbox whose
scope allows the credential and path; it is removed and the real key, fetched from
the secret store through the cache, is put in its place. The key only goes to a
destination its credential is bound to (the tunnel's CONNECT authority, already
checked to equal the Host header and SNI).

Every intercepted request is also checked for leaks: a gateway token, or a real key
(raw, base64 or URL-encoded) in headers, query or body, going to a host it is not
bound to, is refused. Responses that echo the injected key have it replaced by
[REDACTED], chunk by chunk, without buffering the stream.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy import http

from gateway import metrics
from gateway.addons.common import (
    CARRIER,
    DECISION,
    HOST,
    IDENTITY,
    REFUSAL,
    SECRET,
    fail_closed,
    refuse,
)
from gateway.audit import Auditor
from gateway.credentials import clear_carriers, find_carried, place
from gateway.errors import Refusal
from gateway.leaks import TOKEN_MARKERS, Redactor, contains_any, request_blob
from gateway.policy import Credential, Decision, PolicySet
from gateway.secrets import SecretCache, SecretUnavailable, SecretValue
from gateway.tokens import Identity, TokenRefused, TokenService

_SCAN_LIMIT = 8 * 1024 * 1024  # buffered bodies up to this size are scanned whole
POISONED = "sandbox_gateway.poisoned"  # a WebSocket that tried to leak: drop its frames


class Inject:
    """Swaps tokens for keys on credential rules; refuses leaks; redacts echoes."""

    def __init__(self, tokens: TokenService, cache: SecretCache,
                 policies: Callable[[], PolicySet], auditor: Auditor) -> None:
        self.tokens = tokens
        self.cache = cache
        self.policies = policies
        self.auditor = auditor
        self._markers: dict[str, tuple[bytes, ...]] = {}
        self._markers_version: tuple[object, ...] = ()

    def _refuse(self, flow: http.HTTPFlow, refusal: Refusal) -> None:
        refuse(flow, refusal)
        self.auditor.refused(flow, refusal, flow.metadata.get(IDENTITY),
                             flow.request.host, flow.request.port)

    def _unbound_secret_markers(self, host: str) -> tuple[bytes, ...]:
        """Variants of every known key that no credential binds to `host`; computed once
        per host until the policy set or the set of fetched keys changes."""
        policy_set = self.policies()
        known = self.cache.known_items()
        version = (id(policy_set), tuple(id(value) for _, value in known))
        if version != self._markers_version or len(self._markers) > 10_000:
            self._markers.clear()
            self._markers_version = version
        markers = self._markers.get(host)
        if markers is None:
            credentials = policy_set.credentials.values()
            markers = self._markers[host] = tuple(
                variant for name, value in known
                if not any(c.secret == name and c.binds(host) for c in credentials)
                for variant in value.variants())
        return markers

    def _leak(self, data: bytes, host: str) -> str | None:
        if contains_any(data, TOKEN_MARKERS):
            return "token"
        if contains_any(data, self._unbound_secret_markers(host)):
            return "secret"
        return None

    def _refuse_leak(self, flow: http.HTTPFlow, kind: str, host: str) -> None:
        metrics.EXFILTRATION_BLOCKED.labels(kind=kind).inc()
        what = "a gateway token" if kind == "token" else "a real API key"
        self._refuse(flow, Refusal(
            "exfiltration_blocked",
            f"the request carries {what} to {host}, which is not bound to it; keys and tokens "
            "go only to the hosts of their credential (send the token only in the "
            "credential's own header, on a rule with credential:)"))

    @fail_closed
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        decision: Decision = flow.metadata[DECISION]
        identity: Identity = flow.metadata[IDENTITY]
        host = _destination(flow)
        req = flow.request
        credential = None
        carried_token = None
        if decision.credential is not None:
            credential = self.policies().credentials.get(decision.credential)
            if credential is None or not credential.binds(host):
                self._refuse(flow, Refusal(
                    "policy_denied", f"credential {decision.credential!r} is not bound to "
                    f"{host}; fix the credential's hosts", decision.rule.source
                    if decision.rule else None))
                return
            carried = find_carried(req, credential.injection)
            if carried is None:
                self._refuse(flow, Refusal(
                    "credential_not_in_scope",
                    f"rule {decision.rule.source if decision.rule else '?'} injects credential "
                    f"{credential.name!r}, but the request carries no gateway token where the "
                    f"provider expects its key; set the API key variable to the sandbox token"))
                return
            carried_token = carried.value
            clear_carriers(req, credential.injection)
            refusal = self._check_token(carried_token, identity, credential, req.path)
            if refusal is not None:
                self._refuse(flow, refusal)
                return
            flow.metadata[CARRIER] = carried.carrier
        leak = self._leak(request_blob(req.method, req.path, req.headers.fields), host)
        if leak is not None:
            self._refuse_leak(flow, leak, host)
            return
        if req.stream or "content-length" not in req.headers:
            # A large body, or one of unknown size (chunked, HTTP/2 without a length, which
            # mitmproxy would start streaming past 1 MiB, after this hook): scan it chunk
            # by chunk as it streams through, cut it off on a leak.
            req.stream = _BodyScanner(self, flow, host)
        if credential is not None:
            try:
                secret = await self.cache.get(credential.secret)
            except SecretUnavailable as exc:
                self._refuse(flow, Refusal(
                    "secret_unavailable",
                    f"credential {credential.name!r} could not be fetched: {exc.reason}"))
                return
            place(req, flow.metadata[CARRIER], secret)
            flow.metadata[SECRET] = (credential.secret, secret)
            metrics.child(metrics.CREDENTIALS_INJECTED, credential.name).inc()

    def _check_token(self, token: str, identity: Identity, credential: Credential,
                     path: str) -> Refusal | None:
        try:
            carried = self.tokens.verify(token)
        except TokenRefused as refused:
            return Refusal(refused.code, f"the token in the {credential.name} credential "
                           f"carrier: {refused.reason}")
        if carried.sandbox != identity.sandbox:
            return Refusal("credential_not_in_scope", "the token in the credential carrier "
                           "belongs to another sandbox; use this sandbox's own token")
        if not carried.allows_credential(credential.name, path):
            return Refusal("credential_not_in_scope",
                           f"the token's scope does not allow credential {credential.name!r} "
                           f"for this path; mint it with --scope {credential.name}")
        return None

    @fail_closed
    def request(self, flow: http.HTTPFlow) -> None:
        """Buffered bodies: scan them whole before anything is sent upstream."""
        if flow.response is not None or REFUSAL in flow.metadata:
            return
        body = flow.request.raw_content
        if body and len(body) <= _SCAN_LIMIT:
            host = _destination(flow)
            leak = self._leak(body, host)
            if leak is not None:
                self._refuse_leak(flow, leak, host)

    @fail_closed
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        injected: tuple[str, SecretValue] | None = flow.metadata.get(SECRET)
        if injected is None or flow.response is None:
            return
        name, secret = injected
        if flow.response.status_code == 401:
            self.cache.invalidate(name, rejected=secret)
        redactor = Redactor(secret.variants())
        headers = flow.response.headers
        for key, value in list(headers.items(multi=True)):
            if contains_any(value.encode("utf-8", "surrogateescape"), redactor.variants):
                headers[key] = redactor.redact(value.encode()).decode("utf-8", "replace")
        # Redaction can change the body's length: send it chunked, without Content-Length.
        if "content-length" in headers:
            del headers["content-length"]
            if not (flow.response.is_http2 or flow.response.is_http3):
                headers["transfer-encoding"] = "chunked"
        flow.response.stream = redactor


    @fail_closed
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """Frames are checked like bodies: no leaks out, no key echoed back."""
        assert flow.websocket is not None
        message = flow.websocket.messages[-1]
        if message.from_client:
            if flow.metadata.get(POISONED):
                message.drop()  # mitmproxy cannot close a killed WebSocket: drop the rest
            elif self._leak(message.content, _destination(flow)) is not None:
                metrics.EXFILTRATION_BLOCKED.labels(kind="websocket").inc()
                message.drop()
                flow.metadata[POISONED] = True
                if flow.killable:
                    flow.kill()
            return
        injected: tuple[str, SecretValue] | None = flow.metadata.get(SECRET)
        if injected is not None:
            redactor = Redactor(injected[1].variants())
            if contains_any(message.content, redactor.variants):
                message.content = redactor.redact(message.content)


class _BodyScanner:
    """Streams a request body through, refusing it (cut off) if a chunk leaks."""

    def __init__(self, inject: Inject, flow: http.HTTPFlow, host: str) -> None:
        self.inject = inject
        self.flow = flow
        self.host = host
        self.tail = b""
        # Keep enough of each chunk that a marker split across two chunks is still seen.
        markers = (*TOKEN_MARKERS, *inject._unbound_secret_markers(host))
        self.keep = max(len(m) for m in markers) - 1

    def __call__(self, chunk: bytes) -> bytes:
        window = self.tail + chunk
        if self.inject._leak(window, self.host) is not None:
            metrics.EXFILTRATION_BLOCKED.labels(kind="body").inc()
            self.flow.kill()
            return b""
        self.tail = window[-self.keep:] if self.keep > 0 else b""
        return chunk


def _destination(flow: http.HTTPFlow) -> str:
    """The host the policy decided on (the CONNECT authority inside a tunnel)."""
    host: str = flow.metadata[HOST]
    return host
