"""The worst case of a call on a budgeted rule: the most input and output tokens it may
be billed (``core/metering/estimate``'s bounds), read against the model's context window
and output limit (the operator's pricing file over the catalogue), or why it has none:
what to change."""

from __future__ import annotations

from typing import Any

from gateway.core.metering.endpoints import Endpoint
from gateway.core.metering.estimate import Unreadable, choices, input_bound, output_bound
from gateway.core.metering.pricing import Pricing
from gateway.core.policy.model import Rule
from gateway.services.metering.catalogue import catalogue

__all__ = ["WorstCase"]


class WorstCase:
    """A call's bound in tokens, over ``pricing`` (None: the catalogue alone)."""

    def __init__(self, pricing: Pricing | None) -> None:
        self.pricing = pricing
        self._limits: Pricing | None = None

    @property
    def limits(self) -> Pricing:
        """Where models' context windows and output limits are read: the operator's
        pricing file over the catalogue (loaded at the first call that needs it)."""
        if self._limits is None:
            self._limits = self.pricing if self.pricing is not None and \
                self.pricing.fallback is not None else Pricing(
                    self.pricing.entries if self.pricing is not None else {},
                    self.pricing.source if self.pricing is not None else "<none>",
                    catalogue())
        return self._limits

    def bound(self, rule: Rule, endpoint: Endpoint, model: str | None, path: str,
              raw: bytes, data: dict[str, Any] | None) -> tuple[int, int] | str:
        """The most ``(input, output)`` tokens a call may be billed (``estimate``), or
        why it has no bound: what to change."""
        limits = self.limits.limits(model)
        metering = rule.metering
        context = limits.context if limits is not None and limits.context else (
            metering.max_input_tokens if metering is not None else None)
        where = self.limits.fallback.source if self.limits.fallback else "the catalogue"
        known = (f'model "{(model or "unknown")[:100]}"' +
                 (f" ({limits.source})" if limits is not None else f" (not in {where})"))
        try:
            out = output_bound(endpoint, data, path, limits.max_output if limits else None)
            fed = input_bound(raw, data, context)
        except Unreadable as exc:
            return (f"{exc}, so the call's worst case cannot be read; send it as a whole "
                    "number")
        if out is None:
            reserve = metering.reserve if metering is not None else None
            if reserve is None:
                return (f"the call names no output limit and the maximum output of {known} "
                        f"is unknown; send max_tokens (or max_output_tokens), or set "
                        f"metering.reserve on rule {rule.source}, or max_output_tokens for "
                        "the model in metering.pricing")
            out = reserve * choices(data)
        if fed.tokens is None:
            return (f"{fed.why}, and the context window of {known} is unknown, so its "
                    f"input has no bound; set metering.max_input_tokens on rule "
                    f"{rule.source}, or context_window for the model in metering.pricing")
        return fed.tokens, out
