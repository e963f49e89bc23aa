"""A policy's and a rule's `dlp:` section, and what it decides for one finding.

    dlp:
      action: refuse          # refuse | redact | report
      detectors: [default, keyword]
      allow:
        - {detector: pypi, hosts: [upload.pypi.org]}
      answers: report         # report | off (default): flag credentials in answers too

A policy's section applies to every rule; a rule's section overrides the action, the
detectors and `answers` it names and adds its `allow` entries to the policy's
(`resolve`). Answers from upstreams are never refused or rewritten for what they hold
(issue 43: directional); `answers: report` records what the detectors find in them. `default`
in `detectors` stands for the detectors on by default (`catalogue.DEFAULT`). `dlp: false`
on a rule turns detection off for that rule. The reader is
`gateway/services/policy/read_dlp.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gateway.core.dlp.catalogue import DEFAULT
from gateway.core.dlp.findings import Finding

if TYPE_CHECKING:  # (the policy model imports this module: no cycle at run time)
    from gateway.core.policy.hosts import HostPattern

__all__ = ["ACTIONS", "Action", "Dlp", "DlpAllow", "resolve"]

Action = Literal["refuse", "redact", "report"]
ACTIONS: tuple[Action, ...] = ("refuse", "redact", "report")


@dataclass(frozen=True)
class DlpAllow:
    """A detector whose findings may go to some hosts (a registry token to its
    registry)."""

    detector: str
    hosts: tuple[HostPattern, ...]

    def allows(self, detector: str, host: str) -> bool:
        return detector == self.detector and any(p.matches(host) for p in self.hosts)


@dataclass(frozen=True)
class Dlp:
    """One `dlp:` section; None fields are not set (a rule's section inherits them)."""

    action: Action | None = None
    detectors: tuple[str, ...] | None = None
    allow: tuple[DlpAllow, ...] = ()
    enabled: bool = True
    answers: bool | None = None  # `answers: report` (True) or `off`; None: not set

    def applies(self, finding: Finding, host: str) -> bool:
        """Whether a finding counts on a request to `host` (its detector selected and
        not allowed there)."""
        return (self.enabled and finding.detector in (self.detectors or DEFAULT)
                and not any(a.allows(finding.detector, host) for a in self.allow))

    @property
    def effective_action(self) -> Action:
        return self.action or "refuse"

    @property
    def reports_answers(self) -> bool:
        """Whether answers are scanned and their findings reported (`answers: report`)."""
        return bool(self.answers)


_RESOLVED: dict[tuple[int, int], tuple[Dlp | None, Dlp | None, Dlp | None]] = {}


def resolve(policy: Dlp | None, rule: Dlp | None) -> Dlp | None:
    """The section a request's rule applies: the rule's over the policy's (None: no DLP
    on this request). Once per pair of sections (every request of a rule asks again):
    remembered by their identity, holding them so that no other pair takes their ids."""
    key = (id(policy), id(rule))
    known = _RESOLVED.get(key)
    if known is not None and known[0] is policy and known[1] is rule:
        return known[2]
    found = _resolve(policy, rule)
    if len(_RESOLVED) >= 256:
        _RESOLVED.clear()
    _RESOLVED[key] = (policy, rule, found)
    return found


def _resolve(policy: Dlp | None, rule: Dlp | None) -> Dlp | None:
    if rule is not None and not rule.enabled:
        return None
    if policy is None and rule is None:
        return None
    base = policy or Dlp()
    if rule is None:
        return base if base.enabled else None
    return Dlp(action=rule.action or base.action, detectors=rule.detectors or base.detectors,
               allow=(*base.allow, *rule.allow),
               answers=rule.answers if rule.answers is not None else base.answers)
