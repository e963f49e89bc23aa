"""What an inference call may use at most, read from its request (pure, no I/O).

A call admitted under a ``tokens`` or ``cost_usd`` budget reserves this much while it
runs (``budgets.Reservation``), and settles to what it really used when it ends; a
call whose usage never arrives (a stream cut off) counts its reservation, not zero.

* **Output**: the request's own limit, ``max_completion_tokens`` / ``max_tokens``
  (OpenAI chat and completions, Anthropic, Bedrock Claude), ``max_output_tokens``
  (Responses API), ``generationConfig.maxOutputTokens`` (Gemini),
  ``inferenceConfig.maxTokens`` (Bedrock Converse), times the number of choices asked
  for (``n``, ``candidateCount``). Without one: the rule's ``metering.reserve``, else
  ``DEFAULT_OUTPUT``. Embeddings produce no output.
* **Input**: an estimate from the body: one token per four bytes that are not
  whitespace (JSON's own layout costs nothing; padding a body is no way to fill a
  budget), and a run of 1 KiB or more of base64 (an image or a file inlined in the
  request) counts as ``INLINE_TOKENS``, what a provider charges for one large image,
  instead of its size.
"""

from __future__ import annotations

import math
import re
from typing import Any

from gateway.services.metering.endpoints import Endpoint, Format, field_of, route

__all__ = ["DEFAULT_OUTPUT", "INLINE_TOKENS", "estimate_input", "output_limit"]

DEFAULT_OUTPUT = 4096
"""Output tokens reserved for a call that names no limit (and a rule without
``metering.reserve``)."""
INLINE_TOKENS = 1600
"""Input tokens counted for each inlined base64 object (an image)."""

_BASE64_RUN = re.compile(rb"[A-Za-z0-9+/=]{1024,}")
_BYTES_PER_TOKEN = 4


def estimate_input(raw: bytes) -> int:
    """Input tokens a request body may carry (see the module docstring)."""
    size = len(raw)
    size -= raw.count(b" ") + raw.count(b"\n") + raw.count(b"\t") + raw.count(b"\r")
    if len(raw) < 1024:
        return math.ceil(size / _BYTES_PER_TOKEN)
    inline = 0
    for match in _BASE64_RUN.finditer(raw):
        size -= match.end() - match.start()
        inline += 1
    return math.ceil(size / _BYTES_PER_TOKEN) + inline * INLINE_TOKENS


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


_OUTPUT_KEYS: dict[Format, tuple[tuple[str, ...], ...]] = {
    "openai": (("max_completion_tokens",), ("max_tokens",), ("max_output_tokens",)),
    "anthropic": (("max_tokens",),),
    "gemini": (("generationConfig", "maxOutputTokens"),),
    "bedrock": (("inferenceConfig", "maxTokens"), ("max_tokens",), ("max_gen_len",)),
    "responses_ws": (("max_output_tokens",),),
    "realtime": (("max_output_tokens",), ("max_response_output_tokens",)),
}


def output_limit(endpoint: Endpoint, fields: dict[str, Any] | None, path: str,
                 default: int) -> int:
    """The most output tokens this call may produce (see the module docstring);
    ``fields``: the request body's top-level fields (None: unknown)."""
    if endpoint.format == "openai" and route(path).endswith("/embeddings"):
        return 0
    if fields is None or endpoint.format is None:
        return default
    limit: int | None = None
    for keys in _OUTPUT_KEYS.get(endpoint.format, ()):
        value: Any = fields
        for key in keys:
            value = field_of(value, key)
        limit = _count(value)
        if limit is not None:
            break
    choices = _count(fields.get("n")) or _count(
        field_of(fields.get("generationConfig"), "candidateCount")) or 1
    return (default if limit is None else limit) * max(1, choices)
