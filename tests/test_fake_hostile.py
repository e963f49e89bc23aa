"""The hostile provider (tests/fakes/hostile_provider.py) bills as its docstring says and
answers in the providers' shapes: its pricing rules table by table, then the official
openai SDK and a `websockets` client against it over TLS (no gateway), each call's
reported usage equal to what its ledger billed."""

from __future__ import annotations

import json
import math
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import websockets.exceptions
import websockets.sync.client
from fakes.hostile_provider import (
    WS_HOST,
    Faults,
    HostileProvider,
    ModelLimits,
    number,
    output_limit,
)
from helpers import ws_client

GPT = ModelLimits(context_window=1000, max_output=300)
MODELS = {"gpt-4o-mini": GPT, "gpt-realtime": ModelLimits(500, 100)}


@pytest.mark.parametrize(("value", "read"), [
    (8, 8), (1e6, 1_000_000), ("8", 8), (" 16 ", 16), ("inf", math.inf), (16.7, 16),
    (0, None), (-3, None), (True, None), ("eight", None), (None, None), ([8], None),
])
def test_numbers_are_read_as_a_lenient_json_reader_reads_them(value: Any, read: Any) -> None:
    assert number(value) == read


@pytest.mark.parametrize(("doc", "defaults", "expected"), [
    ({}, None, (300, 1)),  # no limit: the model's max output
    ({"max_tokens": 50}, None, (50, 1)),
    ({"max_completion_tokens": 1, "max_tokens": 200}, None, (200, 1)),  # the largest
    ({"max_tokens": 1e6}, None, (300, 1)),  # never more than the model's max
    ({"generationConfig": {"maxOutputTokens": 1},
      "generation_config": {"max_output_tokens": 90}}, None, (90, 1)),
    ({"generationConfig": {"maxOutputTokens": "40", "candidateCount": "4"}}, None, (40, 4)),
    ({"max_tokens": 10, "n": "8"}, None, (10, 8)),
    ({"n": 1000}, None, (300, 16)),  # choices are capped
    ({"response": {"max_output_tokens": 20}}, {"max_output_tokens": "inf"}, (20, 1)),
    ({"response": {}}, {"max_response_output_tokens": 30}, (30, 1)),  # the session's
    ({"response": {}}, {"max_output_tokens": "inf"}, (300, 1)),
])
def test_output_is_the_largest_limit_of_any_field(doc: dict[str, Any],
                                                  defaults: dict[str, Any] | None,
                                                  expected: tuple[int, int]) -> None:
    assert output_limit(doc, GPT, defaults) == expected


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileProvider]:
    with HostileProvider(tmp_path_factory.mktemp("hostile"), MODELS, interval=0.0,
                         ws_parallel=4) as server:
        yield server


def _http(provider: HostileProvider) -> httpx.Client:
    """A client that reaches the provider's names at its port, trusting its CA."""
    ctx = ssl.create_default_context(cafile=str(provider.ca_path))
    transport = httpx.HTTPTransport(verify=ctx)
    return httpx.Client(transport=transport, base_url=f"https://127.0.0.1:{provider.port}",
                        headers={"Host": "api.openai.com"}, timeout=10)


def _sdk(provider: HostileProvider, key: str, http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"https://127.0.0.1:{provider.port}/v1",
                         http_client=http, max_retries=0)


def test_the_sdk_reads_what_the_ledger_billed(provider: HostileProvider) -> None:
    key = provider.new_key()
    with _http(provider) as http:
        sdk = _sdk(provider, key, http)
        answer = sdk.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=1, extra_body={"max_tokens": 200})
        assert answer.usage is not None and answer.usage.completion_tokens == 200
        first = answer.usage.total_tokens
        stream = sdk.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}], n=2,
            max_tokens=40, stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in stream if c.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 80  # two choices
        response = sdk.responses.create(model="gpt-4o-mini", input="hi", max_output_tokens=30)
        assert response.usage is not None and response.usage.output_tokens == 30
    billed = [b.tokens for b in provider.bills_of(key)]
    assert billed == [first, usage[0].total_tokens, response.usage.total_tokens]


def test_held_state_is_billed_up_to_the_context_window(provider: HostileProvider) -> None:
    key = provider.new_key()
    earlier = provider.hold_response(600)
    file = provider.hold_file(5000)  # more than the context window
    with _http(provider) as http:
        sdk = _sdk(provider, key, http)
        chained = sdk.responses.create(model="gpt-4o-mini", input="go on",
                                       previous_response_id=earlier, max_output_tokens=5)
        assert chained.usage is not None
        assert 600 < chained.usage.input_tokens < 600 + 300  # held + the body's bytes
        body = {"model": "gpt-4o-mini", "max_tokens": 5, "messages": [{"role": "user",
                "content": [{"type": "file", "file": {"file_id": file}}]}]}
        capped = http.post("/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}).json()
        assert capped["usage"]["prompt_tokens"] == 1000
        missing = http.post("/v1/chat/completions", json={**body, "messages": [{
            "role": "user", "content": [{"type": "file", "file": {"file_id": "file-x"}}]}]},
            headers={"Authorization": f"Bearer {key}"})
        assert missing.status_code == 404
    assert provider.billed(key) == chained.usage.total_tokens + capped["usage"]["total_tokens"]


def test_the_router_is_lenient_and_faults_bill_what_ran(provider: HostileProvider) -> None:
    key = provider.new_key()
    body = json.dumps({"model": "gpt-4o-mini", "max_tokens": 50,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    auth = {"Authorization": f"Bearer {key}"}
    with _http(provider) as http:
        for method, path in (("PUT", "/v1/chat/completions"), ("PATCH", "//v1/chat/completions"),
                             ("POST", "/V1/CHAT/COMPLETIONS;v=1")):
            answer = http.request(method, path, content=body, headers=auth)
            assert answer.json()["usage"]["completion_tokens"] == 50, (method, path)
        assert http.post("/v1/chat/completions", content=body,
                         headers={"Authorization": "Bearer sk-other"}).status_code == 401
        assert len(provider.bills_of(key)) == 3
        failing = provider.new_key(Faults(refuse_5xx=1.0))
        assert http.post("/v1/chat/completions", content=body, headers={
            "Authorization": f"Bearer {failing}"}).status_code == 503
        errors = provider.new_key(Faults(error_after_tokens=1.0))
        streamed = http.post("/v1/chat/completions", content=body.replace(
            b'"max_tokens"', b'"stream": true, "max_tokens"'), headers={
            "Authorization": f"Bearer {errors}"})
        assert b'"server_error"' in streamed.content and b"[DONE]" not in streamed.content
    assert provider.billed(failing) == 0
    [bill] = provider.bills_of(errors)
    assert bill.output == 50 * 3 // 4  # what it generated before the error


def _ws(provider: HostileProvider, key: str, path: str
        ) -> websockets.sync.client.ClientConnection:
    ctx = ssl.create_default_context(cafile=str(provider.ca_path))
    return ws_client.connect(
        f"wss://127.0.0.1:{provider.ws_port}{path}", ssl=ctx, server_hostname=WS_HOST,
        additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=10)


def test_websocket_responses_run_in_parallel_and_bill_their_usage(
        provider: HostileProvider) -> None:
    key = provider.new_key()
    done: list[dict[str, Any]] = []
    with _ws(provider, key, "/v1/realtime?model=gpt-realtime") as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
        for _ in range(3):
            ws.send(json.dumps({"type": "response.create", "response": {
                "conversation": "none", "input": [], "max_output_tokens": 1000}}))
        while len(done) < 3:
            event = json.loads(ws.recv(timeout=5))
            if event["type"] == "response.done":
                done.append(event["response"]["usage"])
    assert [u["output_tokens"] for u in done] == [100] * 3  # the model's max output
    completed: list[dict[str, Any]] = []
    with _ws(provider, key, "/v1/responses") as ws:
        ws.send(json.dumps({"type": "response.create", "model": "gpt-4o-mini",
                            "input": "hi", "max_output_tokens": 7}))
        while not completed:
            event = json.loads(ws.recv(timeout=5))
            if event["type"] == "response.completed":
                completed.append(event["response"]["usage"])
    assert completed[0]["output_tokens"] == 7
    assert provider.billed(key) == sum(u["total_tokens"] for u in [*done, *completed])


def test_an_unknown_key_cannot_open_a_session(provider: HostileProvider) -> None:
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        _ws(provider, "sk-nobody", "/v1/responses")
    assert refused.value.response.status_code == 401
