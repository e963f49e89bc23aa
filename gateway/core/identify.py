"""Who a connection is: a gateway token in the proxy credentials (or, in transparent
mode, in a key carrier of the request), or a registered source address; checked again
for every request (expiry, revocation, registration) and counted against its sandbox's
connection limit."""

from __future__ import annotations

import base64
import math

from gateway.core import credentials
from gateway.core.client import Client, source_of
from gateway.core.connections import Connections
from gateway.core.identity import Identity, TokenRefused
from gateway.core.messages import RequestHead
from gateway.core.ports import Registry, Tokens
from gateway.core.refusal import Refusal
from gateway.services.state.base import SandboxAddress

__all__ = ["UNREGISTERED", "Identifier", "proxy_credentials"]

UNREGISTERED = Refusal(
    "unknown_sandbox",
    "this source address is not a registered sandbox and the request carries no gateway "
    "token; register it (POST /v1/sandboxes) or send the token as the API key",
)


class Identifier:
    """Establishes and re-checks client identities (every method raises Refusal)."""

    def __init__(self, tokens: Tokens, registry: Registry, connections: Connections) -> None:
        self.tokens = tokens
        self.registry = registry
        self.connections = connections

    def identify(self, client: Client, proxy_authorization: str | None) -> None:
        """Establish the client's identity from its proxy credentials."""
        if proxy_authorization is None:
            raise Refusal("auth_required", "no gateway token: set HTTPS_PROXY=http://"
                          "<sandbox-id>:<token>@<gateway>:<port> with a token from "
                          "`sandbox-gateway token mint` or POST /v1/tokens")
        creds = proxy_credentials(proxy_authorization)
        if creds is None:
            raise Refusal("token_malformed", "Proxy-Authorization must be Basic <id>:<token> "
                          "or Bearer <token>; use HTTPS_PROXY=http://<sandbox-id>:<token>@"
                          "<gateway>:<port>")
        user, token = creds
        identity = self.verify(client, token)
        if user is not None and user != identity.sandbox:
            raise Refusal("sandbox_mismatch", f"the proxy username {user[:64]!r} is not the "
                          f"token's sandbox {identity.sandbox!r}; use the sandbox id as the "
                          "proxy username")
        client.identity, client.token = identity, token
        self.connections.count(client)

    def identify_registered(self, client: Client) -> bool:
        """Transparent mode: identify a client by its registered source address (False:
        not registered)."""
        entry = self.registry.sandbox_for(source_of(client))
        if entry is None:
            return False
        client.identity, client.registered = _registered_identity(entry), True
        self.connections.count(client)
        return True

    def verify(self, client: Client, token: str) -> Identity:
        """The token's identity, if it verifies and may be used from the client's address."""
        try:
            identity = self.tokens.verify(token)
        except TokenRefused as refused:  # (identity: only from a verified signature)
            raise Refusal(refused.code, refused.reason, identity=refused.identity) from None
        if not identity.used_from(source_of(client)):
            raise Refusal("token_wrong_source", f"this token is bound to "
                          f"{', '.join(identity.cidr)} and cannot be used from "
                          f"{source_of(client)}; mint a token for this sandbox's address")
        return identity

    def recheck(self, client: Client, head: RequestHead | None = None) -> Identity:
        """The client's identity, checked again (expiry, revocation, registration) for
        the next request. A transparent client that is not registered identifies by a
        gateway token where its provider expects a key (`head`)."""
        if client.registered:
            entry = self.registry.sandbox_for(source_of(client))
            assert client.identity is not None
            if entry is None or entry.policy != client.identity.policy:
                raise UNREGISTERED
            return client.identity
        token = client.token
        if token is None and head is not None and client.listener == "transparent":
            token = credentials.find_token(head.headers, head.target)
            if token is None:
                raise UNREGISTERED
        if token is None:
            raise Refusal("auth_required", "no gateway token on this connection")
        client.identity = self.verify(client, token)
        if client.token is None:
            client.token = token
        self.connections.count(client)
        return client.identity


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
        except ValueError:  # binascii.Error, UnicodeDecodeError, non-ASCII input
            return None
        user, sep, password = decoded.partition(":")
        if not sep or not password:
            return None
        return (user or None), password
    return None


def _registered_identity(entry: SandboxAddress) -> Identity:
    return Identity(sandbox=entry.sandbox, policy=entry.policy, jti=f"ip:{entry.ip}",
                    scope={}, issued_at=0.0, expires_at=math.inf, lifetime_end=math.inf)
