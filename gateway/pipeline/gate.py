"""The gate: the one place every engine asks "may this pass?", in data-flow order.

    identify → target → admit (policy, destination, pin) → credential → leaks → audit

Engines (the front door and its splice, the HTTP/1 engine, the mitmproxy adapter,
transparent mode) translate their native objects into `Client`, authorities and
`RequestHead`s, call the gate, and apply what comes back: a `Tunnel` or `Exchange`
to serve, or an `Answer` to send. They decide nothing themselves: even input they
cannot parse is reported here (`unparsable`). Every refusal is audited, once, with the
same fields for every engine (`trail.Trail`).

The gate composes one part per job - the audit trail (`trail`), connection limits
(`connections`), identities (`identify`), leak markers (`markers`), the sandbox-facing
API (`local_api`) - and decides with pure functions (`evaluate`, `target`,
`credentials`, `leaks`). It reaches the outside only through the ports it is given
(`ports`): token verification, the policy set, the destination guard (resolve,
classify, pin), the secret cache, the registry and the request signers.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.core import approvals, credentials, local_api, mcp, target
from gateway.core.addresses import Pinned
from gateway.core.client import Client, Refused, Tunnel
from gateway.core.evaluate import Routed, granted, route, with_grants
from gateway.core.identity import Identity
from gateway.core.local_api import INTERNAL_HOST
from gateway.core.mcp_pins import Server, ServerPins, ToolPins
from gateway.core.messages import RequestHead
from gateway.core.names import DestinationError, is_ip, normalize_host
from gateway.core.policy import Credential, Decision, Policy, PolicySet, Request
from gateway.core.policy.ask_rule import Ask
from gateway.core.ports import (
    NO_MINTED_SECRETS,
    SILENT,
    Approvals,
    AuditHealth,
    Capacity,
    Guard,
    Metering,
    MintedSecrets,
    Registry,
    Secrets,
    Signer,
    Signers,
    StateHealth,
    Telemetry,
    Tokens,
    Workloads,
)
from gateway.core.refusal import GATEWAY_ERROR, Answer, Refusal, answered_inside_tls
from gateway.core.secret_value import SecretValue
from gateway.core.trail import Trail, rule_of
from gateway.pipeline.connections import Connections
from gateway.pipeline.exchange import Exchange, leak_refusal
from gateway.pipeline.identify import UNREGISTERED, Identifier
from gateway.pipeline.markers import Markers

log = logging.getLogger("sandbox_gateway")

__all__ = ["INTERNAL_HOST", "Client", "Gate", "Refused", "Tunnel"]

_rule = rule_of


class Gate:
    """See the module docstring. One per gateway process; engines share it."""

    def __init__(self, *, tokens: Tokens, policies: Callable[[], PolicySet],
                 guard: Guard, secrets: Secrets, registry: Registry,
                 audit: Callable[[dict[str, Any]], None],
                 resolve: Callable[[str, int], Awaitable[list[str]]] | None = None,
                 metering: Metering | None = None, signers: Signers | None = None,
                 ephemeral: MintedSecrets | None = None, audit_health: AuditHealth | None = None,
                 connections_per_sandbox: int = 256, max_connections: int = 1 << 30,
                 telemetry: Telemetry = SILENT, clock: Callable[[], float] = time.time,
                 refusals_inside_tls: bool = False, workloads: Workloads | None = None,
                 approvals: Approvals | None = None, pins: ToolPins | None = None,
                 state_health: StateHealth | None = None,
                 capacity: Capacity | None = None) -> None:
        self.tokens = tokens
        self.policies = policies
        self.guard = guard
        self.secrets = secrets
        self.resolve = resolve or _no_resolver
        self.metering = metering
        self.signers = signers
        self.ephemeral = ephemeral if ephemeral is not None else NO_MINTED_SECRETS
        self.audit_health = audit_health
        self.state_health = state_health
        self.telemetry = telemetry
        self.refusals_inside_tls = refusals_inside_tls
        self.trail = Trail(audit, policies, telemetry, clock)
        self.connections = Connections(per_sandbox=connections_per_sandbox,
                                       limit=max_connections, telemetry=telemetry,
                                       capacity=capacity)
        self.identities = Identifier(tokens, registry, self.connections, workloads, policies)
        self.markers = Markers(policies, secrets, self.ephemeral, lambda: self.tokens.issuer)
        self.mcp_sessions = mcp.Sessions()  # tools each MCP session was shown (flagging)
        self.pins = pins  # MCP tool descriptions pinned in the state store (None: per session)
        self.approvals = approvals  # ask mode: grants, and asking a person (None: off)

    @property
    def open_connections(self) -> int:
        return self.connections.open

    @property
    def max_connections(self) -> int:
        return self.connections.limit

    # -- connections ---------------------------------------------------------------------

    def opened(self, client: Client) -> None:
        """A client connection was accepted (counted until `closed`). Past the global cap
        (derived from the open-files limit), or while the process's `capacity` port says
        it has no room (its memory ceiling), raises Refused: the engine answers 503
        at_capacity and closes, before the process runs out of descriptors or memory for
        everyone."""
        refusal = self.connections.opened(client)
        if refusal is not None:
            raise Refused(refusal, self.trail.refuse(client, refusal, close=True))

    def closed(self, client: Client) -> None:
        """The client connection ended, whichever engine served it (idempotent). A
        tunnel it still holds is audited now if it has no line yet (`tunnel_closed`)."""
        if client.tunnel is not None:
            self.tunnel_closed(client, None, None)
        self.connections.closed(client)

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
        for client in self.connections.clients():
            identity, end = client.identity, client.end
            if identity is None or end is None or client.ended_by is not None:
                continue
            if self._grant_gone(client):
                client.ended_by = "grant_revoked"
                log.info("ended the connection from %s:%s of sandbox %s: its grant ended",
                         *client.peer, identity.sandbox)
                end()
                ended += 1
                continue
            if client.token is None and not client.registered:
                continue
            try:
                self.identities.recheck(client)
                continue
            except Refusal as refused:
                if refused.code == "token_expired" and not (
                        client.tunnel is not None and client.tunnel.passthrough):
                    continue  # (an intercepted request under way may finish)
                if refused.code == "identity_unavailable":
                    continue  # (a stale pod watch refuses what is new, ends nothing)
                client.ended_by = refused.code
            log.info("ended the connection from %s:%s of sandbox %s: %s", *client.peer,
                     identity.sandbox, client.ended_by)
            end()
            ended += 1
        return ended

    def _grant_gone(self, client: Client) -> bool:
        """The client's tunnel was opened by a grant that has been revoked or expired."""
        tunnel = client.tunnel
        if tunnel is None or self.approvals is None or tunnel.decision.rule is None:
            return False
        source = tunnel.decision.rule.source
        return source.startswith("grant:gr_") and not self.approvals.active(source[6:])

    def identify_registered(self, client: Client, orig: tuple[str, int]) -> bool:
        """Transparent mode: identify a redirected connection (to `orig`) by its
        registered source address; False if it is not registered. Raises Refused
        (audited) past its sandbox's connection limit."""
        try:
            return self.identities.identify_registered(client)
        except Refusal as refusal:
            raise Refused(refusal, self.trail.refuse(client, refusal, host=orig[0],
                                                     port=orig[1], close=True)) from None

    def unparsable(self, client: Client, reason: str, *, host: str | None = None,
                   port: int | None = None) -> Answer:
        """What a client sent cannot be read as HTTP (`reason` names what, in the
        engine's fixed words): refused `bad_request`, audited, the connection closes."""
        refusal = Refusal("bad_request", reason)
        return self.trail.refuse(client, refusal, host=host, port=port, close=True)

    def failed(self, client: Client, *, host: str | None = None,
               port: int | None = None) -> Answer:
        """An engine failed unexpectedly serving `client`: logged with the traceback,
        refused `gateway_error` (fail closed) and audited."""
        log.exception("an engine failed; refusing (fail closed)")
        return self.trail.refuse(client, GATEWAY_ERROR, host=host, port=port, close=True)

    # -- tunnels -------------------------------------------------------------------------

    def check_health(self) -> None:
        """New exchanges are refused while their audit lines cannot be written (the
        sink's `refusing`, `audit.on_failure: refuse`), and while the state store is
        away if the operator chose so (`state.unavailable: refuse`). Raises Refusal."""
        health = self.audit_health
        if health is not None and health.refusing is not None:
            raise Refusal("audit_unavailable", _AUDIT_UNAVAILABLE, retry_after=5)
        state = self.state_health
        if state is not None and state.refusing is not None:
            raise Refusal("state_unavailable", _STATE_UNAVAILABLE, retry_after=5)

    def policy(self, identity: Identity) -> Policy:
        found = self.policies().get(identity.policy)
        if found is None:
            raise Refusal("policy_denied", f"policy {identity.policy!r} is not loaded any "
                          "more; mint a token for an existing policy (GET /v1/policies)")
        return found

    async def connect(self, client: Client, authority: str, proxy_authorization: str | None,
                      *, started: float | None = None) -> Tunnel:
        """Admit a CONNECT: read its authority, identify the client by its proxy
        credentials, decide the tunnel (policy at tunnel level), check and pin the
        destination. Raises Refused (audited, with the answer to send; `inside` set where
        the refusal is to be answered inside TLS, `refusals.inside_tls`)."""
        host: str | None = None
        port: int | None = None
        try:
            unreadable: Refusal | None = None
            try:  # (read first: a token's refusal names the host, and can go inside TLS)
                host, port = target.tunnel_authority(authority)
            except Refusal as refused:
                unreadable = refused
            self.identities.identify(client, proxy_authorization)
            if unreadable is not None or host is None or port is None:
                raise unreadable or GATEWAY_ERROR
            self.check_health()
            return await self._admit_tunnel(client, host, port, "https")
        except Refusal as refusal:
            answer = self.trail.refuse(client, refusal, method="CONNECT", host=host, port=port,
                                       started=started, close=True)
            inside = host if (self.refusals_inside_tls and host is not None
                              and answered_inside_tls(refusal.code)) else None
            raise Refused(refusal, answer, inside) from None
        except Exception:
            raise self._crashed(client, "CONNECT", host, port) from None

    def answer_inside(self, refused: Refused, head: RequestHead) -> Answer:
        """The answer to a refused CONNECT for the request that came inside its TLS (the
        refusal's one audit line was written at the CONNECT): in the provider's error
        shape on its host, as text for git, and the connection closes."""
        return self.trail.render(refused.refusal, refused.inside, plain=_plain(head))

    async def _admit_tunnel(self, client: Client, host: str, port: int, scheme: str) -> Tunnel:
        assert client.identity is not None
        decision = (await self._decide(client, client.identity,
                                       Request(None, scheme, host, port, None))).decision
        tcp = decision.rule is not None and decision.rule.protocol == "tcp"
        # A would-deny tunnel (report mode) is inspected, so its requests are recorded.
        passthrough = tcp or (decision.result == "allow" and not decision.inspect)
        pinned = None if host == INTERNAL_HOST else await self._check(client, host, port)
        tunnel = Tunnel(host, port, decision, pinned, passthrough, tcp, self.trail.clock())
        client.tunnel = tunnel
        return tunnel

    async def _check(self, client: Client, host: str, port: int) -> Pinned:
        pinned = client.pins.get((host, port))
        if pinned is None:
            try:
                pinned = await self.guard.check(host, port)
            except Refusal as refusal:
                self.telemetry.count("destinations_refused", refusal.code)
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
            self.check_health()
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
                    raise UNREGISTERED
                await self._bind(host, orig_ip, port)
                tunnel = Tunnel(host, port, Decision("allow", "identified per request",
                                                     None, True), pinned, False, False,
                                self.trail.clock())
            else:
                # The policy first: a denied name is never even resolved.
                decision = (await self._decide(client, client.identity, Request(
                    None, "tcp" if kind == "tcp" else "https" if kind == "tls" else "http",
                    host, port, None))).decision
                await self._bind(host, orig_ip, port)
                tcp = kind == "tcp" or (decision.rule is not None and
                                        decision.rule.protocol == "tcp")
                # Plain HTTP is always inspected: every request's Host is checked.
                passthrough = tcp or (kind == "tls" and decision.result == "allow"
                                      and not decision.inspect)
                tunnel = Tunnel(host, port, decision, pinned, passthrough, tcp,
                                self.trail.clock())
            client.tunnel = tunnel
            client.pins[(host, port)] = pinned
            # (the original address too: mitmproxy dials a redirected connection by it)
            client.pins[(normalize_host(orig_ip), port)] = pinned
            return tunnel
        except Refusal as refusal:
            raise Refused(refusal, self.trail.refuse(client, refusal, host=host or orig_ip,
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
            raise Refused(refusal, self.trail.refuse(client, refusal, method="CONNECT",
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
        return Refused(GATEWAY_ERROR, self.trail.refuse(client, GATEWAY_ERROR, method=method,
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
        self.telemetry.count("bytes", "in", by=bytes_in or 0)
        self.trail.audit(client, decision=tunnel.decision.result, reason=tunnel.decision.reason,
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
        started = self.trail.clock()
        tunnel = client.tunnel
        tgt: target.Target | None = None
        try:
            head.headers.remove("proxy-authorization")
            if tunnel is None:
                self.identities.identify(client, proxy_authorization)
            identity = self.identities.recheck(client, head)
            tgt = target.request_target(
                head, (tunnel.host, tunnel.port) if tunnel is not None else None, tls=tls)
            self.check_health()
            upgrade = head.headers.get("upgrade")
            if upgrade is not None and upgrade.strip().lower() != "websocket":
                raise Refusal("unsupported", f"upgrade to {upgrade[:40]!r} is not supported "
                              "through the gateway; only WebSocket upgrades are relayed")
            routed = await self._decide(client, identity, Request(
                head.method, tgt.scheme, tgt.host, tgt.port, tgt.path), head)
            decision = routed.decision
            if tgt.host == INTERNAL_HOST:
                answered = local_api.serve(client, head, tgt, self.tokens, self.telemetry)
                self.trail.audit(client, decision=decision.result, reason=decision.reason,
                                 rule=_rule(decision), method=head.method, scheme=tgt.scheme,
                                 host=tgt.host, port=tgt.port, path=tgt.path, status=200,
                                 bytes_in=len(answered.body), started=started,
                                 path_taken="local")
                return answered
            pinned = (tunnel.pinned if tunnel is not None and tunnel.pinned is not None
                      else await self._check(client, tgt.host, tgt.port))
            exchange = Exchange(self.trail, self.secrets, client, identity, head, tgt, decision,
                                pinned, started)
            await self._prepare(exchange, routed.credential)
            return exchange
        except Exception as exc:
            refusal = exc if isinstance(exc, Refusal) else GATEWAY_ERROR
            if refusal is GATEWAY_ERROR:
                log.exception("the gate failed while deciding; refusing (fail closed)")
            return self.trail.refuse(client, refusal, method=head.method,
                               scheme=tgt.scheme if tgt else ("https" if tls else "http"),
                               host=tgt.host if tgt else (tunnel.host if tunnel else None),
                               port=tgt.port if tgt else (tunnel.port if tunnel else None),
                               path=tgt.path if tgt else None, started=started,
                               close=refusal.code in ("bad_request", "gateway_error"),
                               plain=_plain(head))

    async def _decide(self, client: Client, identity: Identity, request: Request,
                      head: RequestHead | None = None) -> Routed:
        """Stage 1, and ask mode where the policy lets a person decide: a grant that
        covers the request allows it; else an askable refusal (the policy's `ask:`, never
        a deny rule, a credential's binding, a destination the guard refuses or a `head`
        carrying a key or token to the host) or a rule with `ask:` is held until a person
        answers (raises the refusal)."""
        policy = self.policy(identity)
        start = time.perf_counter()
        routed = route(self.policies().credentials, policy, request)
        self.telemetry.observe("decision_seconds", time.perf_counter() - start)
        if self.approvals is None:
            if routed.refusal is not None:
                raise routed.refusal
            return routed
        rule = routed.decision.rule
        approvals_ = self.approvals
        routed, spec = with_grants(policy, routed, request, lambda asked: approvals_.grant_for(
            identity.sandbox, identity.policy, asked))
        if spec is None:
            if routed.refusal is not None:
                raise routed.refusal
            return routed
        assert routed.refusal is None or routed.refusal.code == "policy_denied"
        await self._check(client, request.host, request.port)  # (never asked: refused)
        if head is not None and routed.credential is None:
            # (nor what the leak checks would refuse once approved; a rule's own
            # credential is swapped, and its head scanned, once it is)
            found = self.markers.scan_for(request.host, client.token).head(
                head.method, request.path or "/", head.headers.fields)
            if found is not None:
                self.telemetry.count("exfiltration_blocked", found)
                raise leak_refusal(found, request.host)
        asked = approvals.asked_for(request, host_known=rule is not None and (
            routed.refusal is not None or rule.methods is not None or rule.paths is not None))
        reason = routed.refusal.reason if routed.refusal is not None else \
            f"rule {rule.source if rule else ''} asks before it allows"
        try:
            ended = await self.approvals.ask(identity, asked, reason, spec, request=request)
        except approvals.AskLimit as limit:
            raise _not_asked(routed.refusal or Refusal("policy_denied", reason, rule.source
                                                       if rule else None), limit) from None
        if isinstance(ended, approvals.Grant):  # (written meanwhile, for something else)
            return granted(routed, ended.source, ended.describe(), request)
        if ended.state == "approved":
            return granted(routed, f"grant:{ended.grant or ended.id}",
                           f"approved by {ended.by} ({ended.scope})", request)
        raise _unapproved(ended, spec)

    async def _ask_model(self, ex: Exchange, spec: Ask, model: str, refusal: Refusal) -> None:
        """Ask mode for a model the rule's allowlist refuses (`Exchange.request_decided`):
        a grant of it, or a person's yes, lets the exchange go on; else raises."""
        assert self.approvals is not None
        tgt, identity = ex.target, ex.identity
        request = Request(ex.head.method, tgt.scheme, tgt.host, tgt.port, tgt.path)
        grant = self.approvals.grant_for(identity.sandbox, identity.policy, request, model)
        if grant is not None:
            ex.granted(grant.source, grant.describe())
            return
        asked = approvals.Asked("model", tgt.host, tgt.port, model=model)
        try:
            ended = await self.approvals.ask(identity, asked, refusal.reason, spec,
                                             request=request, model=model)
        except approvals.AskLimit as limit:
            raise _not_asked(refusal, limit) from None
        if isinstance(ended, approvals.Grant):
            ex.granted(ended.source, ended.describe())
            return
        if ended.state != "approved":
            raise _unapproved(ended, spec)
        ex.granted(f"grant:{ended.grant or ended.id}", f"approved by {ended.by} "
                   f"({ended.scope})")

    async def _prepare(self, ex: Exchange, credential: Credential | None) -> None:
        """The credential swap and the head's leak scan (raises Refusal)."""
        head, decision, tgt = ex.head, ex.decision, ex.target
        path = tgt.path
        swap = None
        if credential is not None:
            minted = None
            if decision.rule is not None and decision.rule.allow_minted_secrets:
                minted = self._minted_finder(credential.name, ex)
            swap, path = credentials.plan(credential, head.headers, tgt, ex.identity,
                                          self.tokens.verify, _rule(decision), minted)
            if self.metering is not None:
                policy = self.policy(ex.identity)
                ex.meter(self.metering, policy, credential.preset)
                if self.approvals is not None and policy.ask is not None and \
                        policy.ask.models and policy.mode != "report":
                    ex.asks = functools.partial(self._ask_model, ex, policy.ask)
        if decision.rule is not None and decision.rule.mcp is not None:
            session = self.mcp_sessions.of(ex.identity.sandbox, tgt.host,
                                           head.headers.get("mcp-session-id") or "")
            pins = None
            if decision.rule.mcp.pin_descriptions and self.pins is not None:
                pins = ServerPins(self.pins, ex.identity, Server(
                    tgt.host, tgt.port, tgt.path.split("?", 1)[0]))
            ex.mcp(decision.rule.mcp, session,
                   report=self.policy(ex.identity).mode == "report", pins=pins)
        ex.scan = self.markers.scan_for(tgt.host, ex.client.token)
        found = ex.scan.head(head.method, path, head.headers.fields)
        if found is not None:
            raise ex.leak(found)
        signer: Signer | None = None
        if swap is not None and swap.minted is not None:  # the provider's secret for its alias
            path = credentials.apply(swap, head.headers, path, swap.minted.reveal())
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

    def _minted_finder(self, credential: str, ex: Exchange
                       ) -> Callable[[str], SecretValue | None]:
        """Finds the provider-minted secret whose alias a carrier holds: minted with
        `credential` by the exchange's sandbox; the alias of another sandbox's or
        credential's secret is refused like a key sent where it is not bound."""
        sandbox = ex.identity.sandbox

        def find(value: str) -> SecretValue | None:
            key = self.ephemeral.by_alias(value)
            if key is None:
                return None
            if key.credential != credential or key.sandbox != sandbox:
                self.telemetry.count("exfiltration_blocked", "secret")
                raise Refusal("exfiltration_blocked", "the request carries the alias of a "
                              "secret the provider minted for another sandbox or credential;"
                              " an alias works only for the sandbox it was given to, to its "
                              "credential's hosts", _rule(ex.decision))
            return key.value
        return find


def _not_asked(refusal: Refusal, limit: approvals.AskLimit) -> Refusal:
    """`refusal`, as it stands when the sandbox has too many asks waiting."""
    return Refusal(refusal.code, f"{refusal.reason}; not asked: {limit}", refusal.rule)


def _unapproved(ended: approvals.Approval, spec: Ask) -> Refusal:
    """The refusal of a request a person declined, or no one answered."""
    source, asked = f"approval:{ended.id}", ended.asked.describe()
    if ended.state == "denied":
        note = f": {ended.note}" if ended.note else ""
        return Refusal("approval_denied", f"a person ({ended.by}) declined {asked} in "
                       f"approval {ended.id}{note}; do not retry it - ask them, or change "
                       "the policy", source)
    return Refusal("approval_timeout", f"no one answered approval {ended.id} for {asked} "
                   f"within {spec.timeout:g}s; it may be asked again later, or allowed by "
                   "a policy change", source)


async def _no_resolver(host: str, port: int) -> list[str]:
    raise OSError(f"no resolver for {host}")


_AUDIT_UNAVAILABLE = ("the gateway cannot write its audit trail now and refuses new "
                      "requests until it can (audit.on_failure: refuse); retry later")
_STATE_UNAVAILABLE = ("the gateway cannot reach its state store now (revocations, budgets) "
                      "and refuses new requests until it can (state.unavailable: refuse); "
                      "retry later")


def _plain(head: RequestHead) -> bool:
    """The client shows only a text/plain body of an error (git: as "remote:" lines)."""
    return (head.headers.get("user-agent") or "").startswith("git/")


def _with_port(name: str, port: int) -> str:
    """`host` or `host:port` (a Host header) as an authority with a port."""
    if name.endswith("]") or name.count(":") == 0:
        return f"{name}:{port}"
    return name
