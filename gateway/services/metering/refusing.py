"""The metering step's own refusals, counted in the gateway's metrics: what cannot be
metered on a rule that must be (``metering_unavailable``, saying why it must be: a token
or cost budget, or ``metering: required``) and the others (``minted_secret_refused``)."""

from __future__ import annotations

from gateway.core.metering.refusals import MeteringRefusal
from gateway.core.policy.compiled import Policy
from gateway.core.policy.model import Rule
from gateway.core.ports import Telemetry
from gateway.services.metering.budgets import BudgetBook

__all__ = ["Refusals"]


class Refusals:
    """Refusals of the step, over its budgets and telemetry."""

    def __init__(self, budgets: BudgetBook, telemetry: Telemetry) -> None:
        self.budgets = budgets
        self.telemetry = telemetry

    def refuse(self, policy: Policy, rule: Rule, code: str, reason: str) -> MeteringRefusal:
        self.telemetry.count("metering_refusals", policy.name, code)
        return MeteringRefusal(code, reason, rule.source)

    def unavailable(self, policy: Policy, rule: Rule, why: str) -> MeteringRefusal:
        budgeted = rule.credential is not None and self.budgets.limits_usage(
            policy, rule.credential)
        because = (f"policy {policy.name!r} has a token or cost budget for credential "
                   f"{rule.credential!r}" if budgeted else
                   f"rule {rule.source} sets metering: required")
        return self.refuse(policy, rule, "metering_unavailable",
                            f"this call cannot be metered: {why}; every inference call "
                            f"must be metered here because {because}")
