"""Token prices and model limits: the operator's ``metering.pricing`` over the catalogue.

The model catalogue (``catalogue.py``, LiteLLM's published data file, vendored with its
version) gives every known model's context window, output limit and prices. The file
named by ``metering.pricing`` overrides it: YAML, model glob to USD per million tokens
and/or limits, the first matching glob in file order wins::

    gpt-4o-mini*:      {input: 0.15, output: 0.60, cached_input: 0.075}
    claude-sonnet-4*:  {input: 3.00, output: 15.00, cached_input: 0.30}
    my-deployment:     {context_window: 128000, max_output_tokens: 16384}
    "*":               {input: 1.00, output: 1.00}     # optional catch-all

Reading the file is ``services/metering/pricing`` (``load_pricing``). Globs are
``fnmatch.fnmatchcase`` (case-sensitive, like ``models:``). ``cached_input`` defaults to
``input``. Cost = (input - cached) x input + cached x cached_input +
output x output, per million, at the long-context tier the input reaches (catalogue
models). Anthropic cache writes are priced as input. A reservation's cost is a bound:
its tokens at the dearest price a token of the model may be billed (``Price.bound``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from gateway.core.metering.catalogue import Catalogue, ModelInfo
from gateway.core.metering.usage import Usage

__all__ = ["Limits", "Price", "Pricing", "PricingError", "parse_pricing"]

_PRICE_KEYS = ("input", "output", "cached_input")
_LIMIT_KEYS = ("context_window", "max_output_tokens")
_KEYS = _PRICE_KEYS + _LIMIT_KEYS


class PricingError(ValueError):
    """The pricing file is unreadable or wrong; the message names the entry."""


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens: what a settled call is priced at (``input``, ``output``,
    ``cached_input``, and the long-context tiers ``above``), and the dearest a token may
    be billed (``input_max``, ``output_max``: priority tiers, cache writes, audio), which
    a reservation's bound counts."""

    input: float
    output: float
    cached_input: float
    input_max: float | None = None
    output_max: float | None = None
    above: tuple[tuple[int, float, float, float], ...] = ()

    def bound(self, input_tokens: int, output_tokens: int) -> float:
        """The most USD ``input_tokens`` + ``output_tokens`` may be billed."""
        top_in = max(self.input_max or 0.0, self.input, *(t[1] for t in self.above))
        top_out = max(self.output_max or 0.0, self.output, *(t[2] for t in self.above))
        return (input_tokens * top_in + output_tokens * top_out) / 1_000_000


@dataclass(frozen=True, slots=True)
class Limits:
    """A model's context window and output limit (None: unknown), and where they are
    written (for reasons)."""

    context: int | None
    max_output: int | None
    source: str


@dataclass(frozen=True, slots=True)
class _Entry:
    price: Price | None
    context: int | None = None
    max_output: int | None = None


def _from_info(info: ModelInfo) -> Price | None:
    if info.input is None or info.output is None:
        return None
    cached = info.cached_input if info.cached_input is not None else info.input
    return Price(info.input, info.output, cached, info.input_max, info.output_max, info.above)


class Pricing:
    """Prices and limits by model glob over a catalogue (``fallback``); ``cost(usage)``
    in USD, None when the model has no price."""

    def __init__(self, prices: Mapping[str, Price | _Entry], source: str = "<memory>",
                 fallback: Catalogue | None = None) -> None:
        self.entries = {g: p if isinstance(p, _Entry) else _Entry(p) for g, p in prices.items()}
        self.prices = {g: e.price for g, e in self.entries.items() if e.price is not None}
        self.source = source
        self.fallback = fallback
        self._cache: dict[str, Price | None] = {}

    def price(self, model: str | None) -> Price | None:
        """The price of ``model`` (first matching glob with prices, else the
        catalogue's), or None."""
        if model is None:
            return None
        if model in self._cache:
            return self._cache[model]
        found = next((p for glob, p in self.prices.items() if fnmatchcase(model, glob)), None)
        if found is None and self.fallback is not None:
            info = self.fallback.get(model)
            found = _from_info(info) if info is not None else None
        if len(self._cache) < 4096:
            self._cache[model] = found
        return found

    def limits(self, model: str | None) -> Limits | None:
        """``model``'s context window and output limit: the first matching glob that
        sets either, else the catalogue's; None if neither knows the model."""
        if model is None:
            return None
        for glob, entry in self.entries.items():
            if (entry.context is not None or entry.max_output is not None) and \
                    fnmatchcase(model, glob):
                return Limits(entry.context, entry.max_output, f"{self.source} ({glob!r})")
        info = self.fallback.get(model) if self.fallback is not None else None
        if info is None:
            return None
        assert self.fallback is not None
        return Limits(info.context, info.max_output, self.fallback.source)

    def cost(self, usage: Usage) -> float | None:
        """USD for ``usage``; None if the model has no price or no counts are known."""
        price = self.price(usage.model)
        if price is None or not usage.known:
            return None
        total_in = usage.input_tokens or 0
        p_in, p_out, p_cached = price.input, price.output, price.cached_input
        for start, t_in, t_out, t_cached in price.above:  # (sorted: the highest reached)
            if total_in > start:
                p_in, p_out, p_cached = t_in, t_out, t_cached
        cached = min(usage.cached_input_tokens or 0, total_in)
        micro = ((total_in - cached) * p_in + cached * p_cached
                 + (usage.output_tokens or 0) * p_out)
        return micro / 1_000_000


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value < 0:
        raise PricingError(f"{where}: expected a non-negative number (USD per million "
                           f"tokens), got {value!r}")
    return float(value)


def _tokens(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PricingError(f"{where}: expected a positive whole number of tokens, got "
                           f"{value!r}")
    return value


def parse_pricing(data: object, source: str = "<memory>",
                  fallback: Catalogue | None = None) -> Pricing:
    """Validate loaded YAML (see the module docstring); raises PricingError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PricingError(f"{source}: expected a map of model glob: {{input, output, "
                           "cached_input}}")
    prices: dict[str, Price | _Entry] = {}
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
        priced = any(k in entry for k in _PRICE_KEYS)
        if priced and ("input" not in entry or "output" not in entry):
            raise PricingError(f"{where}: input and output prices are required")
        if not priced and not any(k in entry for k in _LIMIT_KEYS):
            raise PricingError(f"{where}: expected prices (input, output) or limits "
                               "(context_window, max_output_tokens)")
        price = None
        if priced:
            given_in = _number(entry["input"], f"{where}.input")
            price = Price(
                input=given_in,
                output=_number(entry["output"], f"{where}.output"),
                cached_input=_number(entry.get("cached_input", given_in),
                                     f"{where}.cached_input"),
            )
        context = entry.get("context_window")
        max_output = entry.get("max_output_tokens")
        prices[glob] = _Entry(
            price,
            _tokens(context, f"{where}.context_window") if context is not None else None,
            _tokens(max_output, f"{where}.max_output_tokens") if max_output is not None
            else None)
    return Pricing(prices, source, fallback)

