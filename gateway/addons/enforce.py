"""Step 3, decide: the policy says allow, deny or report, before anything is dialled.

At CONNECT the tunnel's `host:port` is decided (and whether it needs interception).
Inside an intercepted tunnel every request must name the tunnel's own destination
(Host / `:authority`, port included), then its method and path are decided. Plain
HTTP proxy requests get the same checks against their absolute URL.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mitmproxy import http

from gateway import metrics
from gateway.addons.common import (
    CREDENTIAL,
    DECISION,
    HOST,
    IDENTITY,
    PATH,
    Sessions,
    Tunnel,
    fail_closed,
    refuse,
)
from gateway.audit import Auditor
from gateway.destination import DestinationError, normalize_host, parse_authority
from gateway.errors import Refusal
from gateway.policy import Decision, Policy, Request, decide
from gateway.tokens import Identity

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _timed_decide(policy: Policy, request: Request) -> Decision:
    start = time.perf_counter()
    decision = decide(policy, request)
    metrics.DECISION_SECONDS.observe(time.perf_counter() - start)
    return decision


class Enforce:
    """Applies the sandbox's policy to tunnels and requests."""

    def __init__(self, policy_lookup: Callable[[str], Policy | None], sessions: Sessions,
                 auditor: Auditor) -> None:
        self.policy_lookup = policy_lookup
        self.sessions = sessions
        self.auditor = auditor

    def _refuse(self, flow: http.HTTPFlow, refusal: Refusal, identity: Identity | None,
                host: str | None = None, port: int | None = None) -> None:
        refuse(flow, refusal)
        self.auditor.refused(flow, refusal, identity, host, port)

    def _policy(self, flow: http.HTTPFlow, identity: Identity) -> Policy | None:
        policy = self.policy_lookup(identity.policy)
        if policy is None:
            self._refuse(flow, Refusal(
                "policy_denied", f"policy {identity.policy!r} is not loaded any more; "
                "mint a token for an existing policy (GET /v1/policies)"), identity)
        return policy

    @fail_closed
    def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        identity: Identity = flow.metadata[IDENTITY]
        try:
            host = normalize_host(flow.request.host)
        except DestinationError as exc:
            self._refuse(flow, Refusal("bad_destination", f"CONNECT target: {exc}"), identity)
            return
        port = flow.request.port
        policy = self._policy(flow, identity)
        if policy is None:
            return
        decision = _timed_decide(policy, Request(None, "https", host, port, None))
        flow.metadata[DECISION] = decision
        if not decision.allowed:
            self._refuse(flow, Refusal("policy_denied", decision.reason, _rule(decision)),
                         identity, host, port)
            return
        # A would-deny tunnel (report mode) is inspected, so its requests are recorded.
        passthrough = decision.result == "allow" and not decision.inspect
        self.sessions.get(flow.client_conn).tunnel = Tunnel(host, port, decision, passthrough)
        flow.metadata[PATH] = "passthrough" if passthrough else "intercept"

    @fail_closed
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        identity: Identity = flow.metadata[IDENTITY]
        req = flow.request
        session = self.sessions.peek(flow.client_conn)
        tunnel = session.tunnel if session is not None else None
        scheme = req.scheme
        if tunnel is not None:
            host, port = tunnel.host, tunnel.port
        else:
            try:
                host = normalize_host(req.host)
            except DestinationError as exc:
                self._refuse(flow, Refusal("bad_destination", f"request host: {exc}"), identity)
                return
            port = req.port
        mismatch = self._authority_mismatch(req, host, port, scheme)
        sni = flow.client_conn.sni
        if mismatch is None and tunnel is not None and sni and normalize_host(sni) != host:
            mismatch = (f"the TLS server name {sni[:100]!r} is not the tunnel's destination "
                        f"{host}; connect to each host through its own CONNECT")
        if mismatch is not None:
            self._refuse(flow, Refusal("host_mismatch", mismatch), identity, host, port)
            return
        policy = self._policy(flow, identity)
        if policy is None:
            return
        decision = _timed_decide(policy, Request(req.method, scheme, host, port, req.path))
        flow.metadata[DECISION] = decision
        if not decision.allowed:
            self._refuse(flow, Refusal("policy_denied", decision.reason, _rule(decision)),
                         identity, host, port)
            return
        flow.metadata[PATH] = "intercept"
        flow.metadata[HOST] = host
        flow.metadata[CREDENTIAL] = decision.credential

    @staticmethod
    def _authority_mismatch(req: http.Request, host: str, port: int, scheme: str) -> str | None:
        """Every name the request gives for its destination must be the tunnel's (or URL's)."""
        names = []
        if req.host_header:
            names.append(req.host_header)
        if (req.is_http2 or req.is_http3) and "Host" in req.headers:
            names.append(req.headers["Host"])
        default_port = DEFAULT_PORTS.get(scheme, port)
        for name in names:
            try:
                got_host, got_port = parse_authority(name, default_port=default_port)
                got_host = normalize_host(got_host)
            except DestinationError:
                return f"the Host header {name[:100]!r} is not a valid host"
            if got_host != host or got_port != port:
                return (f"the request names {name[:100]!r} but its connection goes to "
                        f"{host}:{port}; open a separate connection (CONNECT) for each host")
        return None


def _rule(decision: Decision) -> str | None:
    return decision.rule.source if decision.rule is not None else None
