"""The policy set as the admin listener shows it (`GET /v1/policies` and the console's
sandboxes page): its revision and, per policy, what it is made of."""

from __future__ import annotations

from typing import Any

from gateway.core.policy import PolicySet

__all__ = ["describe_policies"]


def describe_policies(current: PolicySet) -> dict[str, Any]:
    """`{revision, policies: [{name, mode, source, extends, rules, credentials,
    budgets}]}`."""
    return {"revision": current.revision, "policies": [
        {"name": p.name, "mode": p.mode, "source": p.source, "extends": list(p.extends),
         "rules": len(p.rules), "credentials": list(p.credential_names),
         "budgets": [b.describe() for b in p.budgets]}
        for p in current.policies.values()
    ]}
