"""Step 1, identify: which sandbox is talking, from its proxy credentials.

The token arrives in `Proxy-Authorization` — Basic with the token as password (what
`HTTPS_PROXY=http://<id>:<token>@gateway:8080` sends) or Bearer — on the CONNECT and
on every plain-HTTP proxy request. Requests inside a tunnel carry no proxy
credentials: the identity established at CONNECT holds for them, and is re-checked
(expiry, revocation) on every request so a revoked token stops at the next request.
"""

from __future__ import annotations

import base64
import binascii

from mitmproxy import connection, http

from gateway import metrics
from gateway.addons.common import IDENTITY, ClientSession, Sessions, fail_closed, refuse
from gateway.addons.transparent import registered_identity
from gateway.audit import Auditor
from gateway.destination import normalize_host
from gateway.errors import Refusal
from gateway.leaks import TOKEN_PREFIX
from gateway.state import StateStore
from gateway.tokens import Identity, TokenRefused, TokenService

MISSING = Refusal(
    "auth_required",
    "no gateway token: set HTTPS_PROXY=http://<sandbox-id>:<token>@<gateway>:<port> "
    "with a token from `sandbox-gateway token mint` or POST /v1/tokens",
)


def proxy_credentials(value: str) -> tuple[str | None, str] | None:
    """Split a Proxy-Authorization value into (username, token); None if unusable."""
    scheme, _, param = value.strip().partition(" ")
    scheme = scheme.lower()
    param = param.strip()
    if scheme == "bearer" and param:
        return None, param
    if scheme == "basic" and param:
        try:
            decoded = base64.b64decode(param, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        user, sep, password = decoded.partition(":")
        if not sep or not password:
            return None
        return (user or None), password
    return None


UNREGISTERED = Refusal(
    "unknown_sandbox",
    "this source address is not a registered sandbox and the request carries no gateway "
    "token; register it (POST /v1/sandboxes) or send the token as the API key",
)


def gateway_token_in(request: http.Request) -> str | None:
    """A gateway token carried anywhere a provider key goes (headers, Basic, query)."""
    candidates = list(request.headers.values()) + list(request.query.values())
    for value in candidates:
        if TOKEN_PREFIX not in value:
            decoded = proxy_credentials(value)
            if decoded is None or TOKEN_PREFIX not in decoded[1]:
                continue
            value = decoded[1]
        for part in value.replace(",", " ").split():
            if part.startswith(TOKEN_PREFIX):
                return str(part)
    return None


class Identify:
    """Verifies proxy credentials and attaches the Identity to the connection and flow."""

    def __init__(self, tokens: TokenService, sessions: Sessions, auditor: Auditor,
                 state: StateStore) -> None:
        self.tokens = tokens
        self.state = state
        self.sessions = sessions
        self.auditor = auditor

    def _authenticate(self, flow: http.HTTPFlow) -> tuple[Identity, str] | None:
        header = flow.request.headers.get("Proxy-Authorization")
        flow.request.headers.pop("Proxy-Authorization", None)
        if header is None:
            self._refuse(flow, MISSING, "missing")
            return None
        creds = proxy_credentials(header)
        if creds is None:
            self._refuse(flow, Refusal(
                "token_malformed", "Proxy-Authorization must be Basic <id>:<token> or "
                "Bearer <token>; use HTTPS_PROXY=http://<sandbox-id>:<token>@<gateway>:<port>",
            ), "token_malformed")
            return None
        user, token = creds
        try:
            identity = self.tokens.verify(token)
        except TokenRefused as refused:
            self._refuse(flow, Refusal(refused.code, refused.reason), refused.code)
            return None
        if user is not None and user != identity.sandbox:
            self._refuse(flow, Refusal(
                "sandbox_mismatch", f"the proxy username {user[:64]!r} is not the token's "
                f"sandbox {identity.sandbox!r}; use the sandbox id as the proxy username",
            ), "sandbox_mismatch")
            return None
        return identity, token

    def _refuse(self, flow: http.HTTPFlow, refusal: Refusal, reason: str) -> None:
        metrics.TOKENS_REFUSED.labels(reason=reason).inc()
        refuse(flow, refusal)
        self.auditor.refused(flow, refusal, identity=None)

    def _tunnel_identity(self, flow: http.HTTPFlow, session: ClientSession) -> Identity | None:
        """Inside a tunnel: the identity it was opened with, if still live. A transparent
        connection from an unregistered source identifies by a token in the request."""
        if session.token is not None:
            token = session.token
        elif session.identity is not None:  # registered by source address
            assert flow.client_conn.peername is not None
            current = registered_identity(self.state, normalize_host(
                str(flow.client_conn.peername[0])))
            if current is None or current.policy != session.identity.policy:
                self._refuse(flow, UNREGISTERED, "unknown_sandbox")
                return None
            return current
        else:
            found = gateway_token_in(flow.request)
            if found is None:
                self._refuse(flow, UNREGISTERED, "unknown_sandbox")
                return None
            token = found
        try:
            return self.tokens.verify(token)
        except TokenRefused as refused:
            self._refuse(flow, Refusal(refused.code, refused.reason), refused.code)
            return None

    def client_connected(self, client: connection.Client) -> None:
        metrics.OPEN_CONNECTIONS.inc()

    def client_disconnected(self, client: connection.Client) -> None:
        metrics.OPEN_CONNECTIONS.dec()

    @fail_closed
    def http_connect(self, flow: http.HTTPFlow) -> None:
        authenticated = self._authenticate(flow)
        if authenticated is not None:
            session = self.sessions.get(flow.client_conn)
            session.identity, session.token = authenticated
            flow.metadata[IDENTITY] = session.identity

    @fail_closed
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        session = self.sessions.peek(flow.client_conn)
        if session is not None and session.tunnel is not None:
            identity = self._tunnel_identity(flow, session)
            if identity is not None:
                flow.metadata[IDENTITY] = identity
            return
        authenticated = self._authenticate(flow)
        if authenticated is not None:
            flow.metadata[IDENTITY] = authenticated[0]
