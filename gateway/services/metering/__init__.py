"""Inference metering: usage read from responses, model allowlists, budgets, totals.

Pure parts (no I/O): ``endpoints`` (which API a request calls, its model, the
``include_usage`` rewrite), ``scan`` (bounded SSE/JSON scanners), ``usage`` (``Meter``),
``models`` (allowlist decision), ``estimate`` (a call's worst case, reserved against
budgets), ``budgets`` (windows, checks and reservations over counters), ``pricing``.
``ledger`` keeps hourly totals; ``service.Metering`` is the step the enforcement core
calls (``admit`` before forwarding, ``complete`` after the response).
"""

from gateway.services.metering.budgets import BudgetBook, BudgetExceeded, window_bounds
from gateway.services.metering.endpoints import classify, request_model, rewrite_request_body
from gateway.services.metering.models import (
    MODEL_BODY_LIMIT,
    ModelRefusal,
    check_model,
    model_in_body,
)
from gateway.services.metering.pricing import Pricing, PricingError, load_pricing
from gateway.services.metering.service import (
    RESPONSE_HOLD,
    Exchange,
    Metered,
    Metering,
    MeteringRefusal,
    Refusal,
    build_metering,
)
from gateway.services.metering.usage import Meter, Usage, meter_for

__all__ = [
    "MODEL_BODY_LIMIT",
    "RESPONSE_HOLD",
    "BudgetBook",
    "BudgetExceeded",
    "Exchange",
    "Meter",
    "Metered",
    "Metering",
    "MeteringRefusal",
    "ModelRefusal",
    "Pricing",
    "PricingError",
    "Refusal",
    "Usage",
    "build_metering",
    "check_model",
    "classify",
    "load_pricing",
    "meter_for",
    "model_in_body",
    "request_model",
    "rewrite_request_body",
    "window_bounds",
]
