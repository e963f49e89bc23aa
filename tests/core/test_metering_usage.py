"""Usage read from real-shaped provider responses (tests/data/metering/, modelled on the
providers' documented examples), whatever the chunking: whole, byte by byte, split at
every byte boundary, and at random multi-way splits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gateway.core.metering.endpoints import classify, request_model, rewrite_request_body
from gateway.core.metering.scan import SALVAGE, SseScanner
from gateway.core.metering.usage import (
    HOLD,
    JSON_CAP,
    Meter,
    RealtimeMeter,
    SessionMeter,
    Usage,
    meter_for,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "metering"

CHAT = "/v1/chat/completions"
GEMINI_STREAM = "/v1beta/models/gemini-2.0-flash:streamGenerateContent"

# fixture, preset, path, request body -> expected usage
CASES: list[tuple[str, str | None, str, bytes | None, Usage]] = [
    ("openai_chat.json", "openai", CHAT, b'{"model":"gpt-4o"}',
     Usage("gpt-4o-2024-08-06", 1117, 46, 1024)),
    ("openai_chat_stream_usage.sse", "openai", CHAT, b'{"model":"gpt-4o-mini","stream":true}',
     Usage("gpt-4o-mini-2024-07-18", 9, 12, 0)),
    # No include_usage: a request with unknown tokens, model from the request.
    ("openai_chat_stream_no_usage.sse", "openai", CHAT,
     b'{"model":"gpt-4o-mini","stream":true}', Usage("gpt-4o-mini", None, None, None)),
    ("openai_completions.json", "openai", "/v1/completions", None,
     Usage("gpt-3.5-turbo-instruct", 5, 7, None)),
    ("openai_embeddings.json", "openai", "/v1/embeddings", b'{"model":"text-embedding-3-small"}',
     Usage("text-embedding-3-small", 8, 0, None)),
    ("openai_responses.json", "openai", "/v1/responses", None,
     Usage("gpt-4.1-2025-04-14", 36, 87, 0)),
    ("openai_responses_stream.sse", "openai", "/v1/responses", b'{"model":"gpt-4.1"}',
     Usage("gpt-4.1-2025-04-14", 37, 11, 5)),
    ("openai_error_401.json", "openai", CHAT, b'{"model":"gpt-4o"}',
     Usage("gpt-4o", None, None, None)),
    ("azure_chat_stream.sse", "azure-openai",
     "/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21", None,
     Usage("gpt-4o-2024-08-06", 20, 5, 0)),
    ("anthropic_messages.json", "anthropic", "/v1/messages", b'{"model":"claude-sonnet-4-0"}',
     Usage("claude-sonnet-4-20250514", 2095 + 100 + 1800, 503, 1800)),
    ("anthropic_messages_stream.sse", "anthropic", "/v1/messages", None,
     Usage("claude-opus-4-1-20250805", 35, 15, 10)),
    # Claude on Vertex AI: Anthropic's stream format, model in the path.
    ("anthropic_messages_stream.sse", None,
     "/v1/projects/p/locations/us-east5/publishers/anthropic/models/claude-opus-4-1"
     "@20250805:streamRawPredict", None, Usage("claude-opus-4-1-20250805", 35, 15, 10)),
    ("gemini_generate.json", "gemini", "/v1beta/models/gemini-2.5-flash:generateContent", None,
     Usage("gemini-2.5-flash", 2008, 112, 2000)),
    ("gemini_stream.sse", "gemini", GEMINI_STREAM + "?alt=sse", None,
     Usage("gemini-2.0-flash", 8, 40, 0)),
    ("gemini_stream_array.json", "gemini", GEMINI_STREAM, None,
     Usage("gemini-2.0-flash", 8, 40, 0)),
    ("groq_stream.sse", "groq", "/openai/v1/chat/completions", None,
     Usage("llama-3.1-8b-instant", 40, 10, None)),
    ("openrouter_stream.sse", "openrouter", "/api/v1/chat/completions", None,
     Usage("openai/gpt-4o", 10, 3, 2)),
    ("mistral_stream.sse", "mistral", CHAT, None, Usage("mistral-small-latest", 10, 12, None)),
]
IDS = [f"{c[0]}:{c[1]}" for c in CASES]


def metered(preset: str | None, path: str, body: bytes | None, chunks: list[bytes],
            status: int = 200) -> Usage:
    """The usage of a response relayed as `chunks`: scanned as each chunk arrives
    (hold 0) and in runs of HOLD bytes, which must agree."""
    results = []
    for hold in (0, HOLD):
        meter = meter_for(preset, "POST", path, body, hold=hold)
        assert meter is not None
        for chunk in chunks:
            meter.feed(chunk)
        results.append(meter.finish(status))
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize(("fixture", "preset", "path", "body", "expected"), CASES, ids=IDS)
def test_whole_body(fixture: str, preset: str | None, path: str, body: bytes | None,
                    expected: Usage) -> None:
    assert metered(preset, path, body, [(DATA / fixture).read_bytes()]) == expected


@pytest.mark.parametrize(("fixture", "preset", "path", "body", "expected"), CASES, ids=IDS)
def test_every_split(fixture: str, preset: str | None, path: str, body: bytes | None,
                     expected: Usage) -> None:
    data = (DATA / fixture).read_bytes()
    assert metered(preset, path, body, [data[i:i + 1] for i in range(len(data))]) == expected
    for cut in range(1, len(data)):
        assert metered(preset, path, body, [data[:cut], data[cut:]]) == expected, cut
    rng = random.Random(fixture)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(2, 12)))
        parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert metered(preset, path, body, parts) == expected, cuts


@pytest.mark.parametrize("fixture", ["openai_chat_stream_usage.sse", "gemini_stream.sse",
                                     "anthropic_messages_stream.sse"])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_sse_line_endings(fixture: str, newline: bytes) -> None:
    """Any of the three SSE line ends, including a lone CR split from its LF."""
    data = (DATA / fixture).read_bytes().replace(b"\r\n", b"\n").replace(b"\n", newline)
    case = next(c for c in CASES if c[0] == fixture)
    for cut in range(1, len(data)):
        assert metered(case[1], case[2], case[3], [data[:cut], data[cut:]]) == case[4]


@pytest.mark.parametrize("fixture", ["openai_chat_stream_usage.sse", "gemini_stream.sse",
                                     "anthropic_messages_stream.sse"])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_sse_one_event_per_chunk(fixture: str, newline: bytes) -> None:
    """What providers send (a chunk per event, each ending in its blank line) takes the
    scanner's fast path for the events without usage; the usage is still read."""
    data = (DATA / fixture).read_bytes().replace(b"\r\n", b"\n").replace(b"\n", newline)
    end = newline * 2
    events = [e + end for e in data.split(end) if e]
    assert b"".join(events).rstrip(newline) == data.rstrip(newline)
    case = next(c for c in CASES if c[0] == fixture)
    assert metered(case[1], case[2], case[3], events) == case[4]
    # Events in pairs, and every event glued to the start of the next one.
    assert metered(case[1], case[2], case[3], [b"".join(events[i:i + 2])
                                                for i in range(0, len(events), 2)]) == case[4]
    glued = [events[i] + events[i + 1][:3] if i + 1 < len(events) else events[i]
             for i in range(len(events))]
    glued = [g[3:] if i else g for i, g in enumerate(glued)]
    assert metered(case[1], case[2], case[3], glued) == case[4]


def test_stream_cut_off_keeps_what_arrived() -> None:
    data = (DATA / "anthropic_messages_stream.sse").read_bytes()
    cut = data.index(b"event: message_delta")
    usage = metered("anthropic", "/v1/messages", None, [data[:cut]], status=200)
    assert usage == Usage("claude-opus-4-1-20250805", 35, 1, 10)  # output so far
    # The last event without its blank line still counts.
    assert metered("anthropic", "/v1/messages", None,
                   [data.rstrip(b"\n")]) == Usage("claude-opus-4-1-20250805", 35, 15, 10)


def test_large_json_body_usage_salvaged_from_the_tail() -> None:
    """A non-streaming body over the cap is not kept: usage and model come from its
    head and tail, which hold them for every provider."""
    text = "word \\\"usage\\\": {\\\"prompt_tokens\\\": 1} " * 60_000
    body = (b'{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o",'
            b'"choices":[{"message":{"content":"' + text.encode() + b'"}}],'
            b'"usage":{"prompt_tokens":10,"completion_tokens":900,"total_tokens":910,'
            b'"prompt_tokens_details":{"cached_tokens":4}}}')
    assert len(body) > 2 * JSON_CAP
    chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)]
    assert metered("openai", CHAT, None, chunks) == Usage("gpt-4o", 10, 900, 4)


def test_large_embeddings_body() -> None:
    vectors = json.dumps([{"object": "embedding", "index": i, "embedding": [0.0123] * 1536}
                          for i in range(150)])
    body = (b'{"object":"list","data":' + vectors.encode()
            + b',"model":"text-embedding-3-large","usage":{"prompt_tokens":600,'
              b'"total_tokens":600}}')
    assert len(body) > JSON_CAP
    assert metered("openai", "/v1/embeddings", None, [body]) == Usage(
        "text-embedding-3-large", 600, 0, None)


def test_long_sse_line_salvaged() -> None:
    """A response.completed event larger than the cap (the whole output in one line)."""
    long_text = "x" * (JSON_CAP + 10)
    event = {"type": "response.completed", "response": {
        "id": "resp_1", "model": "gpt-4.1", "output": [{"content": [{"text": long_text}]}],
        "usage": {"input_tokens": 3, "output_tokens": 700000, "total_tokens": 700003,
                  "input_tokens_details": {"cached_tokens": 0}}}}
    data = f"event: response.completed\ndata: {json.dumps(event)}\n\n".encode()
    expected = Usage("gpt-4.1", 3, 700000, 0)
    for size in (4096, 65536, len(data)):
        chunks = [data[i:i + size] for i in range(0, len(data), size)]
        assert metered("openai", "/v1/responses", None, chunks) == expected, size


@pytest.mark.parametrize("stream", [
    b"data: {\"x\": 1}\n\rdata: {\"usage\": {\"n\": 2}}\n\r",  # LF CR: an event's end
    b"\xef\xbb\xbfdata: {\"usage\": {\"n\": 2}}\r\n\r\n",  # a BOM first is dropped
    b"data: {\"usage\": {\"n\": 2}}\r\r",
])
def test_the_sse_scanner_reads_events_as_every_sse_reader_does(stream: bytes) -> None:
    """The WHATWG line ends and BOM that gateway/core/sse.py's reader (the MCP answers')
    follows too: split the same way, cut anywhere."""
    for step in (1, 2, 3, len(stream)):
        got: list[bytes] = []
        scanner = SseScanner(lambda data, tail, got=got: got.append(data), 1 << 16)
        for i in range(0, len(stream), step):
            scanner.feed(stream[i:i + step])
        scanner.finish()
        assert got == [b'{"usage": {"n": 2}}'], step


def test_memory_stays_bounded() -> None:
    """A never-ending line is not accumulated beyond the cap."""
    meter = Meter("openai", "m", cap=1000)
    meter.feed(b"data: {")
    for _ in range(1000):
        meter.feed(b"a" * 1000)
    assert meter._held_size < HOLD + 1000
    scanner = meter._scanner
    assert isinstance(scanner, SseScanner)
    assert len(scanner._rest) <= 1000
    long = scanner._long
    assert long is not None and len(long.head) + len(long.tail) <= 2 * SALVAGE
    assert meter.finish(200) == Usage("m")


@pytest.mark.parametrize("garbage", [
    b"\xff\xfe\x00garbage", b"{not json", b"[1, 2, {\"a\": ", b"data: {\"usage\": {\"x\"",
    b"data: {\"usage\": {\"prompt_tokens\": -5, \"completion_tokens\": true}}\n\n",
    b"data: {\"usage\": {\"prompt_tokens\": \"12\"}}\n\n", b"   ", b"",
    b"[" * 10000, b"{\"usage\": [1, 2]}",
])
def test_never_raises(garbage: bytes) -> None:
    for fmt in ("openai", "anthropic", "gemini"):
        meter = Meter(fmt, "req-model")  # type: ignore[arg-type]
        meter.feed(garbage)
        meter.feed(garbage)
        usage = meter.finish(500)
        assert usage.model == "req-model"
        assert usage.input_tokens is None and usage.output_tokens is None


def test_usage_record() -> None:
    usage = Usage("gpt-4o", 10, 5, 2)
    assert usage.as_record() == {"model": "gpt-4o", "input_tokens": 10, "output_tokens": 5,
                                 "cached_input_tokens": 2}
    assert usage.tokens == 15 and usage.known
    assert Usage("m").tokens == 0 and not Usage("m").known


# --- which requests are metered ---------------------------------------------------------

CLASSIFY = [
    ("POST", "/v1/chat/completions", "openai"),
    ("POST", "/v1/responses", "openai"),
    ("POST", "/v1/embeddings", "openai"),
    ("POST", "/v1/completions", "openai"),
    ("POST", "/openai/deployments/gpt4o/chat/completions?api-version=2024-10-21", "openai"),
    ("POST", "/openai/v1/responses", "openai"),
    ("POST", "/api/v1/chat/completions", "openai"),
    ("POST", "/v1/fim/completions", "openai"),
    ("POST", "/v1/messages", "anthropic"),
    ("POST", "/v1/messages?beta=true", "anthropic"),
    ("POST", "/v1beta/models/gemini-2.0-flash:generateContent", "gemini"),
    ("POST", "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse", "gemini"),
    ("POST", "/v1/projects/p/locations/l/publishers/google/models/gemini-1.5-pro:"
             "generateContent", "gemini"),
    ("POST", "/v1beta/tunedModels/my-model:generateContent", "gemini"),
    ("GET", "/v1/models", None),
    ("GET", "/v1/responses/resp_123", "retrieval"),
    ("GET", "/v1/responses/resp_123/input_items", None),
    ("GET", "/v1/batches/batch_abc", "retrieval"),
    ("GET", "/v1/messages/batches/msgbatch_1/results", "retrieval"),
    ("POST", "/v1/batches", "deferred"),
    ("POST", "/openai/batches", "deferred"),
    ("POST", "/v1beta/models/gemini-2.0-flash:batchGenerateContent", "deferred"),
    ("POST", "/v1/realtime/client_secrets", "minted"),
    ("POST", "/v1//realtime/client_secret%73/", "minted"),
    ("POST", "/v1/realtime/transcription_sessions", "minted"),
    ("POST", "/v1/chatkit/sessions", "minted"),
    ("POST", "/v1alpha/auth_tokens", "minted"),
    ("POST", "/v1/images/generations", "unmetered"),
    ("POST", "/v1/audio/transcriptions", "unmetered"),
    ("POST", "/v1/threads/t1/runs", "unmetered"),
    ("POST", "/v1/threads/runs", "unmetered"),
    ("POST", "/v1/videos", "unmetered"),
    ("POST", "/v1/complete", "unmetered"),
    ("POST", "/v1/fine_tuning/jobs", "unmetered"),
    ("POST", "/model/m/invoke-with-response-stream", "unmetered"),
    ("POST", "/model/m/invoke", "bedrock"),
    ("POST", "/v1/responses/compact", "openai"),
    ("GET", "/v1/responses", "responses_ws"),
    ("GET", "/v1/responses/", "responses_ws"),
    ("POST", "/v1/moderations", "unmetered"),  # (billed by the token at Mistral)
    # endpoints the meter did not know (issue 39): now classified, refused where budgeted
    ("POST", "/v1/projects/p/locations/l/endpoints/123:generateContent", "gemini"),
    ("POST", "/v1/projects/p/locations/l/endpoints/123:streamGenerateContent", "gemini"),
    ("POST", "/v1/projects/p/locations/l/endpoints/123:predict", "unmetered"),
    ("POST", "/v1/projects/p/locations/l/endpoints/123:rawPredict", "unmetered"),
    ("POST", "/v1/projects/p/locations/l/endpoints/openapi:chatCompletions", "unmetered"),
    ("POST", "/async-invoke", "unmetered"),
    ("POST", "/v1/conversations", "unmetered"),
    ("POST", "/v1/conversations/conv_1/restart", "unmetered"),
    ("POST", "/v1/ocr", "unmetered"),
    ("POST", "/v1beta/cachedContents", "unmetered"),
    ("POST", "/v1beta/interactions", "unmetered"),
    ("POST", "/v1/containers", "unmetered"),
    ("PUT", "/v1/chat/completions", None),
    ("PATCH", "/v1/chat/completions", None),
    ("POST", "/V1/CHAT/COMPLETIONS", None),
    ("POST", "/v1/chat/completions;v=1", None),
    ("POST", "/openai/deployments/d/Chat/Completions", None),
    ("POST", "/v1/vector_stores/vs_1/file_batches", None),
    ("POST", "/v1/responses/resp_123/cancel", None),
    ("POST", "/v1/messages/count_tokens", None),
    ("POST", "/v1/messages/batches", "deferred"),
    ("POST", "/v1/threads/t1/messages", None),
    ("POST", "/v1beta/models/gemini-2.0-flash:countTokens", None),
    ("POST", "/v1beta/models/text-embedding-004:embedContent", "unmetered"),
    ("POST", "/v1/files", None),
    # what a provider's router would take for the same endpoint is metered too
    ("POST", "/v1/chat/completions/", "openai"),
    ("POST", "//v1//chat/completions", "openai"),
    ("POST", "/v1/chat/completion%73", "openai"),
    ("POST", "/v1/messages/", "anthropic"),
    ("POST", "/v1beta/models/gemini-2.0-flash%3AgenerateContent", "gemini"),
    ("POST", "/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/converse", "bedrock"),
    # Realtime sessions: the WebSocket upgrade is a GET
    ("GET", "/v1/realtime?model=gpt-4o-realtime-preview", "realtime"),
    ("get", "/openai/realtime?api-version=2024-10-01-preview&deployment=rt", "realtime"),
    ("GET", "/openai/v1/realtime?model=gpt-realtime", "realtime"),
    ("GET", "/v1/realtime/", "realtime"),
    ("POST", "/v1/realtime/sessions", "minted"),  # an ephemeral key, not a session
    ("POST", "/v1/realtime/calls?model=gpt-realtime", "unmetered"),  # WebRTC SDP
    ("GET", "/v1/realtime/sessions", None),
]


@pytest.mark.parametrize(("method", "path", "fmt"), CLASSIFY)
def test_classify(method: str, path: str, fmt: str | None) -> None:
    """`fmt`: how an inference call's or a session's usage is read, else the kind."""
    endpoint = classify(method, path)
    got = None if endpoint is None else (
        endpoint.format if endpoint.kind in ("inference", "session") else endpoint.kind)
    assert got == fmt


MODELS = [
    (None, "/v1/chat/completions", b'{"model": "gpt-4o-mini", "messages": []}', "gpt-4o-mini"),
    (None, "/v1/chat/completions", b'{"messages": []}', None),
    (None, "/v1/chat/completions", b"not json", None),
    (None, "/v1/chat/completions", None, None),
    (None, "/v1/chat/completions", b'{"model": 4}', None),
    ("gemini", "/v1beta/models/gemini-2.0-flash:generateContent", b'{"model": "x"}',
     "gemini-2.0-flash"),
    ("gemini", "/v1beta/tunedModels/t-1:generateContent", None, "tunedModels/t-1"),
    (None, "/v1/projects/p/locations/l/publishers/google/models/gemini-1.5-pro-002:"
           "streamGenerateContent", None, "gemini-1.5-pro-002"),
    ("azure-openai", "/openai/deployments/prod-4o/chat/completions?api-version=2024-10-21",
     b'{"model": "ignored"}', "prod-4o"),
    ("azure-openai", "/openai/v1/chat/completions", b'{"model": "my-deployment"}',
     "my-deployment"),
    (None, "/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/invoke", None,
     "anthropic.claude-3-5-sonnet-20240620-v1:0"),
    (None, "/v1/projects/p/locations/l/publishers/anthropic/models/claude-sonnet-4@20250514:"
           "rawPredict", None, "claude-sonnet-4@20250514"),
    # Encoded separators never become a "model" name.
    ("gemini", "/v1beta/models/gemini-pro%2F..%2Fother:generateContent", None, None),
    ("azure-openai", "/openai/deployments/a%252Fb/chat/completions", None, None),
    # A Realtime session names its model in the query
    ("openai", "/v1/realtime?model=gpt-4o-realtime-preview", None, "gpt-4o-realtime-preview"),
    ("azure-openai", "/openai/realtime?api-version=2024-10-01-preview&deployment=rt-4o",
     None, "rt-4o"),
    ("openai", "/v1/realtime?model=a%2F..%2Fb", None, None),
    ("openai", "/v1/realtime?model=gpt-realtime", b"", "gpt-realtime"),  # (an empty body)
]


@pytest.mark.parametrize(("preset", "path", "body", "model"), MODELS)
def test_request_model(preset: str | None, path: str, body: bytes | None,
                       model: str | None) -> None:
    assert request_model(preset, path, body) == model


STREAM = b'{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"stream":true}'
ADDED = (b'{"stream_options":{"include_usage":true},"model":"gpt-4o-mini","messages":'
         b'[{"role":"user","content":"hi"}],"stream":true}')
REWRITE = [
    ("openai", CHAT, STREAM, ADDED),
    ("openai", "/v1/completions", b' {"stream": true, "prompt": "x"}',
     b' {"stream_options":{"include_usage":true},"stream": true, "prompt": "x"}'),
    ("openai", CHAT, b'{"model":"m","stream":false}', None),
    ("openai", CHAT, b'{"model":"m"}', None),
    ("openai", CHAT, b'{"model":"m","stream":true,"stream_options":{"include_usage":false}}',
     b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}'),  # set
    ("openai", CHAT, b'{"model":"m","stream":true,"stream_options":{"x":1}}',
     b'{"model": "m", "stream": true, "stream_options": {"x": 1, "include_usage": true}}'),
    ("openai", CHAT, b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}',
     None),
    ("openai", CHAT, b'{"model":"m","stream":true,"stream":true}', None),  # duplicate key
    ("openai", CHAT, b'{"model":"m","stream":true,"stream_options":null}',
     b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}'),
    ("openai", CHAT, b'{"model":"m","stream":true,"stream_options":'
     b'{"include_usage":false,"include_usage":true}}',  # the provider may read the first
     b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}'),
    ("openai", CHAT, b'{"model":"m","stream":true,"stream_options":'
     b'{"include_usage":false,"include_\\u0075sage":true}}',  # the same key, escaped
     b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}}'),
    ("openai", CHAT, b'{"model":"m","stream":true,"stream_options":[]}', None),
    ("openai", CHAT, b'{"model":"m","stream":true,"messages":[{"role":"a","role":"b"}]}',
     b'{"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":'
     b'[{"role":"a","role":"b"}]}'),  # a repeat inside a message: not a field we read
    ("openai", CHAT, b"not json", None),
    ("openai", CHAT, None, None),
    ("openai", "/v1/responses", b'{"model":"m","stream":true}', None),  # always has usage
    ("openai", "/v1/embeddings", b'{"model":"m","stream":true}', None),
    ("azure-openai", "/openai/deployments/d/chat/completions?api-version=2024-10-21", STREAM,
     ADDED),
    ("azure-openai", "/openai/deployments/d/chat/completions?api-version=2024-02-01", STREAM,
     None),  # older API versions refuse stream_options
    ("azure-openai", "/openai/v1/chat/completions", STREAM, ADDED),
    ("mistral", CHAT, STREAM, None),  # sends usage anyway; refuses unknown fields
    ("groq", "/openai/v1/chat/completions", STREAM, None),
    ("openrouter", "/api/v1/chat/completions", STREAM, None),
    (None, CHAT, STREAM, None),
]


@pytest.mark.parametrize(("preset", "path", "body", "expected"), REWRITE)
def test_rewrite_request_body(preset: str | None, path: str, body: bytes | None,
                              expected: bytes | None) -> None:
    out = rewrite_request_body(preset, path, body)
    assert out == expected
    if out is not None:
        assert json.loads(out)["stream_options"]["include_usage"] is True


@pytest.mark.parametrize("fixture", ["openai_chat_stream_usage.sse",
                                     "anthropic_messages_stream.sse", "gemini_stream.sse"])
def test_large_chunks_of_whole_events(fixture: str) -> None:
    """Many whole events in one chunk (an upstream that wrote faster than we read): only
    the events with usage are split, with the same result as event by event."""
    data = (DATA / fixture).read_bytes().replace(b"\r\n", b"\n")
    head, _, rest = data.partition(b"\n\n")
    filler = b"".join(b'data: {"choices":[{"delta":{"content":"x%d"}}]}\n\n' % i
                      for i in range(300))
    big = head + b"\n\n" + filler + rest  # usage events first, middle and last
    assert len(big) > 4096
    preset, path = {"openai_chat_stream_usage.sse": ("openai", CHAT),
                    "anthropic_messages_stream.sse": ("anthropic", "/v1/messages"),
                    "gemini_stream.sse": ("gemini", GEMINI_STREAM)}[fixture]
    one = metered(preset, path, None, [big])
    by_event = metered(preset, path, None, [e + b"\n\n" for e in big.split(b"\n\n") if e])
    assert one == by_event and one.known


@pytest.mark.parametrize("fixture", ["openai_chat_stream_usage.sse",
                                     "anthropic_messages_stream.sse", "gemini_stream.sse"])
def test_two_large_chunks_cut_anywhere(fixture: str) -> None:
    """A run of whole events cut at any byte (a TLS read boundary): the event the cut
    falls in is finished line by line, the whole events after it take the quick path,
    and the usage is the same as event by event."""
    data = (DATA / fixture).read_bytes().replace(b"\r\n", b"\n")
    head, _, rest = data.partition(b"\n\n")
    filler = b"".join(b'data: {"choices":[{"delta":{"content":"y%d"}}]}\n\n' % i
                      for i in range(40))
    big = head + b"\n\n" + filler + rest
    preset, path = {"openai_chat_stream_usage.sse": ("openai", CHAT),
                    "anthropic_messages_stream.sse": ("anthropic", "/v1/messages"),
                    "gemini_stream.sse": ("gemini", GEMINI_STREAM)}[fixture]
    expected = metered(preset, path, None, [e + b"\n\n" for e in big.split(b"\n\n") if e])
    assert expected.known
    for cut in range(1, len(big)):
        assert metered(preset, path, None, [big[:cut], big[cut:]]) == expected, cut
    for cut in range(1, len(big) - 40, 7):  # and in three pieces
        parts = [big[:cut], big[cut:cut + 40], big[cut + 40:]]
        assert metered(preset, path, None, parts) == expected, cut


def test_held_chunks_are_copied_from_reused_buffers() -> None:
    """The meter holds chunks until HOLD bytes arrive: a buffer the engine reuses for
    the next read must not change what it holds."""
    data = (DATA / "openai_chat_stream_usage.sse").read_bytes()
    meter = Meter("openai", "m")
    buffer = bytearray()
    for i in range(0, len(data), 50):
        buffer[:] = data[i:i + 50]
        meter.feed(buffer)  # (what a careless engine might pass)
    buffer[:] = b"x" * 50
    assert meter.finish(200) == metered("openai", CHAT, None, [data])


def _event(kind: str, **fields: object) -> bytes:
    return json.dumps({"type": kind, "event_id": "ev_1", **fields}).encode()


def _done(n_in: int, n_out: int, cached: int) -> bytes:
    """A ``response.done`` server event as the Realtime API documents it."""
    return _event("response.done", response={
        "object": "realtime.response", "id": "resp_1", "status": "completed",
        "output": [{"type": "message", "role": "assistant",
                    "content": [{"type": "audio", "transcript": "Hello"}]}],
        "usage": {"total_tokens": n_in + n_out, "input_tokens": n_in, "output_tokens": n_out,
                  "input_token_details": {"cached_tokens": cached, "text_tokens": n_in,
                                          "audio_tokens": 0,
                                          "cached_tokens_details": {"text_tokens": cached}},
                  "output_token_details": {"text_tokens": n_out, "audio_tokens": 0}}})


def test_realtime_session_usage_adds_up_over_its_responses() -> None:
    """Each response.done reports its own response; the session's usage is their sum,
    under the session's model; other events (audio deltas...) are skipped unparsed."""
    meter = meter_for("openai", "GET", "/v1/realtime?model=gpt-realtime", None)
    assert isinstance(meter, SessionMeter) and meter.request_model == "gpt-realtime"
    assert meter.format == "realtime"
    meter.feed(_event("session.created", session={"model": "gpt-realtime-2025-08-28"}))
    for n in range(3):
        meter.feed(_event("response.audio.delta", delta="AAAA" * 100))
        meter.feed(_done(100 + n, 20, 64 * n))
    meter.feed(_event("response.done", response={"status": "cancelled", "usage": None}))
    meter.feed(b'{"type": "response.done", "response": {"usage"')  # cut: skipped
    meter.feed(_done(1, 2, 0))  # ...and the session's later events still count
    assert meter.finish(101) == Usage("gpt-realtime-2025-08-28", 304, 62, 192)


@pytest.mark.parametrize("events", [
    [],  # the upgrade was refused upstream, or the session ended at once
    [b"not json", b'{"type": "response.done"', b'["response.done"]', b"\xff\"response.done\""],
    [_event("response.done", response="x"), _event("session.created", session=[1])],
])
def test_realtime_session_without_usage_is_unknown(events: list[bytes]) -> None:
    meter = RealtimeMeter("gpt-realtime")
    for event in events:
        meter.feed(event)
    assert meter.finish(101) == Usage("gpt-realtime")


def test_bedrock_usage_from_the_body_or_the_headers() -> None:
    """Converse answers `usage` in camelCase; InvokeModel answers the model's own body
    (Claude's: Anthropic's usage) and, for every model, the token counts in headers."""
    converse = meter_for(None, "POST", "/model/anthropic.claude-3-5-sonnet-v2:0/converse",
                         b'{"messages": []}')
    assert converse is not None
    converse.feed(b'{"output": {}, "stopReason": "end_turn", "usage": {"inputTokens": 12, '
                  b'"outputTokens": 30, "totalTokens": 42, "cacheReadInputTokens": 4, '
                  b'"cacheWriteInputTokens": 2}}')
    assert converse.finish(200) == Usage("anthropic.claude-3-5-sonnet-v2:0", 18, 30, 4)
    invoke = meter_for(None, "POST", "/model/meta.llama3-70b-instruct-v1:0/invoke", b"{}")
    assert invoke is not None
    headers = {"x-amzn-bedrock-input-token-count": "17",
               "x-amzn-bedrock-output-token-count": "5"}
    invoke.head(headers.get)
    invoke.feed(b'{"generation": "hi", "prompt_token_count": 17}')
    assert invoke.finish(200) == Usage("meta.llama3-70b-instruct-v1:0", 17, 5)
    claude = meter_for(None, "POST", "/model/anthropic.claude-v2/invoke", b"{}")
    assert claude is not None
    claude.feed(b'{"type": "message", "usage": {"input_tokens": 9, "output_tokens": 3}}')
    assert claude.finish(200) == Usage("anthropic.claude-v2", 9, 3, None)
