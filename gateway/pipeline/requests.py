"""Request admission: one request, in a tunnel or as a plain proxy request, from its head
to the `Exchange` that serves it (or the answer that refuses it).

    identify (again) → target → health → upgrade → stage 1 (`Asking.decide`)
      → destination (pinned once per connection) → the exchange's steps: metering,
        MCP, the head's leak scan, credential detection (`dlp:`) → an MCP server's
        OAuth token (`OAuthing`, a rule with `mcp.oauth`) → the credential (`Signing`)

The body stage - metering, MCP calls, the leak scan of the body - runs in the exchange
(`pipeline/exchange.py`) as the body arrives.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable

from gateway.core import credentials, local_api, target
from gateway.core.audit import child_traceparent, traceparent
from gateway.core.client import Client
from gateway.core.dlp import DEFAULT
from gateway.core.evaluate import Routed
from gateway.core.identity import Identity
from gateway.core.local_api import INTERNAL_HOST
from gateway.core.mcp_pins import Server, ServerPins
from gateway.core.messages import RequestHead
from gateway.core.policy import Credential, Request
from gateway.core.policy.hosts import HostPattern
from gateway.core.policy.model import records_only
from gateway.core.refusal import GATEWAY_ERROR, Answer, Refusal
from gateway.core.trail import rule_of
from gateway.core.unpack_bounds import charge_to
from gateway.pipeline.asking import Asking
from gateway.pipeline.dlp_plans import Plans
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.exchange_content import ContentCapture
from gateway.pipeline.exchange_dlp import DlpCheck
from gateway.pipeline.oauthing import OAuthing
from gateway.pipeline.parts import Parts
from gateway.pipeline.signing import Signing
from gateway.pipeline.tunnels import plain_client

log = logging.getLogger("sandbox_gateway")

__all__ = ["Requests"]


class Requests:
    """Admits requests (see the module docstring)."""

    def __init__(self, parts: Parts, asking: Asking, signing: Signing) -> None:
        self.parts = parts
        self.asking = asking
        self.signing = signing
        self.oauthing = OAuthing(parts)
        self.plans = Plans()  # (each rule's detection, `dlp:`: made once)

    async def begin(self, client: Client, head: RequestHead, *, tls: bool,
                    proxy_authorization: str | None = None) -> Exchange | Answer:
        """Admit one request. In a tunnel the connection's identity is checked again; a
        plain proxy request (no tunnel) identifies with its own `proxy_authorization`.
        Returns the exchange to serve, or the answer to send (a refusal, audited, or
        the sandbox-facing API's)."""
        parts = self.parts
        started = parts.trail.clock()
        tunnel = client.tunnel
        tgt: target.Target | None = None
        try:
            head.headers.remove("proxy-authorization")
            if tunnel is None:
                parts.identities.identify(client, proxy_authorization)
            identity = parts.identities.recheck(client, head)
            tgt = target.request_target(
                head, (tunnel.host, tunnel.port) if tunnel is not None else None, tls=tls)
            parts.check_health()
            upgrade = head.headers.get("upgrade")
            if upgrade is not None and upgrade.strip().lower() != "websocket":
                raise Refusal("unsupported", f"upgrade to {upgrade[:40]!r} is not supported "
                              "through the gateway; only WebSocket upgrades are relayed")
            routed = await self.asking.decide(client, identity, Request(
                head.method, tgt.scheme, tgt.host, tgt.port, tgt.path), head)
            if tgt.host == INTERNAL_HOST:
                return self._local(client, head, tgt, routed, started)
            pinned = (tunnel.pinned if tunnel is not None and tunnel.pinned is not None
                      else await parts.destination(client, tgt.host, tgt.port))
            exchange = Exchange(parts.trail, parts.secrets, client, identity, head, tgt,
                                routed.decision, pinned, started)
            exchange.excess = parts.unpacking.for_sandbox(identity.sandbox)
            charge_to(exchange.excess)  # (the head's compressed runs: `unpacking`)
            try:
                await self._prepare(exchange, routed.credential)
            finally:
                charge_to(None)
            return exchange
        except Exception as exc:
            refusal = exc if isinstance(exc, Refusal) else GATEWAY_ERROR
            if refusal is GATEWAY_ERROR:
                log.exception("the gate failed while deciding; refusing (fail closed)")
            return parts.trail.refuse(
                client, refusal, method=head.method,
                scheme=tgt.scheme if tgt else ("https" if tls else "http"),
                host=tgt.host if tgt else (tunnel.host if tunnel else None),
                port=tgt.port if tgt else (tunnel.port if tunnel else None),
                path=tgt.path if tgt else None, started=started,
                close=refusal.code in ("bad_request", "gateway_error"),
                plain=plain_client(head), trace=head.headers.get("traceparent"))

    def _local(self, client: Client, head: RequestHead, tgt: target.Target, routed: Routed,
               started: float) -> Answer:
        """The sandbox-facing API's answer (token refresh...), audited."""
        parts, decision = self.parts, routed.decision
        answered = local_api.serve(client, head, tgt, parts.tokens, parts.telemetry)
        parts.trail.audit(client, decision=decision.result, reason=decision.reason,
                          rule=rule_of(decision), method=head.method, scheme=tgt.scheme,
                          host=tgt.host, port=tgt.port, path=tgt.path, status=200,
                          bytes_in=len(answered.body), started=started, path_taken="local",
                          trace=head.headers.get("traceparent"))
        return answered

    async def _prepare(self, ex: Exchange, credential: Credential | None) -> None:
        """The exchange's steps (metering, MCP), the head's leak scan, then the
        credential swap (raises Refusal)."""
        parts = self.parts
        head, decision, tgt = ex.head, ex.decision, ex.target
        path = tgt.path
        swap = None
        if credential is not None:
            minted = None
            if decision.rule is not None and decision.rule.allow_minted_secrets:
                minted = self.signing.minted_finder(credential.name, ex)
            swap, path = credentials.plan(credential, head.headers, tgt, ex.identity,
                                          self._verifier(ex), rule_of(decision), minted)
            self._meter(ex, credential)
        if decision.rule is not None and decision.rule.mcp is not None:
            session = parts.mcp_sessions.of(ex.identity.sandbox, tgt.host,
                                            head.headers.get("mcp-session-id") or "")
            pins = None
            if decision.rule.mcp.pin_descriptions and parts.pins is not None:
                pins = ServerPins(parts.pins, ex.identity, Server(
                    tgt.host, tgt.port, tgt.path.split("?", 1)[0]))
            ex.mcp(decision.rule.mcp, session,
                   report=records_only(parts.policy(ex.identity).mode), pins=pins)
        ex.scan = parts.markers.scan_for(tgt.host, ex.client.token)
        found = ex.scan.head(head.method, path, head.headers.fields)
        if found is not None:
            raise ex.leak(found)
        path = self._detect(ex, path)
        mcp_rule = decision.rule.mcp if decision.rule is not None else None
        if mcp_rule is not None and mcp_rule.oauth is not None:
            await self.oauthing.attach(ex, mcp_rule.oauth)
        if parts.trail.content_sink is not None and parts.policy(ex.identity).telemetry_content:
            ex.content = ContentCapture(ex.dlp.scanner if ex.dlp is not None else
                                        parts.detectors.scanner().only(DEFAULT)
                                        if parts.detectors is not None else None)
        await self.signing.apply(ex, swap, path)
        if parts.propagate:
            _propagate(ex, parts.propagate)

    def _verifier(self, ex: Exchange) -> Callable[[str], Identity]:
        """`TokenService.verify` for the token in a credential carrier; the connection's
        own token (the usual carrier: the sandbox's key variable holds it) was verified
        for this request by `recheck` a moment ago, and is answered with that identity
        instead of a second verification (expiry, revocation, policy) of the same token."""
        verify = self.parts.tokens.verify
        client = ex.client
        checked = client.token if not client.registered and not ex.identity.keyless else None
        if checked is None:
            return verify
        identity = ex.identity
        return lambda token: identity if token == checked else verify(token)

    def _detect(self, ex: Exchange, path: str) -> str:
        """Outbound credential detection on a rule where `dlp:` applies (its own over
        its policy's): set up for the body, the head scanned now, after the leak scan
        and with the credential carrier emptied. Returns the path to send."""
        rule = ex.decision.rule
        if rule is None or rule.protocol != "http":
            return path
        policy = self.parts.policy(ex.identity)
        if policy.dlp is None and rule.dlp is None:
            return path
        plan = self.plans.of(policy.dlp, rule.dlp, policy.mode == "report",
                             self.parts.detectors, rule.source)
        if plan is None:
            return path
        ex.dlp = DlpCheck(plan, ex.target.host, rule.source, ex.trail.telemetry,
                          ex.client.engine, ex.identity.sandbox)
        return ex.dlp.head(ex.head.method, path, ex.head.headers)

    def _meter(self, ex: Exchange, credential: Credential) -> None:
        """The metering step for a credential exchange, and ask mode for the models its
        allowlist refuses where the policy lets a person allow them."""
        parts = self.parts
        if parts.metering is None:
            return
        policy = parts.policy(ex.identity)
        ex.meter(parts.metering, policy, credential.preset)
        if parts.approvals is not None and policy.ask is not None and \
                policy.ask.models and not records_only(policy.mode):
            ex.asks = functools.partial(self.asking.ask_model, ex.me, policy.ask)


def _propagate(ex: Exchange, hosts: tuple[HostPattern, ...]) -> None:
    """`telemetry.propagate`: a request to one of `hosts` leaves with the gateway's span
    as its `traceparent` (in the sandbox's trace when it sent a valid one, else a new
    trace); its span is exported with those ids (the audit line's `trace_sent`).
    `tracestate` and other headers go as the sandbox sent them."""
    host = ex.target.host
    if not any(pattern.matches(host) for pattern in hosts):
        return
    headers = ex.head.headers
    arrived = headers.get("traceparent")
    sent = child_traceparent(traceparent(arrived), secrets.token_hex(16),
                             secrets.token_hex(8))
    headers.set("traceparent", sent)
    ex.trace_arrived, ex.trace_sent = arrived, sent
