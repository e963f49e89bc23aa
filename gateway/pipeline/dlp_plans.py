"""What outbound credential detection (issue 43, `dlp:`) applies to a rule's requests,
made once per rule rather than once per request.

A request of a rule with `dlp:` is checked by the section its rule's `dlp:` makes of its
policy's (`core/dlp/policy.resolve`), with that section's detectors (a selection of the
gateway's scanner, `Scanner.only`) and what a finding does (the section's action, or
`report` under the policy's `mode: report`). These are the same for every request of the
rule, so a `Plan` holds them and `Plans` makes each once: a request looks its plan up
once, where it resolved the sections, selected the detectors and read the action each
time (measured in-process with callgrind: ~3,000 CPU instructions a request against
~7,500 for those steps and ~4,000 more for an exchange's check that held them all, of
the ~43,000 detection added to a 2 KB JSON request through the gateway before this).
"""

from __future__ import annotations

from gateway.core.dlp import DEFAULT, Dlp, Scanner
from gateway.core.dlp.fastscan import Gate
from gateway.core.dlp.policy import Action, resolve
from gateway.core.ports import Detectors
from gateway.core.refusal import GATEWAY_ERROR, Refusal

__all__ = ["Plan", "Plans"]

_KNOWN = 256  # pairs of sections remembered, at most (policies hold few)


class Plan:
    """One resolved `dlp:` section as its requests apply it: its detectors' `scanner`
    and their `gate` (the one pass the leak guard runs first on a body, whose answer
    detection then takes), what a finding does (`action`), and whether answers are
    scanned too (`answers: report`)."""

    __slots__ = ("action", "answers", "dlp", "gate", "scanner")

    def __init__(self, scanner: Scanner, dlp: Dlp, report: bool = False) -> None:
        self.scanner = scanner.only(dlp.detectors or DEFAULT)
        self.gate: Gate = self.scanner.prefilter.gate
        self.dlp = dlp
        self.action: Action = "report" if report else dlp.effective_action
        self.answers = dlp.reports_answers


class Plans:
    """The `Plan` of each (policy's section, rule's section, report) a request meets,
    made at the first such request and remembered by the sections' identity (holding
    them, so no other section takes their ids; a policy reloaded brings new sections,
    hence new plans)."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, bool],
                          tuple[Dlp | None, Dlp | None, Detectors | None, Plan | None]] = {}

    def of(self, policy: Dlp | None, rule: Dlp | None, report: bool,
           detectors: Detectors | None, source: str | None = None) -> Plan | None:
        """The plan for a request whose policy has section `policy` and rule `rule`
        (None: no detection on it). Raises Refusal (fail closed) where the sections ask
        for detection and the gateway has no detectors (`source`: the rule's, named)."""
        key = (id(policy), id(rule), report)
        known = self._known.get(key)
        if known is not None and known[0] is policy and known[1] is rule and \
                known[2] is detectors:
            return known[3]
        dlp = resolve(policy, rule)
        if dlp is not None and detectors is None:
            raise Refusal(GATEWAY_ERROR.code, "the rule checks requests for credentials "
                          "(dlp:), and this gateway has no detectors; refusing (fail "
                          "closed)", source)
        plan = None if dlp is None or detectors is None else \
            Plan(detectors.scanner(), dlp, report)
        if len(self._known) >= _KNOWN:
            self._known.clear()
        self._known[key] = (policy, rule, detectors, plan)
        return plan
