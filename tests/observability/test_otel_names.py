"""What the OpenTelemetry export calls an audit line (observability/otel_names.py):
span names, GenAI operation and provider names, and which lines sampling never leaves
out. Table-driven: these are decisions."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.observability.otel_names import (
    always_traced,
    operation,
    provider_name,
    request_model,
    span_name,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _line(**over: Any) -> dict[str, Any]:
    line: dict[str, Any] = {"listener": "proxy", "method": "POST", "host": "api.openai.com",
                            "path": "/v1/chat/completions", "decision": "allow",
                            "usage": None, "mcp": None, "models": None, "trace": None}
    line.update(over)
    return line


USAGE = {"model": "gpt-4o-2024-08-06", "input_tokens": 11, "output_tokens": 7}

NAMES = [
    (_line(usage=USAGE, models=["gpt-4o"]), "chat gpt-4o"),
    (_line(usage=USAGE), "chat gpt-4o-2024-08-06"),  # no request model: the response's
    (_line(usage=USAGE, path="/v1/embeddings", models=["te-3"]), "embeddings te-3"),
    (_line(usage=USAGE, path="/v1/completions", models=["d"]), "text_completion d"),
    (_line(usage=USAGE, path="/v1beta/models/g:generateContent", models=["g"]),
     "generate_content g"),
    (_line(), "POST api.openai.com"),
    (_line(method="CONNECT", host="x.test", path=None), "CONNECT x.test"),
    (_line(method=None, host=None), "proxy"),
]


@pytest.mark.parametrize(("line", "name"), NAMES)
def test_span_names(line: dict[str, Any], name: str) -> None:
    assert span_name(line) == name


@pytest.mark.parametrize(("preset", "name"), [
    ("openai", "openai"), ("anthropic", "anthropic"), ("gemini", "gcp.gemini"),
    ("azure-openai", "azure.ai.openai"), ("bedrock", "aws.bedrock"),
    ("mistral", "mistral_ai"), ("someone", "someone"), (None, None)])
def test_provider_names(preset: str | None, name: str | None) -> None:
    assert provider_name(preset) == name


def test_no_operation_without_usage() -> None:
    assert operation("/v1/chat/completions", None) is None


@pytest.mark.parametrize(("line", "model"), [
    (_line(models=["gpt-4o"], usage=USAGE), "gpt-4o"),
    (_line(usage=USAGE), "gpt-4o-2024-08-06"),
    (_line(models=[], usage={"model": 5}), None),
    (_line(), None)])
def test_request_model(line: dict[str, Any], model: str | None) -> None:
    assert request_model(line) == model


@pytest.mark.parametrize(("line", "always"), [
    (_line(), False),
    (_line(decision="deny"), True),
    (_line(decision="report"), True),
    (_line(usage=USAGE), True),
    (_line(mcp=[{"method": "tools/list"}]), True),
    (_line(trace=f"00-{TRACE}-00f067aa0ba902b7-01"), True),  # the sandbox sampled it
    (_line(trace=f"00-{TRACE}-00f067aa0ba902b7-00"), False),
])
def test_what_sampling_never_leaves_out(line: dict[str, Any], always: bool) -> None:
    assert always_traced(line) is always
