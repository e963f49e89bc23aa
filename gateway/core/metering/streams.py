"""Whether an inference answer streams: its time to first token (the first chunk of the
answer, `usage.first_chunk_ms`; the GenAI conventions' time to first chunk) is said only
for answers that stream, where it is the wait before the model's first output."""

from __future__ import annotations

__all__ = ["streamed"]

# SSE (OpenAI, Anthropic, Gemini ?alt=sse, Mistral, ...), AWS event streams (Bedrock's
# converse-stream, invoke-with-response-stream), newline-delimited JSON (Ollama-style)
_TYPES = frozenset({"text/event-stream", "application/vnd.amazon.eventstream",
                    "application/x-ndjson"})
# streams whose content type is plain JSON (Gemini's streamGenerateContent without
# ?alt=sse answers a JSON array, element by element) or a binary event stream
_PATHS = (":streamGenerateContent", "/converse-stream", "/invoke-with-response-stream")


def streamed(path: str, content_type: str | None) -> bool:
    """Whether the answer to a request for `path` with that ``content-type`` streams."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    return kind in _TYPES or any(part in path for part in _PATHS)
