"""Whether an inference answer streams: its time to first token (the first chunk of the
answer, `usage.first_chunk_ms`; the GenAI conventions' time to first chunk) is said only
for answers that stream, where it is the wait before the model's first output."""

from __future__ import annotations

import re

__all__ = ["streamed"]

# SSE (OpenAI, Anthropic, Gemini ?alt=sse, Mistral, ...), AWS event streams (Bedrock's
# converse-stream, invoke-with-response-stream), newline-delimited JSON (Ollama-style)
_TYPES = frozenset({"text/event-stream", "application/vnd.amazon.eventstream",
                    "application/x-ndjson"})
# streams whose content type is plain JSON (Gemini's streamGenerateContent without
# ?alt=sse answers a JSON array, element by element) or a binary event stream
_PATHS = (":streamGenerateContent", "/converse-stream", "/invoke-with-response-stream")
_PATH = re.compile("|".join(re.escape(part) for part in _PATHS))  # (one C pass a response)


def streamed(path: str, content_type: str | None) -> bool:
    """Whether the answer to a request for `path` with that ``content-type`` streams."""
    if content_type is not None and \
            content_type.partition(";")[0].strip().lower() in _TYPES:
        return True
    return _PATH.search(path) is not None
