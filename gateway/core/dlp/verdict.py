"""What a scan decides under a request's `dlp:` section (pure): which findings count on
this host, the refusal `403 secret_detected` (naming the detector and where, never the
value, and what to change), and the audit line's `dlp` records.

The proxy's exchange (`pipeline/exchange_dlp.py`) and `body_stage.dlp_stage` (explain,
`policy test`) both decide through here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.core.dlp.findings import Finding
from gateway.core.dlp.policy import Action, Dlp
from gateway.core.refusal import Refusal

__all__ = ["SecretDetected", "counted", "records", "refusal", "unreadable"]

_NAMED = 3  # findings a reason names (the audit line has them all)


class SecretDetected(Refusal):
    """`403 secret_detected`, carrying the audit line's `dlp` records."""

    def __init__(self, reason: str, rule: str | None,
                 found: list[dict[str, Any]]) -> None:
        super().__init__("secret_detected", reason, rule)
        self.found = found


def counted(dlp: Dlp, findings: Iterable[Finding], host: str) -> tuple[Finding, ...]:
    """The findings that count on a request to `host` (selected, not allowed there)."""
    return tuple(f for f in findings if dlp.applies(f, host))


def records(findings: Iterable[Finding], action: Action) -> list[dict[str, Any]]:
    """The audit line's `dlp` entries: detector, where, salted fingerprint, action."""
    return [{"detector": f.detector, "where": str(f.location), "fingerprint": f.fingerprint,
             "action": action} for f in findings]


def refusal(findings: tuple[Finding, ...], host: str, rule: str | None,
            found: list[dict[str, Any]], why: str = "") -> SecretDetected:
    """The refusal of a request carrying `findings` to `host` (``why``: said after,
    e.g. that a redaction could not rewrite the value)."""
    named = "; ".join(f"{f.detector} in {f.location}" for f in findings[:_NAMED])
    if len(findings) > _NAMED:
        named += f"; and {len(findings) - _NAMED} more"
    first = findings[0].detector
    return SecretDetected(
        f"the request to {host} carries a credential the gateway did not issue ({named})"
        f"{why}; if it should go to {host}, add {{detector: {first}, hosts: [{host}]}} to "
        f"the rule's dlp.allow, or leave {first} out of its dlp.detectors", rule, found)


def unreadable(why: str, host: str, rule: str | None) -> SecretDetected:
    """The refusal of a body the scan cannot read (fail closed where dlp applies)."""
    return SecretDetected(
        f"the request to {host} cannot be checked for credentials (dlp): {why}; send the "
        "body uncompressed or with gzip, deflate or br, within the hold limit, or turn "
        "detection off for this rule (dlp: false)", rule, [])
