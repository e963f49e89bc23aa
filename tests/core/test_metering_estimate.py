"""A call's bound (gateway/core/metering/estimate.py): what a provider may bill for a
request, read as the most generous provider would read it (issue 39: reservations that
are upper bounds, JSON numbers in every form)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core.metering.endpoints import Endpoint, body_json
from gateway.core.metering.estimate import (
    Unreadable,
    choices,
    hosted_tools,
    input_bound,
    number,
    output_bound,
    provider_state,
)

OPENAI = Endpoint("openai", None)
CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), (0, 0), (7, 7), (1e6, 1_000_000), (2.0, 2), (1.5, 2), ("8", 8),
    (" 16 ", 16), ("1e3", 1000), ("2.5", 3), (10**30, 10**30),
])
def test_number_reads_every_form_a_provider_coerces(value: Any, expected: int | None) -> None:
    assert number(value, "max_tokens") == expected


@pytest.mark.parametrize("value", [True, False, -1, -0.5, float("nan"), float("inf"), "lots",
                                   "NaN", "-3", "inf", [1], {"a": 1}, "9" * 41])
def test_number_refuses_what_no_provider_reads_as_a_count(value: Any) -> None:
    with pytest.raises(Unreadable, match="max_tokens"):
        number(value, "max_tokens")


def fields(doc: dict[str, Any]) -> dict[str, Any]:
    found = body_json(json.dumps(doc).encode())
    assert found is not None
    return found


@pytest.mark.parametrize(("doc", "model_max", "expected"), [
    # the largest limit among every field given, whatever the family
    ({"max_completion_tokens": 1, "max_tokens": 16000}, None, 16000),
    ({"max_completion_tokens": 1, "max_tokens": 16000}, 4096, 4096),  # capped by the model
    ({"max_tokens": 1e6}, 128000, 128000),
    ({"max_tokens": "900"}, None, 900),
    ({"max_tokens": 10, "n": "8"}, None, 80),
    ({"max_tokens": 10, "n": 2, "best_of": 5}, None, 50),
    ({"MAX_TOKENS": 500}, None, 500),  # a case-insensitive reader's (Go's) view
    ({"generationConfig": {"MaxOutputTokens": 500, "maxOutputTokens": 5}}, None, 500),
    ({"generationConfig": {"maxOutputTokens": 64, "candidateCount": 2}}, None, 128),
    ({"generation_config": {"max_output_tokens": 900}, "generationConfig":
      {"maxOutputTokens": 9}}, None, 900),
    ({"inferenceConfig": {"maxTokens": 33}, "max_gen_len": 50}, None, 50),
    ({"textGenerationConfig": {"maxTokenCount": 70}}, None, 70),
    ({"response": {"max_output_tokens": 300}}, None, 300),
    ({"max_response_output_tokens": "inf"}, 4096, 4096),
    ({"max_response_output_tokens": "inf"}, None, None),
    ({}, 16384, 16384),  # no limit: the model's maximum
    ({}, None, None),  # neither: unknown
    ({"max_tokens": None}, 100, 100),  # null is absent
])
def test_output_bound(doc: dict[str, Any], model_max: int | None,
                      expected: int | None) -> None:
    assert output_bound(OPENAI, fields(doc), CHAT, model_max) == expected


def test_output_bound_embeddings_and_unreadable_limits() -> None:
    assert output_bound(OPENAI, fields({"max_tokens": 9}), "/v1/embeddings", None) == 0
    for doc in ({"max_tokens": True}, {"max_tokens": "x"}, {"n": -2, "max_tokens": 1},
                {"generationConfig": {"maxOutputTokens": [1]}}):
        with pytest.raises(Unreadable):
            output_bound(OPENAI, fields(doc), CHAT, 1000)
    assert choices(None) == 1


@pytest.mark.parametrize(("doc", "why"), [
    ({"model": "m", "previous_response_id": "resp_1", "input": "hi"}, "previous_response_id"),
    ({"model": "m", "conversation": "conv_1"}, "conversation"),
    ({"model": "m", "prompt": {"id": "pmpt_1"}}, "stored"),
    ({"contents": [], "cachedContent": "cachedContents/x"}, "cachedContent"),
    ({"contents": [{"parts": [{"fileData": {"fileUri": "gs://b/f.pdf"}}]}]}, "fileData"),
    ({"input": [{"type": "input_file", "file_id": "file-1"}]}, "input_file"),
    ({"messages": [{"content": [{"type": "image_url",
                                 "image_url": {"url": "https://x.test/a.png"}}]}]}, "fetched"),
    ({"messages": [{"content": [{"type": "image", "source": {"type": "url",
                                                              "url": "https://x"}}]}]}, "url"),
    ({"messages": [{"content": [{"type": "document", "source": {"type": "file",
                                                                 "file_id": "f"}}]}]}, "file"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"model": "m", "Previous_Response_Id": "resp_1"}, "Previous_Response_Id"),
    ({"model": "m", "container": "cntr_1"}, "container"),
    ({"messages": [{"content": [{"document": {"source": {"s3Location": {"uri": "s3://b/k"}}}}]}]},
     "s3Location"),
    ({"contents": [{"parts": [{"FILE_DATA": {"FILE_URI": "gs://b/f"}}]}]}, "FILE_DATA"),
])
def test_provider_state_is_seen(doc: dict[str, Any], why: str) -> None:
    raw = json.dumps(doc).encode()
    found = provider_state(body_json(raw), raw)
    assert found is not None and why in found


def test_provider_state_escaped_keys_and_inlined_media() -> None:
    raw = b'{"model": "m", "previous\\u005fresponse_id": "resp_1"}'
    assert provider_state(body_json(raw), raw) is not None
    image = json.dumps({"messages": [{"content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + "A" * 4096}}]}]}).encode()
    found = provider_state(body_json(image), image)
    assert found is not None and "inlined media" in found
    plain = json.dumps({"model": "m", "messages": [{"role": "user", "content":
                        "see https://x.test and previous_response_id"}]}).encode()
    assert provider_state(body_json(plain), plain) is None  # (text, not a field)


@pytest.mark.parametrize(("doc", "expected"), [
    ({"tools": [{"type": "function", "name": "f"}]}, None),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, None),
    ({"tools": [{"type": "web_search"}]}, ("web_search", None)),
    ({"tools": [{"type": "web_search"}], "max_tool_calls": 3}, ("web_search", 3)),
    ({"tools": [{"type": "web_search_20250305", "max_uses": 5}]}, ("web_search_20250305", 5)),
    ({"tools": [{"googleSearch": {}}]}, ("googleSearch", None)),
    ({"mcp_servers": [{"url": "https://m"}]}, ("mcp_servers", None)),
])
def test_hosted_tools(doc: dict[str, Any], expected: tuple[str, int | None] | None) -> None:
    assert hosted_tools(fields(doc)) == expected


def test_input_bound() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a a a a"}]})
    body = raw.encode()
    assert input_bound(body, body_json(body), None).tokens == len(body)  # a token a byte
    assert input_bound(body, body_json(body), 10).tokens == 10  # capped by the context
    pretty = json.dumps(json.loads(raw), indent=4).encode()  # layout is no text
    assert input_bound(pretty, body_json(pretty), None).tokens < len(pretty)
    assert input_bound(pretty, body_json(pretty), None).tokens >= len(body) - 10
    chained = json.dumps({"model": "m", "previous_response_id": "r", "input": "x"}).encode()
    bound = input_bound(chained, body_json(chained), 128000)
    assert bound.tokens == 128000 and bound.why is not None
    assert input_bound(chained, body_json(chained), None).tokens is None  # no bound known
    tools = json.dumps({"tools": [{"type": "web_search"}], "max_tool_calls": 2}).encode()
    assert input_bound(tools, body_json(tools), 1000).tokens == 3000
    unbounded = json.dumps({"tools": [{"type": "web_search"}]}).encode()
    found = input_bound(unbounded, body_json(unbounded), 1000)
    assert found.tokens is None and found.why is not None and "max_tool_calls" in found.why
