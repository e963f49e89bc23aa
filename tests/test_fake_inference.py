"""The fake providers are real-shaped: the official `openai` and `anthropic` SDKs (and
httpx for Gemini) talk to them directly over TLS and read usage back; and the gateway's
meter, fed the same responses' raw bytes, reads the same usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from fakes.inference import REPLY, FakeInference

from gateway.metering.endpoints import rewrite_request_body
from gateway.metering.usage import Usage, meter_for

KEY = "sk-fake-provider-key"


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInference]:
    with FakeInference(tmp_path_factory.mktemp("fake"), api_key=KEY,
                       cached_tokens=2) as server:
        yield server


@pytest.fixture
def http(fake: FakeInference) -> Iterator[httpx.Client]:
    with httpx.Client(verify=fake.client_context(), timeout=10) as client:
        yield client


@pytest.fixture
def http2(fake: FakeInference) -> Iterator[httpx2.Client]:
    """The anthropic SDK brings its own HTTP package (httpx2); it takes that client."""
    with httpx2.Client(verify=fake.client_context(), timeout=10) as client:
        yield client


def oai(fake: FakeInference, http: httpx.Client, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{fake.url}/v1", http_client=http,
                         max_retries=0)


def claude(fake: FakeInference, http2: httpx2.Client, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=fake.url, max_retries=0,
                               http_client=http2)


def metered(http: httpx.Client, fake: FakeInference, preset: str, path: str,
            body: dict[str, Any], headers: dict[str, str]) -> tuple[Usage, bytes]:
    """What the meter reads from the fake's raw response bytes (as a proxy relays them)."""
    raw = json.dumps(body).encode()
    meter = meter_for(preset, "POST", path, raw)
    assert meter is not None
    seen = b""
    with http.stream("POST", fake.url + path, content=raw,
                     headers={"content-type": "application/json", **headers}) as response:
        for chunk in response.iter_raw():
            seen += chunk
            meter.feed(chunk)
        return meter.finish(response.status_code), seen


MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello to the metering tests"}]
N_IN = 2 + 6 + 2  # words of the messages + the cached tokens the fake reports
N_OUT = len(REPLY)
BEARER = {"authorization": f"Bearer {KEY}"}
ANTHROPIC = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


def test_openai_chat(fake: FakeInference, http: httpx.Client) -> None:
    done = oai(fake, http).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert done.choices[0].message.content == "".join(REPLY)
    assert done.model == "gpt-4o-mini-2025-01-01"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (N_IN, N_OUT)
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 2
    usage, _ = metered(http, fake, "openai", "/v1/chat/completions",
                       {"model": "gpt-4o-mini", "messages": MESSAGES}, BEARER)
    assert usage == Usage("gpt-4o-mini-2025-01-01", N_IN, N_OUT, 2)


def test_openai_chat_stream_with_and_without_usage(fake: FakeInference,
                                                   http: httpx.Client) -> None:
    client = oai(fake, http)
    chunks = list(client.chat.completions.create(
        model="gpt-4o-mini", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(
        REPLY)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == N_OUT
    plain = list(client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES,
                                                stream=True))
    assert all(c.usage is None for c in plain)
    body = {"model": "gpt-4o-mini", "messages": MESSAGES, "stream": True}
    usage, _ = metered(http, fake, "openai", "/v1/chat/completions", body, BEARER)
    assert usage == Usage("gpt-4o-mini", None, None, None)  # no usage was sent
    # What the gateway does about it: the rewritten request makes the stream end with usage.
    rewritten = rewrite_request_body("openai", "/v1/chat/completions",
                                     json.dumps(body).encode())
    assert rewritten is not None
    usage, raw = metered(http, fake, "openai", "/v1/chat/completions",
                         json.loads(rewritten), BEARER)
    assert usage == Usage("gpt-4o-mini-2025-01-01", N_IN, N_OUT, 2)
    assert raw.rstrip().endswith(b"data: [DONE]")


def test_openai_responses(fake: FakeInference, http: httpx.Client) -> None:
    client = oai(fake, http)
    response = client.responses.create(model="gpt-4.1", input="Say hello to the tests")
    assert response.output_text == "".join(REPLY)
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (5 + 2, N_OUT)
    events = list(client.responses.create(model="gpt-4.1", input="Say hello to the tests",
                                          stream=True))
    assert events[0].type == "response.created"
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage is not None
    assert completed.response.usage.input_tokens_details.cached_tokens == 2
    for stream in (False, True):
        usage, _ = metered(http, fake, "openai", "/v1/responses",
                           {"model": "gpt-4.1", "input": "Say hello to the tests",
                            "stream": stream}, BEARER)
        assert usage == Usage("gpt-4.1-2025-01-01", 7, N_OUT, 2)


def test_openai_embeddings_and_completions(fake: FakeInference, http: httpx.Client) -> None:
    client = oai(fake, http)
    emb = client.embeddings.create(model="text-embedding-3-small", input=["one two", "three"])
    assert len(emb.data) == 2 and emb.usage.prompt_tokens == 3 + 2
    usage, _ = metered(http, fake, "openai", "/v1/embeddings",
                       {"model": "text-embedding-3-small", "input": ["one two", "three"]},
                       BEARER)
    assert usage == Usage("text-embedding-3-small-2025-01-01", 5, 0, None)
    legacy = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Say hi")
    assert legacy.usage is not None and legacy.usage.total_tokens == 4 + N_OUT


def test_openai_wrong_key_is_401(fake: FakeInference, http: httpx.Client) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        oai(fake, http, key="sandbox-token").chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    usage, _ = metered(http, fake, "openai", "/v1/chat/completions",
                       {"model": "gpt-4o-mini", "messages": MESSAGES},
                       {"authorization": "Bearer nope"})
    assert usage == Usage("gpt-4o-mini")


def test_azure_openai(fake: FakeInference, http: httpx.Client) -> None:
    client = openai.AzureOpenAI(api_key=KEY, azure_endpoint=fake.url,
                                api_version="2024-10-21", http_client=http, max_retries=0)
    done = client.chat.completions.create(model="prod-4o", messages=MESSAGES)
    assert done.usage is not None and done.usage.prompt_tokens == N_IN
    assert fake.requests[-1].path.startswith("/openai/deployments/prod-4o/chat/completions")
    assert fake.requests[-1].headers["api-key"] == KEY


def test_anthropic_messages(fake: FakeInference, http: httpx.Client,
                            http2: httpx2.Client) -> None:
    client = claude(fake, http2)
    message = client.messages.create(model="claude-opus-4-1-20250805", max_tokens=100,
                                     messages=[{"role": "user", "content": "Say hello now"}])
    assert message.content[0].type == "text"
    assert message.usage.input_tokens == 3 and message.usage.cache_read_input_tokens == 2
    assert message.usage.output_tokens == N_OUT
    with client.messages.stream(model="claude-opus-4-1-20250805", max_tokens=100,
                                messages=[{"role": "user", "content": "Say hello now"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(REPLY)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (3, N_OUT)
    for stream in (False, True):
        usage, _ = metered(http, fake, "anthropic", "/v1/messages",
                           {"model": "claude-opus-4-1-20250805", "max_tokens": 100,
                            "messages": [{"role": "user", "content": "Say hello now"}],
                            "stream": stream}, ANTHROPIC)
        # Normalised: input counts the cached tokens too.
        assert usage == Usage("claude-opus-4-1-20250805", 5, N_OUT, 2)


def test_anthropic_wrong_key_is_401(fake: FakeInference, http2: httpx2.Client) -> None:
    with pytest.raises(anthropic.AuthenticationError) as info:
        claude(fake, http2, key="sandbox-token").messages.create(
            model="claude-opus-4-1-20250805", max_tokens=10,
            messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401
    assert "invalid x-api-key" in str(info.value)


@pytest.mark.parametrize("method", ["generateContent", "streamGenerateContent?alt=sse",
                                    "streamGenerateContent"])
def test_gemini(fake: FakeInference, http: httpx.Client, method: str) -> None:
    path = f"/v1beta/models/gemini-2.0-flash:{method}"
    body = {"contents": [{"role": "user", "parts": [{"text": "Say hello to Gemini"}]}]}
    usage, raw = metered(http, fake, "gemini", path, body, {"x-goog-api-key": KEY})
    assert usage == Usage("gemini-2.0-flash-001", 4 + 2, N_OUT, 2)
    if method == "streamGenerateContent?alt=sse":
        events = [json.loads(line[6:]) for line in raw.split(b"\r\n\r\n") if line]
        assert events[-1]["usageMetadata"]["candidatesTokenCount"] == N_OUT
    elif method == "streamGenerateContent":
        assert json.loads(raw)[-1]["usageMetadata"]["totalTokenCount"] == 6 + N_OUT
    # The key may also come as ?key=; without it: 401 in Google's shape.
    sep = "&" if "?" in path else "?"
    assert http.post(f"{fake.url}{path}{sep}key={KEY}", json=body).status_code == 200
    denied = http.post(f"{fake.url}{path}", json=body)
    assert denied.status_code == 401
    assert denied.json()["error"]["status"] == "UNAUTHENTICATED"


def test_requests_are_recorded(fake: FakeInference, tmp_path: Path) -> None:
    with httpx.Client(verify=fake.client_context()) as client:
        client.post(f"{fake.url}/v1/embeddings", json={"model": "m", "input": "x"},
                    headers=BEARER)
    seen = fake.requests[-1]
    assert (seen.method, seen.path, seen.status) == ("POST", "/v1/embeddings", 200)
    assert json.loads(seen.body) == {"model": "m", "input": "x"}
    assert seen.headers["authorization"] == f"Bearer {KEY}"
