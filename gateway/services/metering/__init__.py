"""Inference metering over the state store: budgets, the usage ledger, the step the
pipeline calls.

What is decided from a request alone (its endpoint, model, worst case, the usage its
answer reports) is the core's (``gateway.core.metering``). Here: ``budgets`` (windows,
checks and reservations over counters), ``ledger`` (hourly totals), ``minted`` (aliases
for provider-minted secrets), ``pricing`` and ``catalogue`` (reading the files), and
``service.Metering``, the step the pipeline calls (``admit`` before forwarding,
``complete`` after the response), made of a module per part: ``exchange`` (what it hands
out), ``worst_case``, ``refusing``, ``settlement``, ``sessions``, ``deferred``, ``report``.
"""

from gateway.services.metering.budgets import BudgetBook, BudgetExceeded, window_bounds
from gateway.services.metering.pricing import load_pricing
from gateway.services.metering.service import (
    Exchange,
    Metered,
    Metering,
    MeteringRefusal,
    Refusal,
    build_metering,
    static_metering,
)

__all__ = [
    "BudgetBook",
    "BudgetExceeded",
    "Exchange",
    "Metered",
    "Metering",
    "MeteringRefusal",
    "Refusal",
    "build_metering",
    "load_pricing",
    "static_metering",
    "window_bounds",
]
