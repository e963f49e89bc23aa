"""Operator-supplied token prices, for ``cost_usd`` budgets and reported costs.

No price list is shipped: it would go stale. The file named by ``metering.pricing`` is
YAML, model glob to USD per million tokens, first matching glob in file order wins::

    gpt-4o-mini*:      {input: 0.15, output: 0.60, cached_input: 0.075}
    claude-sonnet-4*:  {input: 3.00, output: 15.00, cached_input: 0.30}
    "*":               {input: 1.00, output: 1.00}     # optional catch-all

Globs are ``fnmatch.fnmatchcase`` (case-sensitive, like ``models:``). ``cached_input``
defaults to ``input``. Cost = (input - cached) x input + cached x cached_input +
output x output, per million. Anthropic cache writes are priced as input.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from gateway.services.metering.usage import Usage

__all__ = ["Price", "Pricing", "PricingError", "load_pricing", "parse_pricing"]

_KEYS = ("input", "output", "cached_input")


class PricingError(ValueError):
    """The pricing file is unreadable or wrong; the message names the entry."""


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens."""

    input: float
    output: float
    cached_input: float


class Pricing:
    """Prices by model glob; ``cost(usage)`` in USD, None when no glob matches."""

    def __init__(self, prices: Mapping[str, Price], source: str = "<memory>") -> None:
        self.prices = dict(prices)
        self.source = source
        self._cache: dict[str, Price | None] = {}

    def price(self, model: str | None) -> Price | None:
        """The price of ``model`` (first matching glob), or None."""
        if model is None:
            return None
        if model in self._cache:
            return self._cache[model]
        found = next((p for glob, p in self.prices.items() if fnmatchcase(model, glob)), None)
        if len(self._cache) < 4096:
            self._cache[model] = found
        return found

    def cost(self, usage: Usage) -> float | None:
        """USD for ``usage``; None if the model has no price or no counts are known."""
        price = self.price(usage.model)
        if price is None or not usage.known:
            return None
        total_in = usage.input_tokens or 0
        cached = min(usage.cached_input_tokens or 0, total_in)
        micro = ((total_in - cached) * price.input + cached * price.cached_input
                 + (usage.output_tokens or 0) * price.output)
        return micro / 1_000_000


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value < 0:
        raise PricingError(f"{where}: expected a non-negative number (USD per million "
                           f"tokens), got {value!r}")
    return float(value)


def parse_pricing(data: object, source: str = "<memory>") -> Pricing:
    """Validate loaded YAML (see the module docstring); raises PricingError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PricingError(f"{source}: expected a map of model glob: {{input, output, "
                           "cached_input}}")
    prices: dict[str, Price] = {}
    for glob, entry in data.items():
        where = f"{source}: {glob!r}"
        if not isinstance(glob, str) or not glob:
            raise PricingError(f"{where}: model globs must be non-empty strings")
        if not isinstance(entry, dict):
            raise PricingError(f"{where}: expected {{input: N, output: N, cached_input: N}}")
        unknown = sorted(str(k) for k in entry if k not in _KEYS)
        if unknown:
            raise PricingError(f"{where}: unknown key {unknown[0]!r} (known: "
                               f"{', '.join(_KEYS)})")
        if "input" not in entry or "output" not in entry:
            raise PricingError(f"{where}: input and output prices are required")
        given_in = _number(entry["input"], f"{where}.input")
        prices[glob] = Price(
            input=given_in,
            output=_number(entry["output"], f"{where}.output"),
            cached_input=_number(entry.get("cached_input", given_in), f"{where}.cached_input"),
        )
    return Pricing(prices, source)


def load_pricing(path: Path) -> Pricing:
    """Read and validate the pricing file at ``path``; raises PricingError."""
    import yaml  # (only here: the metering step itself reads no files)

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PricingError(f"{path}: cannot read: {exc.strerror}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PricingError(f"{path}: not valid YAML: {exc}") from None
    return parse_pricing(data, str(path))
