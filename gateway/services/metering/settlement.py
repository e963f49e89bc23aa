"""After a metered call: its hold settled to what it used (or to its reservation when its
usage never arrived), and its usage counted in the ledger and the gateway's metrics."""

from __future__ import annotations

import logging

from gateway.core.metering.usage import Usage
from gateway.core.ports import Telemetry
from gateway.services.metering.budgets import NANO, BudgetBook, Hold
from gateway.services.metering.exchange import Exchange, Metered
from gateway.services.metering.ledger import UsageLedger

__all__ = ["Settlement"]

log = logging.getLogger("sandbox_gateway.metering")


def _status_label(status: int) -> str:
    return str(status) if 100 <= status <= 599 else "error"


class Settlement:
    """Settling holds and counting usage, over the step's budgets, ledger and telemetry."""

    def __init__(self, budgets: BudgetBook, ledger: UsageLedger, telemetry: Telemetry) -> None:
        self.budgets = budgets
        self.ledger = ledger
        self.telemetry = telemetry
        self._unread_logged: set[tuple[str, str]] = set()

    def settle(self, exchange: Exchange, hold: Hold, usage: Usage, *, sent: bool,
               status: int, cost: float | None = None) -> Metered:
        """Settle ``hold`` to what the call used: its usage, else (a call that reached the
        provider and got a success or no answer at all) its reservation."""
        reserved = hold.reserved
        basis = "usage"
        if usage.known:
            if cost is None and any(b.cost_usd is not None for b in exchange.policy.budgets):
                cost = self.budgets.cost(usage)
            tokens, nano = usage.tokens, round((cost or 0.0) * NANO)
        elif sent and (status in (0, 101) or 200 <= status < 300):  # (101: a session)
            tokens, nano, basis = reserved.tokens, reserved.nano_usd, "reservation"
            self.unread(exchange)
        else:
            tokens = nano = 0  # the provider refused it (4xx/5xx): nothing was used
        self.budgets.settle(hold, tokens, nano)
        return Metered(usage, cost, reserved.tokens, tokens, basis)

    def unread(self, exchange: Exchange) -> None:
        key = (exchange.policy.name, exchange.credential)
        self.telemetry.count("reservations_charged", *key)
        if key not in self._unread_logged and len(self._unread_logged) < 1000:
            self._unread_logged.add(key)
            log.warning("metering: a call on credential %r (policy %r) ended without usage "
                        "the gateway could read; budgets count its reservation (logged once)",
                        exchange.credential, exchange.policy.name)

    def count(self, exchange: Exchange, model: str, usage: Usage, cost: float | None,
              status: int, now: float) -> None:
        policy, credential = exchange.policy, exchange.credential
        self.ledger.record(exchange.sandbox, policy.name, credential, model, usage, cost, now)
        key = (policy.name, credential, model)
        self.telemetry.count("inference_requests", *key, _status_label(status))
        for kind, value in (("input", usage.input_tokens), ("output", usage.output_tokens),
                            ("cached", usage.cached_input_tokens)):
            if value:
                self.telemetry.count("inference_tokens", *key, kind, by=value)
