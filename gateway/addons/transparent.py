"""Transparent mode: traffic redirected to the gateway (iptables REDIRECT), no proxy settings.

The destination is the connection's original address (SO_ORIGINAL_DST) plus the name
the client gives in its first bytes: the TLS SNI, or the HTTP Host header. The name
must resolve to the original address, so a sandbox cannot pair an allowed name with a
forbidden IP; then the original address itself is checked like any destination.

Identity: a sandbox registered by source address (`POST /v1/sandboxes`) is known at
once, so its host-only rules can be passed through. Any other source must carry a
gateway token where its provider expects an API key; that needs interception, and
the request is refused when no token is found.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer
from mitmproxy.proxy.layers import TCPLayer, modes
from mitmproxy.proxy.layers.tls import parse_client_hello

from gateway import metrics
from gateway.addons.common import Sessions, Tunnel, fail_closed, log
from gateway.addons.layers import RefuseLayer
from gateway.audit import Auditor
from gateway.destination import DestinationError, is_ip, normalize_host
from gateway.policy import Policy, Request, decide
from gateway.resolver import DestinationGuard, DestinationRefused, Pinned
from gateway.state import StateStore
from gateway.tokens import Identity

MAX_HEAD = 64 * 1024


def registered_identity(state: StateStore, ip: str) -> Identity | None:
    """The identity of a sandbox registered by source address, if any."""
    entry = state.sandbox_for(ip)
    if entry is None:
        return None
    return Identity(sandbox=entry.sandbox, policy=entry.policy, jti=f"ip:{ip}", scope={},
                    issued_at=0.0, expires_at=math.inf, lifetime_end=math.inf)


def _first_name(data: bytes) -> tuple[str, str | None] | None:
    """(scheme, name) from a connection's first bytes; None = need more bytes."""
    if starts_like_tls_record(data):
        try:
            hello = parse_client_hello(data)
        except ValueError:
            return "tls", None
        if hello is None:
            return None
        return "https", hello.sni
    if len(data) < 3:
        return None
    if data[:3].isalpha():
        head, sep, _ = data.partition(b"\r\n\r\n")
        if not sep:
            return None if len(data) < MAX_HEAD else ("http", None)
        for line in head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"host":
                return "http", value.strip().decode("latin-1")
        return "http", None
    return "tcp", None


class Transparent:
    """Decides redirected connections at their first bytes (before mitmproxy's layers)."""

    def __init__(self, policy_lookup: object, guard: DestinationGuard, state: StateStore,
                 sessions: Sessions, auditor: Auditor) -> None:
        self.policy_lookup = policy_lookup
        self.guard = guard
        self.state = state
        self.sessions = sessions
        self.auditor = auditor

    @fail_closed
    async def next_layer(self, nextlayer: layer.NextLayer) -> None:
        context = nextlayer.context
        layers = context.layers
        if nextlayer.layer is not None or not (
                len(layers) == 1 and isinstance(layers[0], modes.TransparentProxy)):
            return
        first = _first_name(nextlayer.data_client())
        if first is None:
            return  # wait for the whole ClientHello / request head
        scheme, name = first
        assert context.server.address is not None and context.client.peername is not None
        orig_ip = normalize_host(str(context.server.address[0]))
        port = int(context.server.address[1])
        source = str(context.client.peername[0])
        identity = registered_identity(self.state, normalize_host(source))
        refuse = self._refuser(nextlayer, source, orig_ip, port)
        if scheme == "tls":
            return refuse("the TLS ClientHello could not be parsed")
        if scheme == "tcp":
            if identity is None:
                return refuse("raw TCP from an unregistered source: register the sandbox "
                              "with POST /v1/sandboxes")
            name = orig_ip
        if not name:
            return refuse(f"no server name ({'SNI' if scheme == 'https' else 'Host'}) "
                          "to decide on; clients must send one")
        try:
            host = normalize_host(name.rsplit(":", 1)[0] if scheme == "http" and
                                  not name.endswith("]") else name.strip("[]"))
        except DestinationError as exc:
            return refuse(f"bad server name: {exc}")
        problem = await self._bind(host, orig_ip, port)
        if problem is not None:
            return refuse(problem)
        session = self.sessions.get(context.client)
        decision = None
        passthrough = False
        if identity is not None:
            policy = self._policy(identity.policy)
            if policy is None:
                return refuse(f"policy {identity.policy!r} of the registered sandbox is gone")
            decision = decide(policy, Request(None, scheme if scheme != "tcp" else "tcp",
                                              host, port, None))
            if not decision.allowed:
                return refuse(decision.reason)
            session.identity = identity
            passthrough = decision.result == "allow" and not decision.inspect
            if scheme == "tcp" or (decision.rule is not None and decision.rule.protocol == "tcp"):
                passthrough = True
        session.tunnel = Tunnel(host, port, decision, passthrough)
        session.pinned[(orig_ip, port)] = Pinned(orig_ip, port, orig_ip)
        if passthrough:
            nextlayer.layer = TCPLayer(context, ignore=True)

    def _policy(self, name: str) -> Policy | None:
        lookup = self.policy_lookup
        assert callable(lookup)
        policy: Policy | None = lookup(name)
        return policy

    async def _bind(self, host: str, orig_ip: str, port: int) -> str | None:
        """Why `host` may not be paired with `orig_ip`, or None if it may."""
        if is_ip(host):
            if host != orig_ip:
                return f"the server name {host} is not the connection's address {orig_ip}"
        else:
            try:
                pinned = await self.guard.check(host, port)
            except DestinationRefused as refused:
                if refused.code != "forbidden_destination":
                    return refused.reason
                pinned = None
            answers = {pinned.ip} if pinned is not None and pinned.trusted else None
            if answers is None:
                try:
                    answers = {normalize_host(ip) for ip in
                               await self.guard.resolver.resolve(host, port)}
                except (OSError, DestinationError):
                    answers = set()
            if orig_ip not in answers:
                return (f"{host} does not resolve to the connection's address {orig_ip}; "
                        "a sandbox may not pair an allowed name with another address")
            if pinned is not None and pinned.trusted:
                return None
        verdict = self.guard.policy.classify(orig_ip, port)
        if not verdict.allowed:
            metrics.DESTINATIONS_REFUSED.labels(code="forbidden_destination").inc()
            return verdict.reason
        return None

    def _refuser(self, nextlayer: layer.NextLayer, source: str, orig_ip: str, port: int
                 ) -> Callable[[str], None]:
        def refuse(reason: str) -> None:
            log.info("transparent connection from %s to %s:%d refused: %s",
                     source, orig_ip, port, reason)
            self.auditor.tunnel({
                "sandbox": None, "policy": None, "jti": None, "client": source,
                "method": None, "scheme": None, "host": orig_ip, "port": port, "path": None,
                "decision": "deny", "error": "policy_denied", "reason": reason, "rule": None,
                "status": None, "bytes_in": 0, "bytes_out": 0, "duration_ms": 0,
                "path_taken": "transparent",
            })
            nextlayer.layer = RefuseLayer(nextlayer.context, reason)
        return refuse
