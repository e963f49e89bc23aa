"""The model catalogue (gateway/services/metering/catalogue.py) and the operator's
pricing file over it (pricing.py): vendored, versioned, looked up as requests spell
models, the largest numbers where providers differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.core.metering.catalogue import Catalogue
from gateway.core.metering.pricing import PricingError, parse_pricing
from gateway.core.metering.usage import Usage
from gateway.services.metering.catalogue import catalogue

ROOT = Path(__file__).resolve().parents[2]


def test_the_vendored_catalogue_names_its_version_and_knows_the_usual_models() -> None:
    doc = json.loads((ROOT / "gateway/services/metering/catalogue.json").read_text())
    assert doc["version"] and doc["updated"] and doc["source"].startswith("litellm")
    known = catalogue()
    assert len(known) > 1000
    for name in ("gpt-4o-mini", "gpt-4.1", "claude-sonnet-4-5", "gemini-2.5-pro",
                 "o3", "text-embedding-3-small"):
        info = known.get(name)
        assert info is not None and info.context, name
    mini = known.get("gpt-4o-mini")
    assert mini is not None and (mini.context, mini.max_output) == (128000, 16384)
    assert known.get("no-such-model-xyz") is None and known.get(None) is None


def test_names_without_a_provider_prefix_take_the_largest_numbers() -> None:
    cat = Catalogue({
        "gemini/g": {"provider": "gemini", "context": 100, "max_output": 10, "input": 1.0,
                     "output": 2.0, "input_max": 1.0, "output_max": 2.0},
        "vertex_ai/g": {"provider": "vertex_ai-language-models", "context": 200,
                        "max_output": 5, "input": 3.0, "output": 1.0},
        "openrouter/anthropic/c": {"provider": "openrouter", "context": 7},
        "other/x": {"provider": "bedrock", "context": 1},
    })
    g = cat.get("g")
    assert g is not None and (g.context, g.max_output, g.input, g.output) == (200, 10, 3.0, 2.0)
    assert cat.get("gemini/g") is not None
    c = cat.get("anthropic/c")
    assert c is not None and c.context == 7
    assert cat.get("x") is None  # "other/" is no provider's prefix of that row


def test_pricing_file_overrides_limits_and_prices_over_the_catalogue() -> None:
    pricing = parse_pricing({
        "gpt-4o-mini*": {"input": 1, "output": 2, "max_output_tokens": 50},
        "my-deployment": {"context_window": 32000},
    }, "pricing.yaml", catalogue())
    limits = pricing.limits("gpt-4o-mini")
    assert limits is not None and (limits.context, limits.max_output) == (None, 50)
    assert "pricing.yaml" in limits.source
    deployment = pricing.limits("my-deployment")
    assert deployment is not None and deployment.context == 32000
    from_catalogue = pricing.limits("gpt-4.1")
    assert from_catalogue is not None and from_catalogue.max_output == 32768
    assert "catalogue" in from_catalogue.source
    assert pricing.cost(Usage("gpt-4o-mini", 1_000_000, 0)) == pytest.approx(1.0)
    gemini = pricing.price("gemini-2.5-pro")  # from the catalogue, with its long tier
    assert gemini is not None and gemini.above
    short = pricing.cost(Usage("gemini-2.5-pro", 100_000, 0))
    long = pricing.cost(Usage("gemini-2.5-pro", 300_000, 0))
    assert short is not None and long is not None and long > 3 * short
    # a reservation's cost is at the dearest price a token of the model may be billed
    assert gemini.bound(1_000_000, 0) >= gemini.input


@pytest.mark.parametrize(("entry", "message"), [
    ({"context_window": 0}, "positive whole number"),
    ({"max_output_tokens": "lots"}, "positive whole number"),
    ({"input": 1}, "input and output prices are required"),
    ({}, "expected prices"),
])
def test_pricing_file_limits_are_validated(entry: dict[str, object], message: str) -> None:
    with pytest.raises(PricingError, match=message):
        parse_pricing({"m": entry})
