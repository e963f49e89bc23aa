"""Whether an inference answer streams (core/metering/streams.py): its time to first
chunk is said only then. Table-driven: a decision."""

from __future__ import annotations

import pytest

from gateway.core.metering.streams import streamed


@pytest.mark.parametrize(("path", "content_type", "expected"), [
    ("/v1/chat/completions", "text/event-stream", True),
    ("/v1/chat/completions", "Text/Event-Stream; charset=utf-8", True),
    ("/v1/messages", "text/event-stream;charset=UTF-8", True),
    ("/v1/chat/completions", "application/json", False),
    ("/v1/chat/completions", None, False),
    ("/v1beta/models/g:streamGenerateContent", "application/json", True),  # JSON array
    ("/v1beta/models/g:generateContent", "application/json", False),
    ("/model/m/converse-stream", "application/vnd.amazon.eventstream", True),
    ("/model/m/invoke-with-response-stream", None, True),
    ("/model/m/converse", "application/json", False),
    ("/api/chat", "application/x-ndjson", True),
])
def test_streamed(path: str, content_type: str | None, expected: bool) -> None:
    assert streamed(path, content_type) is expected
