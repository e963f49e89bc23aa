"""The model catalogue: context windows, output limits and prices of known models.

The numbers come from a kept, versioned, published data file, LiteLLM's
``model_prices_and_context_window_backup.json``, trimmed to what the meter reads and
vendored as ``catalogue.json`` beside this module with its version and date
(``make catalogue`` refreshes it: ``scripts/update-catalogue.py``). An operator's
``metering.pricing`` file overrides it per model glob (``pricing.Pricing``).

A name is looked up as the request spells it (``gpt-4o-mini``, ``claude-sonnet-4-5``,
Gemini's ``gemini-2.5-pro`` from the path, Bedrock's ``anthropic.claude-...``,
OpenRouter's ``anthropic/claude-sonnet-4.5``): the catalogue's keys are indexed both
whole and without their provider prefix (``gemini/``, ``openrouter/``...). Where several
providers list the same name, the largest context window, output limit and prices are
taken: a bound must hold on whichever provider serves the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Catalogue", "ModelInfo"]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What is known of one model: ``context`` (most input tokens) and ``max_output``
    (most output tokens) bound a reservation; prices are USD per million tokens
    (``input_max``/``output_max``: the dearest a token may be billed, for bounds;
    ``above``: long-context tiers ``(from_tokens, input, output, cached_input)``)."""

    name: str
    context: int | None = None
    max_output: int | None = None
    input: float | None = None
    output: float | None = None
    cached_input: float | None = None
    input_max: float | None = None
    output_max: float | None = None
    above: tuple[tuple[int, float, float, float], ...] = ()


def _larger(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


def _merge(name: str, rows: list[dict[str, Any]]) -> ModelInfo:
    """One ModelInfo from every catalogue row of a name: the largest of each number."""
    info: dict[str, Any] = {}
    above: list[tuple[int, float, float, float]] = []
    for row in rows:
        for key in ("context", "max_output", "input", "output", "cached_input",
                    "input_max", "output_max"):
            info[key] = _larger(info.get(key), row.get(key))
        above.extend(tuple(t) for t in row.get("above", ()))
    return ModelInfo(name, above=tuple(sorted(set(above))), **info)


class Catalogue:
    """Model names to ``ModelInfo`` (see the module docstring). The rows are merged into
    one ``ModelInfo`` per name when they are read (about 2 MiB for the vendored file),
    the raw rows dropped. ``load`` (instead of ``models``) gives the document
    ``{version, updated, models}`` at the first lookup (``services/metering/catalogue``
    reads the vendored file so), so a process that never meters holds none of it."""

    def __init__(self, models: dict[str, dict[str, Any]] | None = None, version: str = "",
                 updated: str = "", *,
                 load: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.version = version
        self.updated = updated
        self._index: dict[str, ModelInfo] | None = None
        self._loader = load
        if models is not None:
            self._index = self._merged(models)

    @staticmethod
    def _merged(models: dict[str, dict[str, Any]]) -> dict[str, ModelInfo]:
        rows: dict[str, list[dict[str, Any]]] = {}
        for key, row in models.items():
            rows.setdefault(key, []).append(row)
            prefix, sep, rest = key.partition("/")
            if sep and rest and (prefix == row.get("provider") or
                                 str(row.get("provider", "")).startswith(prefix)):
                rows.setdefault(rest, []).append(row)
        return {name: _merge(name, found) for name, found in rows.items()}

    def _load(self) -> dict[str, ModelInfo]:
        """The rows ``load`` gives, read once (a catalogue made without rows)."""
        if self._index is None:
            doc = self._loader() if self._loader is not None else {"models": {}}
            self.version = str(doc.get("version", ""))
            self.updated = str(doc.get("updated", ""))
            self._index = self._merged(doc["models"])
        return self._index

    def __len__(self) -> int:
        return len(self._load())

    @property
    def source(self) -> str:
        self._load()
        return f"the model catalogue (LiteLLM {self.version}, {self.updated})"

    def get(self, model: str | None) -> ModelInfo | None:
        """What the catalogue knows of ``model``, or None."""
        if model is None:
            return None
        return self._load().get(model)

