"""Metering's decisions, pure: which API a request calls, what it may cost at most,
whether its model is allowed, and the usage its answer reports.

``endpoints`` (which API a request calls, its model, the ``include_usage`` rewrite),
``estimate`` (a call's worst case, reserved against budgets), ``models`` (allowlist
decision), ``pricing`` and ``catalogue`` (prices and model limits, given as data),
``scan`` (bounded SSE/JSON scanners) and ``usage`` (``Meter``: what an answer reports).
The step that holds counters, budgets and the ledger is ``services/metering``.
"""

from gateway.core.metering.endpoints import classify, request_model, rewrite_request_body
from gateway.core.metering.models import (
    MODEL_BODY_LIMIT,
    ModelRefusal,
    check_model,
    model_in_body,
)
from gateway.core.metering.pricing import Pricing, PricingError
from gateway.core.metering.usage import Meter, Usage, meter_for

__all__ = [
    "MODEL_BODY_LIMIT",
    "Meter",
    "ModelRefusal",
    "Pricing",
    "PricingError",
    "Usage",
    "check_model",
    "classify",
    "meter_for",
    "model_in_body",
    "request_model",
    "rewrite_request_body",
]
