"""The audit trail as the core writes it: one line per decision, every refusal
rendered once (in the provider's error shape on a preset's host).

The gate, its exchanges and the identity checks write here; nothing else in the core
builds an audit line or an answer to a refusal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.core import credentials
from gateway.core.audit import record, traceparent
from gateway.core.client import Client
from gateway.core.dlp.verdict import SecretDetected
from gateway.core.identity import Identity
from gateway.core.policy import Decision, PolicySet
from gateway.core.ports import SILENT, Telemetry
from gateway.core.refusal import TEXT, Answer, Refusal, answer

__all__ = ["Trail", "rule_of"]

_SHAPES_CACHE = 10_000
_TOKEN_CODES = ("auth_required", "sandbox_mismatch", "unknown_sandbox", "identity_unknown",
                "identity_unavailable")


def rule_of(decision: Decision | None) -> str | None:
    """The rule an audit line names for `decision` (its source), if any."""
    return decision.rule.source if decision is not None and decision.rule is not None else None


class Trail:
    """Writes audit lines to `sink` (each a dict, see core/audit.py), stamped with the
    policy revision of `policies()`; `telemetry` is where the gate's parts count and
    `clock` what they read the time from (seconds since the epoch)."""

    def __init__(self, sink: Callable[[dict[str, Any]], None],
                 policies: Callable[[], PolicySet], telemetry: Telemetry = SILENT,
                 clock: Callable[[], float] = time.time) -> None:
        self._sink = sink
        self._policies = policies
        self.telemetry = telemetry
        self.clock = clock
        self._shapes: dict[str, str | None] = {}
        self._shapes_of: PolicySet | None = None  # the set `_shapes` was read from
        # Where a line goes with the content its policy exports (`telemetry: {content:
        # true}`): set only where an OpenTelemetry exporter takes it; None, no exchange
        # keeps content. The content never goes into the line itself.
        self.content_sink: Callable[[dict[str, Any], dict[str, str]], None] | None = None

    def audit(self, client: Client, *, decision: str, reason: str, rule: str | None,
              method: str | None = None, scheme: str | None = None, host: str | None = None,
              port: int | None = None, path: str | None = None, status: int | None = None,
              error: str | None = None, bytes_in: int | None = 0, bytes_out: int | None = 0,
              started: float | None = None, path_taken: str | None = None,
              credential: str | None = None, identity: Identity | None = None,
              usage: dict[str, Any] | None = None,
              mcp: list[dict[str, Any]] | None = None,
              models: list[str] | None = None, trace: str | None = None,
              dlp: list[dict[str, Any]] | None = None,
              content: dict[str, str] | None = None,
              trace_sent: str | None = None) -> None:
        """Write one audit line (every engine's lines go through here). A line of a
        connection the gate ended (`sweep`) names why instead of how it broke; `trace`:
        the request's `traceparent` header (checked here: core/audit.traceparent),
        `trace_sent` the one the gateway sent upstream in its place (its span:
        `telemetry.propagate`); `content`: what its policy exports beside the line
        (`content_sink`)."""
        if client.tunnel is not None:
            client.tunnel.audited = True
        if client.ended_by is not None and (error is not None or method == "CONNECT"):
            error = client.ended_by
        now = self.clock()
        line = record(
            identity=identity or client.identity, client=client.peer,
            listener=client.listener, method=method, scheme=scheme, host=host, port=port,
            path=path, decision=decision, reason=reason, rule=rule, status=status,
            error=error, bytes_in=bytes_in, bytes_out=bytes_out,
            started=now if started is None else started, path_taken=path_taken,
            engine=client.engine, credential=credential, usage=usage,
            policy_rev=self._policies().revision, now=now, mcp=mcp, models=models,
            trace=traceparent(trace), dlp=dlp or None, trace_sent=trace_sent)
        if content and self.content_sink is not None:
            self.content_sink(line, content)
        else:
            self._sink(line)

    def refuse(self, client: Client, refusal: Refusal, *, method: str | None = None,
               scheme: str | None = None, host: str | None = None, port: int | None = None,
               path: str | None = None, started: float | None = None,
               close: bool = False, usage: dict[str, Any] | None = None,
               plain: bool = False, mcp: list[dict[str, Any]] | None = None,
               models: list[str] | None = None, trace: str | None = None,
               dlp: list[dict[str, Any]] | None = None,
               content: dict[str, str] | None = None,
               trace_sent: str | None = None) -> Answer:
        """Audit a refusal and render it (in the provider's shape on a preset's host,
        for a request; as text with `plain`); ``usage``: what a metered exchange refused
        part-way had used."""
        answered = self.render(refusal, host if method is not None else None, close=close,
                               plain=plain)  # (its status: a provider's shape may differ)
        if dlp is None and isinstance(refusal, SecretDetected):
            dlp = refusal.found
        self.audit(client, decision="deny", reason=refusal.reason, rule=refusal.rule,
                   method=method, scheme=scheme, host=host, port=port, path=path,
                   status=answered.status, error=refusal.code, started=started,
                   credential=refusal.credential, usage=usage, identity=refusal.identity,
                   mcp=mcp, models=models, trace=trace, dlp=dlp, content=content,
                   trace_sent=trace_sent)
        if refusal.code.startswith("token_") or refusal.code in _TOKEN_CODES:
            self.telemetry.count("tokens_refused", refusal.code)
        # Audited: its traceback is of no more use. Kept, it would hold the frames that
        # raised it, one of which usually holds the refusal itself (a decision's, a
        # stage's): a reference cycle for every refusal, freed only by a collection.
        refusal.__traceback__ = None
        return answered

    def render(self, refusal: Refusal, host: str | None, *, close: bool = True,
               plain: bool = False) -> Answer:
        """The answer to `refusal` (audited elsewhere) for a request to `host`: the
        provider's error shape on a preset's host, text for a client that shows only
        text (`plain`: git), else the gateway's JSON."""
        return answer(refusal, shape=TEXT if plain else self.shape(host), close=close)

    def shape(self, host: str | None) -> str | None:
        """The error-body family of the provider whose preset binds `host`, if any."""
        if host is None:
            return None
        policy_set = self._policies()
        if policy_set is not self._shapes_of:  # (a reload may add or drop a preset)
            self._shapes.clear()
            self._shapes_of = policy_set
        found = self._shapes.get(host, "?")
        if found == "?":
            found = next((credentials.shape_of(c.preset or c.kind) for c in
                          policy_set.credentials.values()
                          if (c.preset or c.mint) and c.binds(host)), None)
            if len(self._shapes) > _SHAPES_CACHE:
                self._shapes.clear()
            self._shapes[host] = found
        return found
