"""Stage 3, the body stage: what a request's method and body decide on what stage 1
allowed (pure). One function per step, and every caller calls them: the proxy's exchange
(`pipeline/exchange.py`, as the head and the body arrive) and `evaluate.meter` (explain,
`policy test`, replay, the console).

- `mcp_stage`: an ``mcp:`` rule's method and JSON-RPC calls (`core/mcp.py`);
- `metering_stage`: the metering step (the ``Metering`` port): model allowlists, what
  cannot be metered, budgets;
- `dlp_stage`: outbound credential detection on a rule where ``dlp:`` applies (the
  ``Detectors`` port), on the request line and a body held whole, for callers without
  traffic (the proxy's exchange runs the same scan and verdict on every part as it
  arrives, headers and streamed bodies too: `pipeline/exchange_dlp.py`).

Under ``mode: report`` (and ``learn``) a refusal is recorded, not enforced
(`Stage.report`): the request goes on, and its audit line (or verdict) says ``report``
with the refusal's own reason and rule, as stage 1's report decisions do (`report_of`).
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, replace

from gateway.core import mcp
from gateway.core.dlp.catalogue import DEFAULT
from gateway.core.dlp.policy import resolve
from gateway.core.dlp.verdict import counted, records, refusal, unreadable
from gateway.core.git_pack import PUSH_TYPE, is_push_path
from gateway.core.mcp import Call
from gateway.core.metering.models import ModelRefusal
from gateway.core.metering.refusals import STEP_REFUSALS
from gateway.core.metering.refusals import refusal as step_refusal
from gateway.core.policy import Policy, Rule
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.policy.model import records_only
from gateway.core.ports import Detectors, MeteredCall, Metering
from gateway.core.refusal import Refusal

__all__ = ["NO_CALLS", "Stage", "askable_model", "dlp_stage", "mcp_stage", "metering_stage"]

NO_CALLS = ({"method": None, "name": None, "decision": "deny"},)
"""The audit line's ``mcp`` for a body refused before any call was read."""


@dataclass(frozen=True, slots=True)
class Stage:
    """A step's answer: ``refusal`` None passes; ``report`` the refusal is only recorded
    (``mode: report``); ``calls`` the MCP calls read (the audit line's ``mcp``);
    ``admitted`` the metering step's admission; ``ask`` a model a person may allow (the
    allowlist refused it, ask mode may hold the request for it)."""

    refusal: Refusal | None = None
    report: bool = False
    calls: tuple[Call, ...] = ()
    admitted: MeteredCall | None = None
    ask: str | None = None

    @property
    def enforced(self) -> Refusal | None:
        """The refusal to answer (None: passes, or only recorded)."""
        return None if self.report else self.refusal


PASS = Stage()


def mcp_stage(rule: McpRule, mode: str, method: str, body: bytes | object | None,
              changed: Container[str], source: str | None) -> Stage:
    """An ``mcp:`` rule's decision on a request: its method (no MCP transport uses PUT),
    a body on a GET or DELETE (never read: refused), and a POST's JSON-RPC calls, decided
    on the whole body (`mcp.judge`; None: not held, refused). ``body`` neither bytes nor
    None (``evaluate.UNSEEN``): the method alone. ``changed``: the tools quarantined
    (their description changed: refused with ``pin_descriptions``)."""
    why = mcp.method_refusal(method)
    if why is None and isinstance(body, bytes):
        why = mcp.body_refusal(method, body)
    if why is not None:
        return Stage(Refusal("mcp_denied", why, source, rpc=([], False)), records_only(mode))
    if method != "POST" or not (body is None or isinstance(body, bytes)):
        return PASS
    found, refusal = mcp.judge(rule, body, changed, source)
    return Stage(refusal, refusal is not None and records_only(mode), tuple(found))


def metering_stage(metering: Metering, policy: Policy, rule: Rule, *, sandbox: str,
                   preset: str | None, method: str, path: str, body: bytes | None,
                   now: float, granted: str | None = None) -> Stage:
    """The metering step on a credential request (``body`` None: not held). ``granted``:
    a model a person allowed besides the rule's own (ask mode)."""
    if granted is not None and rule.models is not None:
        rule = replace(rule, models=(*rule.models, granted))
    step = metering.admit(sandbox=sandbox, policy=policy, rule=rule, preset=preset,
                          method=method, path=path, body=body, now=now)
    if not isinstance(step, STEP_REFUSALS):
        return Stage(admitted=step)
    ask = (step.model if isinstance(step, ModelRefusal) and granted is None
           and askable_model(step.model) else None)
    return Stage(step_refusal(step), records_only(policy.mode), ask=ask)


def dlp_stage(detectors: Detectors, policy: Policy, rule: Rule, *, host: str, method: str,
              target: str, body: bytes | object | None) -> Stage:
    """Outbound credential detection on a request without its headers: the request
    line, and ``body`` if it is bytes (held whole, as sent: content-coded bodies are
    given decoded by these callers). ``refuse`` refuses (``report`` under ``mode:
    report``); ``redact`` and ``report`` pass, as the proxy forwards them."""
    dlp = resolve(policy.dlp, rule.dlp)
    if dlp is None or rule.protocol != "http":
        return PASS
    scanner = detectors.scanner().only(dlp.detectors or DEFAULT)
    # (git's push path: its body read as a push, whatever type it has, as the proxy does)
    typed = [("Content-Type", PUSH_TYPE)] if is_push_path(target) else []
    result = scanner.scan_request(method, target, typed,
                                  body if isinstance(body, bytes) else b"")
    if result.unreadable is not None:
        return Stage(unreadable(result.unreadable, host, rule.source),
                     policy.mode == "report")
    found = counted(dlp, result.findings, host)
    if not found or dlp.effective_action != "refuse":
        return PASS
    return Stage(refusal(found, host, rule.source, records(found, "refuse")),
                 policy.mode == "report")


def askable_model(model: str | None) -> bool:
    """A model name a person may be asked about: named, and no glob (a grant adds it to
    the allowlist, where `*` would allow more than was asked)."""
    return bool(model) and not any(c in str(model) for c in "*?[]")
