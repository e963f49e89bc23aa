"""Who a connection is: a gateway token in the proxy credentials (or, in transparent
mode, in a key carrier of the request), a registered source address, or (with
identity.kubernetes) the running pod that holds the source address; checked again for
every request (expiry, revocation, registration, the pod still there as it was) and
counted against its sandbox's connection limit."""

from __future__ import annotations

import math
from collections.abc import Callable
from urllib.parse import unquote

from gateway.core import credentials
from gateway.core.claims import proxy_credentials, subject_refusal
from gateway.core.client import Client, source_of
from gateway.core.identity import Identity, SandboxAddress, TokenRefused
from gateway.core.messages import RequestHead
from gateway.core.policy import PolicySet
from gateway.core.ports import Registry, Tokens, Workloads
from gateway.core.refusal import Refusal
from gateway.pipeline.connections import Connections

__all__ = ["UNREGISTERED", "Identifier", "proxy_credentials", "subject_refusal"]

UNREGISTERED = Refusal(
    "unknown_sandbox",
    "this source address is not a registered sandbox and the request carries no gateway "
    "token; register it (POST /v1/sandboxes) or send the token as the API key",
)


class Identifier:
    """Establishes and re-checks client identities (every method raises Refusal)."""

    def __init__(self, tokens: Tokens, registry: Registry, connections: Connections,
                 workloads: Workloads | None = None,
                 policies: Callable[[], PolicySet] | None = None) -> None:
        self.tokens = tokens
        self.registry = registry
        self.connections = connections
        self.workloads = workloads  # identity.kubernetes: pods by address (None: off)
        self.policies = policies

    def identify(self, client: Client, proxy_authorization: str | None) -> None:
        """Establish the client's identity from its proxy credentials (none: with
        identity.kubernetes, the pod that holds its source address). Called for a
        CONNECT and for every plain proxy request: each plain request carries its own
        credentials (none: refused, never inherited from the connection's earlier
        requests), and they must name the sandbox the connection's first request named
        (a refreshed token of the same sandbox is taken; another sandbox's is refused), so
        a connection's identity never changes under it (docs/clients.md)."""
        if proxy_authorization is None:
            if self.workloads is not None:
                self._identify_pod(client)
                return
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
        if user is not None and user != identity.sandbox and unquote(user) != identity.sandbox:
            raise Refusal("sandbox_mismatch", f"the proxy username {user[:64]!r} is not the "
                          f"token's sandbox {identity.sandbox!r}; use the sandbox id as the "
                          "proxy username")
        was = client.identity
        if was is not None and not client.registered and was.sandbox != identity.sandbox:
            raise Refusal("sandbox_mismatch", f"this connection is sandbox {was.sandbox!r}'s "
                          f"(its first request's credentials), and this request's token is "
                          f"sandbox {identity.sandbox!r}'s; a connection keeps one sandbox: "
                          "send the other sandbox's requests on a connection of their own")
        client.identity, client.token = identity, token
        self.connections.count(client)

    def identify_registered(self, client: Client) -> bool:
        """Transparent mode: identify a client by its registered source address, or the
        watched pod that holds it (False: neither; its requests may still carry a
        token). A pod watch too stale to trust refuses (fail closed)."""
        entry = self.registry.sandbox_for(source_of(client))
        if entry is None:
            if self.workloads is None:
                return False
            try:
                self._identify_pod(client)
            except Refusal as refused:
                if refused.code == "identity_unknown":
                    return False
                raise
            return True
        client.identity, client.registered = _registered_identity(entry), True
        self.connections.count(client)
        return True

    def sandbox_for(self, ip: str) -> SandboxAddress | None:
        """Who a source address is with no token to say so (the DNS resolver's
        `Registry`): its registration, else the watched pod that holds it and may claim
        its policy. None when neither, or when the pod watch cannot say (fail closed)."""
        entry = self.registry.sandbox_for(ip)
        if entry is not None or self.workloads is None:
            return entry
        try:
            identity = self.workloads.identity_for(ip)
            self._check_subject(identity)
        except Refusal:
            return None
        return SandboxAddress(sandbox=identity.sandbox, ip=ip, policy=identity.policy)

    def _identify_pod(self, client: Client) -> None:
        assert self.workloads is not None
        identity = self.workloads.identity_for(source_of(client))
        self._check_subject(identity)
        client.identity, client.registered = identity, True
        self.connections.count(client)

    def _check_subject(self, identity: Identity) -> None:
        policy_set = self.policies() if self.policies is not None else None
        policy = policy_set.get(identity.policy) if policy_set is not None else None
        refusal = subject_refusal(identity, policy.admits if policy is not None else None)
        if refusal is not None:
            raise refusal

    def verify(self, client: Client, token: str) -> Identity:
        """The token's identity, if it verifies and may be used from the client's address
        (and, for a token bound to a pod, while that pod is running as it was)."""
        try:
            identity = self.tokens.verify(token)
        except TokenRefused as refused:  # (identity: only from a verified signature)
            raise Refusal(refused.code, refused.reason, identity=refused.identity) from None
        if not identity.used_from(source_of(client)):
            raise Refusal("token_wrong_source", f"this token is bound to "
                          f"{', '.join(identity.cidr)} and cannot be used from "
                          f"{source_of(client)}; mint a token for this sandbox's address")
        if identity.workload is not None:
            why = (self.workloads.gone(identity.workload) if self.workloads is not None else
                   "this gateway does not watch pods (identity.kubernetes is off)")
            if why is not None:
                raise Refusal("identity_unknown", f"the token is bound to pod "
                              f"{identity.workload.namespace}/{identity.workload.pod}, and "
                              f"{why}; exchange the new pod's token", identity=identity)
            self._check_subject(identity)
        return identity

    def recheck(self, client: Client, head: RequestHead | None = None) -> Identity:
        """The client's identity, checked again (expiry, revocation, registration) for
        the next request. A transparent client that is not registered identifies by a
        gateway token where its provider expects a key (`head`)."""
        if client.identity is not None and client.identity.keyless:
            return self._recheck_pod(client, client.identity)
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

    def _recheck_pod(self, client: Client, was: Identity) -> Identity:
        """The pod that held the address when the connection began still holds it, as
        the same pod (uid) with the same policy; else the connection's identity is gone."""
        assert self.workloads is not None and was.workload is not None
        try:
            now = self.workloads.identity_for(source_of(client))
        except Refusal as refused:
            if refused.code != "identity_unknown":
                raise
            raise Refusal("identity_unknown", f"pod {was.sandbox} is no longer this "
                          f"connection's identity: {refused.reason}", identity=was) from None
        assert now.workload is not None
        if now.workload.uid != was.workload.uid or now.policy != was.policy:
            raise Refusal("identity_unknown", f"the address {source_of(client)} belongs to "
                          f"another pod or policy now ({now.sandbox}, policy "
                          f"{now.policy!r}) than when this connection began ({was.sandbox}, "
                          f"policy {was.policy!r}); reconnect", identity=was)
        self._check_subject(was)
        return was


def _registered_identity(entry: SandboxAddress) -> Identity:
    return Identity(sandbox=entry.sandbox, policy=entry.policy, jti=f"ip:{entry.ip}",
                    scope={}, issued_at=0.0, expires_at=math.inf, lifetime_end=math.inf)
