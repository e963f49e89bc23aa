"""Warnings about policies that load but do not do what their author likely meant
(printed by ``policy check``; a warning never stops a policy from loading)."""

from __future__ import annotations

from gateway.core.policy.compiled import Policy

__all__ = ["outranked_credentials"]

SERVICE = "service/"


def outranked_credentials(policy: Policy) -> list[str]:
    """Host-wide credential rules outranked by a service preset's keyless rules naming
    paths on the same host: for one host pattern rules with ``paths`` are tried first and
    a later host-wide credential rule does not override them (docs/policies.md, "Which
    rule decides"), so on those paths the key is never injected and a client sending its
    token there is refused ``exfiltration_blocked``."""
    found: list[str] = []
    for rule in policy.rules:
        if rule.credential is None or rule.paths is not None or rule.denies:
            continue
        presets = sorted({r.policy for r in policy.rules
                          if r.policy.startswith(SERVICE) and r.credential is None
                          and not r.denies and r.paths is not None and r.host == rule.host})
        if presets:
            found.append(
                f"{rule.source}: warning: credential {rule.credential!r} on {rule.host} is "
                f"host-wide, and the keyless rules of {', '.join(presets)} name paths on the "
                "same host, so they are tried first: on their paths the key is never "
                "injected (a token sent there is refused exfiltration_blocked); list the "
                "paths the credential is for in this rule")
    return found
