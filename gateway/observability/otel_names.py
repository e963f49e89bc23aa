"""What the OpenTelemetry export calls an audit line (pure, no SDK): the GenAI operation
and provider names, the span name, and whether sampling may leave a line's span out.

Used on both sides of the export (`otel_feed.py` in the worker decides sampling and the
provider; `otel.py` in the exporter process names spans), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["always_traced", "operation", "provider_name", "request_model", "span_name"]

# gen_ai.provider.name (the GenAI conventions' well-known values) by credential preset.
_PROVIDERS = {"openai": "openai", "anthropic": "anthropic", "gemini": "gcp.gemini",
              "vertex": "gcp.vertex_ai", "azure-openai": "azure.ai.openai",
              "azure_openai": "azure.ai.openai", "bedrock": "aws.bedrock",
              "mistral": "mistral_ai", "groq": "groq", "deepseek": "deepseek",
              "cohere": "cohere", "xai": "x_ai", "perplexity": "perplexity"}


def operation(path: str | None, usage: Mapping[str, Any] | None) -> str | None:
    """``gen_ai.operation.name`` of an inference call to `path` (None: not one)."""
    if usage is None:
        return None
    path = path or ""
    if "embed" in path:
        return "embeddings"
    if ":generateContent" in path or ":streamGenerateContent" in path:
        return "generate_content"
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        return "text_completion"
    return "chat"


def provider_name(preset: str | None) -> str | None:
    """``gen_ai.provider.name`` for a credential's preset."""
    return None if preset is None else _PROVIDERS.get(preset, preset)


def request_model(line: Mapping[str, Any]) -> str | None:
    """The model the request named (the line's first of ``models``), else the one the
    provider answered with (``usage.model``)."""
    models = line.get("models")
    if isinstance(models, list) and models and isinstance(models[0], str):
        return models[0]
    usage = line.get("usage")
    model = usage.get("model") if isinstance(usage, Mapping) else None
    return model if isinstance(model, str) else None


def span_name(line: Mapping[str, Any]) -> str:
    """``chat gpt-4o`` for an inference call, else ``METHOD host`` (``CONNECT host``)."""
    usage = line.get("usage")
    op = operation(line.get("path"), usage)
    if op is not None:
        model = request_model(line)
        return f"{op} {model}" if model else op
    method = line.get("method")
    host = line.get("host")
    if method and host:
        return f"{method} {host}"
    return str(method or line.get("listener") or "connection")


def always_traced(line: Mapping[str, Any]) -> bool:
    """Whether `line`'s span is exported whatever `telemetry.sample` says: a refusal (or
    any decision but allow), an inference call, an MCP message, a request whose
    sandbox sampled its trace (the traceparent's sampled flag), or one that left with the
    gateway's span as its traceparent (`telemetry.propagate`: the upstream's parent)."""
    trace_header = line.get("trace")
    return (line.get("decision") != "allow" or line.get("usage") is not None
            or line.get("mcp") is not None or line.get("trace_sent") is not None
            or (isinstance(trace_header, str) and int(trace_header[-1], 16) & 1 == 1))
