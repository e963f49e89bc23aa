"""The gate: the one place every engine asks "may this pass?", in data-flow order.

    identify → target → admit (policy, destination, pin) → credential → leaks → audit

Engines (the front door and its splice, the HTTP/1 engine, the mitmproxy adapter,
transparent mode) translate their native objects into `Client`, authorities and
`RequestHead`s, call the gate, and apply what comes back: a `Tunnel` or `Exchange`
to serve, or an `Answer` to send. They decide nothing themselves. Every refusal is
audited here, once, with the same fields for every engine.

The gate decides with pure functions (`target`, `credentials`, `leaks`, the policy
matcher) and reaches the outside only through the ports it is given: token
verification, the policy set, the destination guard (resolve, classify, pin) and the
secret cache.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gateway import metrics
from gateway.core import credentials, target
from gateway.core.addresses import Pinned
from gateway.core.audit import record
from gateway.core.evaluate import Routed, route
from gateway.core.exchange import Exchange, Signer
from gateway.core.identity import Identity, TokenRefused
from gateway.core.leaks import (
    LeakScan,
    constant_token_markers,
    own_token_markers,
    sensitive_markers,
)
from gateway.core.messages import Headers, RequestHead
from gateway.core.names import DestinationError, is_ip, normalize_host
from gateway.core.refusal import GATEWAY_ERROR, Answer, Refusal, answer
from gateway.metering import Metering
from gateway.policy import Credential, Decision, Policy, PolicySet, Request
from gateway.secrets.ephemeral import EphemeralKeys
from gateway.secrets.value import SecretValue
from gateway.state import SandboxAddress

if TYPE_CHECKING:  # (a port: the app hands the gate its token service)
    from gateway.tokens import TokenService

log = logging.getLogger("sandbox_gateway")

__all__ = ["INTERNAL_HOST", "Client", "Gate", "Refused", "Tunnel"]

INTERNAL_HOST = "sandbox-gateway.internal"
_MARKER_CACHE = 10_000


class Guard(Protocol):
    """The destination check: resolve, classify, choose the address (raises Refusal)."""

    async def check(self, host: str, port: int) -> Pinned: ...


class Secrets(Protocol):
    async def get(self, name: str) -> SecretValue: ...
    def invalidate(self, name: str, rejected: SecretValue | None = None) -> None: ...
    def known_items(self) -> list[tuple[str, SecretValue]]: ...


class Signers(Protocol):
    """Makes the request signer of a credential that signs (AWS SigV4) from its
    minted value (the minting backends, gateway/minting/)."""

    def signer(self, credential: Credential, value: SecretValue) -> Signer: ...


class Registry(Protocol):
    def sandbox_for(self, ip: str) -> SandboxAddress | None: ...


class AuditHealth(Protocol):
    """The audit sink's health (gateway/audit.py): `refusing` is why new exchanges must
    be refused now (their audit lines cannot be written), or None."""

    @property
    def refusing(self) -> str | None: ...


@dataclass(slots=True)
class Tunnel:
    """An admitted tunnel (CONNECT, or a transparent connection): where it goes, how
    it was decided, and the address checked for it."""

    host: str
    port: int
    decision: Decision
    pinned: Pinned | None  # None: served by the gateway itself (INTERNAL_HOST)
    passthrough: bool
    tcp: bool
    started: float = field(default_factory=time.time)
    audited: bool = False  # a line was written for it (an exchange, a refusal inside it)


@dataclass(slots=True, eq=False)
class Client:
    """One client connection as the gate knows it. `listener`: proxy or transparent;
    `engine`: which engine serves it now (named on audit lines)."""

    peer: tuple[str, int]
    listener: str = "proxy"
    engine: str = "h1"
    identity: Identity | None = None
    token: str | None = None
    registered: bool = False  # identity from the transparent registry (source address)
    tunnel: Tunnel | None = None
    pins: dict[tuple[str, int], Pinned] = field(default_factory=dict)
    open: bool = False  # counted in the open-connections gauge
    counted: str | None = None  # the sandbox whose connection limit this one counts against
    end: Callable[[], None] | None = None  # ends the connection now, whichever engine has it
    ended_by: str | None = None  # the gate ended it (`sweep`): the code its lines carry


class Refused(Exception):
    """A refusal the gate has audited, with its rendered answer (what the engine sends,
    if the client can still read one)."""

    def __init__(self, refusal: Refusal, answer: Answer) -> None:
        super().__init__(refusal.code)
        self.refusal = refusal
        self.answer = answer


def _rule(decision: Decision | None) -> str | None:
    return decision.rule.source if decision is not None and decision.rule is not None else None


def _registered_identity(entry: SandboxAddress) -> Identity:
    return Identity(sandbox=entry.sandbox, policy=entry.policy, jti=f"ip:{entry.ip}",
                    scope={}, issued_at=0.0, expires_at=math.inf, lifetime_end=math.inf)


class Gate:
    """See the module docstring. One per gateway process; engines share it."""

    def __init__(self, *, tokens: TokenService, policies: Callable[[], PolicySet],
                 guard: Guard, secrets: Secrets, registry: Registry,
                 audit: Callable[[dict[str, Any]], None],
                 resolve: Callable[[str, int], Awaitable[list[str]]] | None = None,
                 metering: Metering | None = None, signers: Signers | None = None,
                 ephemeral: EphemeralKeys | None = None, audit_health: AuditHealth | None = None,
                 connections_per_sandbox: int = 256, max_connections: int = 1 << 30) -> None:
        self.audit_health = audit_health
        self.metering = metering
        self.ephemeral = ephemeral if ephemeral is not None else EphemeralKeys()
        self.signers = signers
        self.resolve = resolve or _no_resolver
        self.max_connections = max_connections
        self.open_connections = 0
        self.tokens = tokens
        self.connections_per_sandbox = connections_per_sandbox
        self._per_sandbox: dict[str, int] = {}
        self._clients: set[Client] = set()  # open, for `sweep`
        self.policies = policies
        self.guard = guard
        self.secrets = secrets
        self.registry = registry
        self._audit = audit
        self._scans: dict[tuple[str, str | None], LeakScan] = {}
        self._scans_version: tuple[object, ...] = ()
        self._shapes: dict[str, str | None] = {}

    # -- audit ---------------------------------------------------------------------------

    def audit(self, client: Client, *, decision: str, reason: str, rule: str | None,
              method: str | None = None, scheme: str | None = None, host: str | None = None,
              port: int | None = None, path: str | None = None, status: int | None = None,
              error: str | None = None, bytes_in: int | None = 0, bytes_out: int | None = 0,
              started: float | None = None, path_taken: str | None = None,
              credential: str | None = None, identity: Identity | None = None,
              usage: dict[str, Any] | None = None) -> None:
        """Write one audit line (every engine's lines go through here). A line of a
        connection the gate ended (`sweep`) names why instead of how it broke."""
        if client.tunnel is not None:
            client.tunnel.audited = True
        if client.ended_by is not None and (error is not None or method == "CONNECT"):
            error = client.ended_by
        self._audit(record(
            identity=identity or client.identity, client=client.peer,
            listener=client.listener, method=method, scheme=scheme, host=host, port=port,
            path=path, decision=decision, reason=reason, rule=rule, status=status,
            error=error, bytes_in=bytes_in, bytes_out=bytes_out,
            started=time.time() if started is None else started, path_taken=path_taken,
            engine=client.engine, credential=credential, usage=usage,
            policy_rev=self.policies().revision))

    def refuse(self, client: Client, refusal: Refusal, *, method: str | None = None,
               scheme: str | None = None, host: str | None = None, port: int | None = None,
               path: str | None = None, started: float | None = None,
               close: bool = False, usage: dict[str, Any] | None = None) -> Answer:
        """Audit a refusal and render it (in the provider's shape on a preset's host);
        ``usage``: what a metered exchange refused part-way had used."""
        self.audit(client, decision="deny", reason=refusal.reason, rule=refusal.rule,
                   method=method, scheme=scheme, host=host, port=port, path=path,
                   status=refusal.status, error=refusal.code, started=started,
                   credential=refusal.credential, usage=usage, identity=refusal.identity)
        if refusal.code.startswith("token_") or refusal.code in (
                "auth_required", "sandbox_mismatch", "unknown_sandbox"):
            metrics.child(metrics.TOKENS_REFUSED, refusal.code).inc()
        return answer(refusal, shape=self.shape(host) if method is not None else None,
                      close=close)

    def shape(self, host: str | None) -> str | None:
        """The error-body family of the provider whose preset binds `host`, if any."""
        if host is None:
            return None
        found = self._shapes.get(host, "?")
        if found == "?":
            found = next((credentials.shape_of(c.preset or c.kind) for c in
                          self.policies().credentials.values()
                          if (c.preset or c.mint) and c.binds(host)), None)
            if len(self._shapes) > 10_000:
                self._shapes.clear()
            self._shapes[host] = found
        return found

    # -- connections ---------------------------------------------------------------------

    def opened(self, client: Client) -> None:
        """A client connection was accepted (counted until `closed`). Past the global cap
        (derived from the open-files limit) raises Refused: the engine answers 503 and
        closes, before the process runs out of descriptors for everyone."""
        if client.open:
            return
        client.open = True
        self._clients.add(client)
        self.open_connections += 1
        metrics.OPEN_CONNECTIONS.inc()
        if self.open_connections > self.max_connections:
            refusal = Refusal("at_capacity", f"the gateway has {self.max_connections} open "
                              "connections, its limit (derived from the open-files limit); "
                              "retry shortly", retry_after=1)
            raise Refused(refusal, self.refuse(client, refusal, close=True))

    def closed(self, client: Client) -> None:
        """The client connection ended, whichever engine served it (idempotent). A
        tunnel it still holds is audited now if it has no line yet (`tunnel_closed`)."""
        if client.tunnel is not None:
            self.tunnel_closed(client, None, None)
        if client.open:
            client.open = False
            self._clients.discard(client)
            self.open_connections -= 1
            metrics.OPEN_CONNECTIONS.dec()
        self.closed_count(client)

    def _count(self, client: Client) -> None:
        """Count the identified connection against its sandbox's limit."""
        assert client.identity is not None
        sandbox = client.identity.sandbox
        if client.counted == sandbox:
            return
        if client.counted is not None:
            self.closed_count(client)
        used = self._per_sandbox.get(sandbox, 0)
        if used >= self.connections_per_sandbox:
            raise Refusal("too_many_connections", f"sandbox {sandbox!r} already has {used} "
                          f"open connections (limits.connections_per_sandbox = "
                          f"{self.connections_per_sandbox}); close idle connections or reuse "
                          "them (keep-alive)", retry_after=1)
        self._per_sandbox[sandbox] = used + 1
        client.counted = sandbox

    def closed_count(self, client: Client) -> None:
        sandbox, client.counted = client.counted, None
        if sandbox is not None:
            left = self._per_sandbox.get(sandbox, 1) - 1
            if left > 0:
                self._per_sandbox[sandbox] = left
            else:
                self._per_sandbox.pop(sandbox, None)

    def connections_of(self, sandbox: str) -> int:
        return self._per_sandbox.get(sandbox, 0)

    def sweep(self) -> int:
        """End every open connection whose identity no longer holds (`recheck`): its
        token expired or revoked (or the family it was refreshed from), its policy gone,
        its transparent sandbox no longer registered as it was. Requests are checked
        one by one as they come; this ends what sends no more requests - passthrough
        tunnels, idle keep-alive tunnels, streams, WebSockets - on every engine. A token
        that merely expired ends passthrough tunnels only: an intercepted request under
        way when it expired may finish (its next request is refused), as the token's
        holder did nothing wrong. Called every half second on every worker (the state
        store's view). Returns how many were ended; their audit lines carry the code
        (`ended_by`)."""
        ended = 0
        for client in list(self._clients):
            identity, end = client.identity, client.end
            if identity is None or end is None or client.ended_by is not None or (
                    client.token is None and not client.registered):
                continue
            try:
                self.recheck(client)
                continue
            except Refusal as refused:
                if refused.code == "token_expired" and not (
                        client.tunnel is not None and client.tunnel.passthrough):
                    continue  # (an intercepted request under way may finish)
                client.ended_by = refused.code
            log.info("ended the connection from %s:%s of sandbox %s: %s", *client.peer,
                     identity.sandbox, client.ended_by)
            end()
            ended += 1
        return ended

    # -- identify ------------------------------------------------------------------------

    def identify(self, client: Client, proxy_authorization: str | None) -> None:
        """Establish the client's identity from its proxy credentials (raises Refusal)."""
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
        identity = self._verify(client, token)
        if user is not None and user != identity.sandbox:
            raise Refusal("sandbox_mismatch", f"the proxy username {user[:64]!r} is not the "
                          f"token's sandbox {identity.sandbox!r}; use the sandbox id as the "
                          "proxy username")
        client.identity, client.token = identity, token
        self._count(client)

    def identify_registered(self, client: Client) -> bool:
        """Transparent mode: identify a client by its registered source address."""
        entry = self.registry.sandbox_for(_source(client))
        if entry is None:
            return False
        client.identity, client.registered = _registered_identity(entry), True
        self._count(client)
        return True

    def _verify(self, client: Client, token: str) -> Identity:
        try:
            identity = self.tokens.verify(token)
        except TokenRefused as refused:  # (identity: only from a verified signature)
            raise Refusal(refused.code, refused.reason, identity=refused.identity) from None
        if not identity.used_from(_source(client)):
            raise Refusal("token_wrong_source", f"this token is bound to "
                          f"{', '.join(identity.cidr)} and cannot be used from "
                          f"{_source(client)}; mint a token for this sandbox's address")
        return identity

    def recheck(self, client: Client, head: RequestHead | None = None) -> Identity:
        """The client's identity, checked again (expiry, revocation, registration) for
        the next request. A transparent client that is not registered identifies by a
        gateway token where its provider expects a key (`head`). Raises Refusal."""
        if client.registered:
            entry = self.registry.sandbox_for(_source(client))
            assert client.identity is not None
            if entry is None or entry.policy != client.identity.policy:
                raise _UNREGISTERED
            return client.identity
        token = client.token
        if token is None and head is not None and client.listener == "transparent":
            token = credentials.find_token(head.headers, head.target)
            if token is None:
                raise _UNREGISTERED
        if token is None:
            raise Refusal("auth_required", "no gateway token on this connection")
        client.identity = self._verify(client, token)
        if client.token is None:
            client.token = token
        self._count(client)
        return client.identity

    # -- tunnels -------------------------------------------------------------------------

    def check_audit(self) -> None:
        """New exchanges are refused while their audit lines cannot be written (the
        sink's `refusing`, `audit.on_failure: refuse`). Raises Refusal."""
        health = self.audit_health
        if health is not None and health.refusing is not None:
            raise Refusal("audit_unavailable", _AUDIT_UNAVAILABLE, retry_after=5)

    def policy(self, identity: Identity) -> Policy:
        found = self.policies().get(identity.policy)
        if found is None:
            raise Refusal("policy_denied", f"policy {identity.policy!r} is not loaded any "
                          "more; mint a token for an existing policy (GET /v1/policies)")
        return found

    async def connect(self, client: Client, authority: str, proxy_authorization: str | None,
                      *, started: float | None = None) -> Tunnel:
        """Admit a CONNECT: identify the client by its proxy credentials, decide the
        tunnel (policy at tunnel level), check and pin the destination. Raises Refused
        (audited, with the answer to send)."""
        host: str | None = None
        port: int | None = None
        try:
            self.identify(client, proxy_authorization)
            host, port = target.tunnel_authority(authority)
            self.check_audit()
            return await self._admit_tunnel(client, host, port, "https")
        except Refusal as refusal:
            raise Refused(refusal, self.refuse(client, refusal, method="CONNECT", host=host,
                                               port=port, started=started,
                                               close=True)) from None
        except Exception:
            raise self._crashed(client, "CONNECT", host, port) from None

    async def _admit_tunnel(self, client: Client, host: str, port: int, scheme: str) -> Tunnel:
        assert client.identity is not None
        decision = self._route(client.identity, Request(None, scheme, host, port, None)
                               ).decision
        tcp = decision.rule is not None and decision.rule.protocol == "tcp"
        # A would-deny tunnel (report mode) is inspected, so its requests are recorded.
        passthrough = tcp or (decision.result == "allow" and not decision.inspect)
        pinned = None if host == INTERNAL_HOST else await self._check(client, host, port)
        tunnel = Tunnel(host, port, decision, pinned, passthrough, tcp)
        client.tunnel = tunnel
        return tunnel

    async def _check(self, client: Client, host: str, port: int) -> Pinned:
        pinned = client.pins.get((host, port))
        if pinned is None:
            try:
                pinned = await self.guard.check(host, port)
            except Refusal as refusal:
                metrics.child(metrics.DESTINATIONS_REFUSED, refusal.code).inc()
                raise
            if len(client.pins) > 64:
                client.pins.clear()
            client.pins[(host, port)] = pinned
        return pinned

    async def open_transparent(self, client: Client, orig: tuple[str, int], kind: str,
                               name: str | None) -> Tunnel:
        """Admit a redirected connection from its first bytes: `kind` is `tls`, `http`
        or `tcp`, `name` the SNI or Host it gives. The name must resolve to the original
        address (a sandbox may not pair an allowed name with another address); the
        original address is checked like any destination. Raises Refused (audited)."""
        orig_ip, port = orig
        host: str | None = None
        try:
            self.check_audit()
            if kind == "tcp":
                if not client.registered:
                    raise Refusal("unknown_sandbox", "raw TCP from an unregistered source: "
                                  "register the sandbox with POST /v1/sandboxes")
                name = orig_ip
            elif kind == "tls" and not name and is_ip(orig_ip):
                name = orig_ip  # TLS to an address carries no SNI: the address is the name
            if not name:
                raise Refusal("bad_destination", "no server name ("
                              f"{'SNI' if kind == 'tls' else 'Host'}) to decide on; clients "
                              "must send one")
            try:
                host = normalize_host(name if kind != "http" else
                                      target.tunnel_authority(_with_port(name, port))[0])
            except (DestinationError, Refusal) as exc:
                raise Refusal("bad_destination", f"bad server name: {exc}") from None
            pinned = Pinned(host, port, orig_ip, trusted=True)
            if client.identity is None:
                # Unregistered: identity comes per request from a token in a key carrier,
                # which needs the request: intercept, decide per request.
                if kind != "tls" and kind != "http":
                    raise _UNREGISTERED
                await self._bind(host, orig_ip, port)
                tunnel = Tunnel(host, port, Decision("allow", "identified per request",
                                                     None, True), pinned, False, False)
            else:
                # The policy first: a denied name is never even resolved.
                decision = self._route(client.identity, Request(
                    None, "tcp" if kind == "tcp" else "https" if kind == "tls" else "http",
                    host, port, None)).decision
                await self._bind(host, orig_ip, port)
                tcp = kind == "tcp" or (decision.rule is not None and
                                        decision.rule.protocol == "tcp")
                # Plain HTTP is always inspected: every request's Host is checked.
                passthrough = tcp or (kind == "tls" and decision.result == "allow"
                                      and not decision.inspect)
                tunnel = Tunnel(host, port, decision, pinned, passthrough, tcp)
            client.tunnel = tunnel
            client.pins[(host, port)] = pinned
            # (the original address too: mitmproxy dials a redirected connection by it)
            client.pins[(normalize_host(orig_ip), port)] = pinned
            return tunnel
        except Refusal as refusal:
            raise Refused(refusal, self.refuse(client, refusal, host=host or orig_ip,
                                               port=port, close=True)) from None
        except Exception:
            raise self._crashed(client, None, host or orig_ip, port) from None

    async def _bind(self, host: str, orig_ip: str, port: int) -> None:
        """Refuse pairing `host` with `orig_ip` unless the name resolves to it; then the
        address itself must pass the destination check."""
        if host != orig_ip:
            try:
                pinned: Pinned | None = await self.guard.check(host, port)
            except Refusal as refused:
                if refused.code != "forbidden_destination":
                    raise
                pinned = None
            if pinned is not None and pinned.trusted:
                answers = {pinned.ip}
            else:
                try:
                    answers = {normalize_host(ip) for ip in await self.resolve(host, port)}
                except (OSError, DestinationError):
                    answers = set()
            if orig_ip not in answers:
                raise Refusal("host_mismatch", f"{host} does not resolve to the connection's "
                              f"address {orig_ip}; a sandbox may not pair an allowed name "
                              "with another address")
            if pinned is not None and pinned.trusted:
                return
        await self.guard.check(orig_ip, port)

    def check_hello(self, client: Client, sni: str | None, *, tls: bool) -> None:
        """The first bytes of an admitted tunnel: a passthrough tunnel must carry TLS
        (unless `protocol: tcp`) and every TLS tunnel's server name must be its host.
        Raises Refused (audited)."""
        tunnel = client.tunnel
        assert tunnel is not None
        try:
            refusal = self._hello_refusal(tunnel, sni, tls)
        except Exception:
            raise self._crashed(client, "CONNECT", tunnel.host, tunnel.port) from None
        if refusal is not None:
            raise Refused(refusal, self.refuse(client, refusal, method="CONNECT",
                                               host=tunnel.host, port=tunnel.port,
                                               started=tunnel.started, close=True))

    def _hello_refusal(self, tunnel: Tunnel, sni: str | None, tls: bool) -> Refusal | None:
        refusal: Refusal | None = None
        if not tls:
            if tunnel.passthrough and not tunnel.tcp:
                refusal = Refusal("policy_denied", f"non-TLS bytes in a tunnel to "
                                  f"{tunnel.host}:{tunnel.port}; add protocol: tcp to the rule "
                                  "to allow raw TCP", _rule(tunnel.decision))
        elif not tunnel.tcp:
            refusal = target.check_server_name(tunnel.host, sni,
                                               passthrough=tunnel.passthrough)
        return refusal

    def _crashed(self, client: Client, method: str | None, host: str | None,
                 port: int | None) -> Refused:
        """The gate's own fail-closed boundary: an unexpected error while deciding is a
        refusal (500 gateway_error), logged with its traceback and audited."""
        log.exception("the gate failed while deciding; refusing (fail closed)")
        return Refused(GATEWAY_ERROR, self.refuse(client, GATEWAY_ERROR, method=method,
                                                  host=host, port=port, close=True))

    def tunnel_closed(self, client: Client, bytes_in: int | None, bytes_out: int | None,
                      error: str | None = None) -> None:
        """A tunnel ended (idempotent): a passthrough tunnel's one line, for its decision
        and traffic; an inspected tunnel's only if no line was written for it (closed
        before any request: `error` says how, default `no_request`). So every tunnel
        answered 200 is on the audit trail, tunnels that never carried a byte included."""
        tunnel = client.tunnel
        if tunnel is None:
            return
        client.tunnel = None
        if not tunnel.passthrough:
            if tunnel.audited:
                return
            error = error or "no_request"
        metrics.child(metrics.BYTES, "in").inc(bytes_in or 0)
        self.audit(client, decision=tunnel.decision.result, reason=tunnel.decision.reason,
                   rule=_rule(tunnel.decision), method="CONNECT", host=tunnel.host,
                   port=tunnel.port, status=200, error=error, bytes_in=bytes_in,
                   bytes_out=bytes_out, started=tunnel.started,
                   path_taken="passthrough" if tunnel.passthrough else "intercept")

    # -- requests ------------------------------------------------------------------------

    async def begin(self, client: Client, head: RequestHead, *, tls: bool,
                    proxy_authorization: str | None = None) -> Exchange | Answer:
        """Admit one request. In a tunnel the connection's identity is checked again; a
        plain proxy request (no tunnel) identifies with its own `proxy_authorization`.
        Returns the exchange to serve, or the answer to send (a refusal, audited, or
        the sandbox-facing API's)."""
        started = time.time()
        tunnel = client.tunnel
        tgt: target.Target | None = None
        try:
            head.headers.remove("proxy-authorization")
            if tunnel is None:
                self.identify(client, proxy_authorization)
            identity = self.recheck(client, head)
            tgt = target.request_target(
                head, (tunnel.host, tunnel.port) if tunnel is not None else None, tls=tls)
            self.check_audit()
            upgrade = head.headers.get("upgrade")
            if upgrade is not None and upgrade.strip().lower() != "websocket":
                raise Refusal("unsupported", f"upgrade to {upgrade[:40]!r} is not supported "
                              "through the gateway; only WebSocket upgrades are relayed")
            routed = self._route(identity, Request(head.method, tgt.scheme, tgt.host,
                                                   tgt.port, tgt.path))
            decision = routed.decision
            if tgt.host == INTERNAL_HOST:
                return self._local(client, head, tgt, decision, started)
            pinned = (tunnel.pinned if tunnel is not None and tunnel.pinned is not None
                      else await self._check(client, tgt.host, tgt.port))
            exchange = Exchange(self, client, identity, head, tgt, decision, pinned, started)
            await self._prepare(exchange, routed.credential)
            return exchange
        except Exception as exc:
            refusal = exc if isinstance(exc, Refusal) else GATEWAY_ERROR
            if refusal is GATEWAY_ERROR:
                log.exception("the gate failed while deciding; refusing (fail closed)")
            return self.refuse(client, refusal, method=head.method,
                               scheme=tgt.scheme if tgt else ("https" if tls else "http"),
                               host=tgt.host if tgt else (tunnel.host if tunnel else None),
                               port=tgt.port if tgt else (tunnel.port if tunnel else None),
                               path=tgt.path if tgt else None, started=started,
                               close=refusal.code in ("bad_request", "gateway_error"))

    def _route(self, identity: Identity, request: Request) -> Routed:
        """Stage 1 of the decision pipeline (`core/evaluate.py`), timed; raises its
        refusal."""
        start = time.perf_counter()
        routed = route(self.policies().credentials, self.policy(identity), request)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - start)
        if routed.refusal is not None:
            raise routed.refusal
        return routed

    async def _prepare(self, ex: Exchange, credential: Credential | None) -> None:
        """The credential swap and the head's leak scan (raises Refusal)."""
        head, decision, tgt = ex.head, ex.decision, ex.target
        path = tgt.path
        swap = None
        if credential is not None:
            minted = None
            if decision.rule is not None and decision.rule.allow_minted_secrets:
                minted = self._minted_finder(credential.name, ex.identity.sandbox)
            swap, path = credentials.plan(credential, head.headers, tgt, ex.identity,
                                          self.tokens.verify, _rule(decision), minted)
            if self.metering is not None:
                ex.meter(self.metering, self.policy(ex.identity), credential.preset)
        ex.scan = self.scan_for(tgt.host, ex.client.token)
        found = ex.scan.head(head.method, path, head.headers.fields)
        if found is not None:
            raise ex.leak(found)
        signer: Signer | None = None
        if swap is not None and swap.minted is not None:  # the provider's own, as sent
            ex.injected(swap.credential.name, swap.credential.secret, swap.minted)
            swap = None
        if swap is not None:
            credential, name = swap.credential, swap.credential.secret
            try:
                value = await self.secrets.get(name)
            except Exception as exc:  # SecretUnavailable, or a store or mint failure
                reason = getattr(exc, "reason", None) or "the secret store failed"
                if credential.mint is not None:
                    raise Refusal("credential_unavailable", f"credential {credential.name!r}"
                                  f" ({credential.kind}) could not be minted: {reason}",
                                  _rule(decision), credential=credential.name) from None
                raise Refusal("secret_unavailable", f"credential {credential.name!r} "
                              f"could not be fetched: {reason}", _rule(decision),
                              credential=credential.name) from None
            if credential.signs:  # AWS SigV4: re-signed, now or once the body is whole
                if self.signers is None:
                    raise Refusal("credential_unavailable", f"credential {credential.name!r}"
                                  " signs requests, and this gateway has no signer for it",
                                  _rule(decision), credential=credential.name)
                ex.injected(credential.name, name, value)
                signer = self.signers.signer(credential, value)
            else:
                path = credentials.apply(swap, head.headers, path, value.reveal())
                ex.injected(credential.name, name, value)
        ex.forward_path(path)
        if signer is not None:  # the signature covers the request line as forwarded
            ex.sign_with(signer)

    def _minted_finder(self, credential: str, sandbox: str
                       ) -> Callable[[str], SecretValue | None]:
        """Finds a provider-minted secret of `credential` that `sandbox` minted."""
        def find(value: str) -> SecretValue | None:
            key = self.ephemeral.find(value)
            if key is None or key.credential != credential or key.sandbox != sandbox:
                return None
            return key.value
        return find

    def scan_for(self, host: str, token: str | None) -> LeakScan:
        """The leak markers for a request to `host` from a client holding `token`:
        every gateway token's constant parts and this token's own, plus every fetched key
        and provider-minted secret that no credential binds to `host`. Rebuilt when
        policies, keys or minted secrets change."""
        policy_set = self.policies()
        known = self.secrets.known_items()
        version = (id(policy_set), self.ephemeral.version,
                   tuple(id(value) for _, value in known))
        if version != self._scans_version or len(self._scans) > _MARKER_CACHE:
            self._scans.clear()
            self._scans_version = version
        key = (host, token)
        scan = self._scans.get(key)
        if scan is None:
            creds = policy_set.credentials.values()
            secrets = [m for name, value in known
                       if not any(c.secret == name and c.binds(host) for c in creds)
                       for m in _markers_of(value)]
            for minted in self.ephemeral.live():
                bound = policy_set.credentials.get(minted.credential)
                if bound is None or not bound.binds(host):
                    secrets.extend(_markers_of(minted.value))
            scan = self._scans[key] = LeakScan(constant_token_markers(self.tokens.issuer),
                                               secrets, own_token_markers(token or ""))
        return scan

    def _local(self, client: Client, head: RequestHead, tgt: target.Target,
               decision: Decision, started: float) -> Answer:
        """The sandbox-facing API at http(s)://sandbox-gateway.internal (policy opt-in):
        `POST /v1/tokens/refresh[?ttl=10m]` exchanges the token for a fresh one."""
        from gateway.config import ConfigError, parse_duration
        from gateway.tokens import TokenError

        path, _, query = tgt.path.partition("?")
        if head.method != "POST" or path != "/v1/tokens/refresh":
            raise Refusal("policy_denied", f"{INTERNAL_HOST} serves only "
                          "POST /v1/tokens/refresh")
        if client.registered or client.token is None:
            raise Refusal("auth_required", "token refresh needs a gateway token")
        assert client.identity is not None
        ttl_text = dict(p.partition("=")[::2] for p in query.split("&") if p).get("ttl")
        try:
            ttl = parse_duration(ttl_text, "ttl") if ttl_text else None
            minted = self.tokens.refresh(client.identity, ttl=ttl)
        except TokenRefused as refused:
            raise Refusal(refused.code, refused.reason) from None
        except (TokenError, ConfigError) as exc:
            raise Refusal("bad_request", str(exc)) from None
        metrics.TOKENS_ISSUED.labels(kind="refresh").inc()
        body = json.dumps({"token": minted.token, "jti": minted.jti,
                           "expires_at": minted.expires_at}).encode()
        self.audit(client, decision=decision.result, reason=decision.reason,
                   rule=_rule(decision), method=head.method, scheme=tgt.scheme,
                   host=tgt.host, port=tgt.port, path=tgt.path, status=200,
                   bytes_in=len(body), started=started, path_taken="local")
        return Answer(200, "OK", Headers.of(
            ("Content-Type", "application/json"), ("Cache-Control", "no-store"),
            ("Content-Length", str(len(body)))), body)


async def _no_resolver(host: str, port: int) -> list[str]:
    raise OSError(f"no resolver for {host}")


_AUDIT_UNAVAILABLE = ("the gateway cannot write its audit trail now and refuses new "
                      "requests until it can (audit.on_failure: refuse); retry later")

_UNREGISTERED = Refusal(
    "unknown_sandbox",
    "this source address is not a registered sandbox and the request carries no gateway "
    "token; register it (POST /v1/sandboxes) or send the token as the API key",
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
        except ValueError:  # binascii.Error, UnicodeDecodeError, non-ASCII input
            return None
        user, sep, password = decoded.partition(":")
        if not sep or not password:
            return None
        return (user or None), password
    return None


def _source(client: Client) -> str:
    try:
        return normalize_host(client.peer[0])
    except DestinationError:
        return client.peer[0]


def _with_port(name: str, port: int) -> str:
    """`host` or `host:port` (a Host header) as an authority with a port."""
    if name.endswith("]") or name.count(":") == 0:
        return f"{name}:{port}"
    return name


_MARKERS: dict[int, tuple[SecretValue, frozenset[bytes]]] = {}


def _markers_of(value: SecretValue) -> frozenset[bytes]:
    cached = _MARKERS.get(id(value))
    if cached is None or cached[0] is not value:
        if len(_MARKERS) > 1024:
            _MARKERS.clear()
        markers = frozenset().union(*(sensitive_markers(p.encode()) for p in value.pieces()))
        cached = _MARKERS[id(value)] = (value, markers)
    return cached[1]
