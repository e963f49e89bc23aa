"""The fake providers are real-shaped: the official `openai` and `anthropic` SDKs (and
httpx for Gemini) talk to them directly over TLS and read usage back; and the gateway's
meter, fed the same responses' raw bytes, reads the same usage."""

from __future__ import annotations

import gzip
import json
import time
import zlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anthropic
import brotli
import httpx
import httpx2
import openai
import pydantic
import pytest
from fakes.inference import REPLY, FakeInference
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from openai.types.responses import Response

from gateway.core.metering.endpoints import rewrite_request_body
from gateway.core.metering.usage import Usage, meter_for

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


def oai(fake: FakeInference, http2: httpx2.Client, key: str = KEY) -> openai.OpenAI:
    """The openai SDK, which (like anthropic's) takes an httpx2 client."""
    return openai.OpenAI(api_key=key, base_url=f"{fake.url}/v1", http_client=http2,
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


MESSAGES: list[ChatCompletionMessageParam] = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello to the metering tests"}]
N_IN = 2 + 6 + 2  # words of the messages + the cached tokens the fake reports
N_OUT = len(REPLY)
BEARER = {"authorization": f"Bearer {KEY}"}
ANTHROPIC = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


def test_openai_chat(fake: FakeInference, http: httpx.Client, http2: httpx2.Client) -> None:
    done = oai(fake, http2).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert done.choices[0].message.content == "".join(REPLY)
    assert done.model == "gpt-4o-mini-2025-01-01"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (N_IN, N_OUT)
    assert done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 2
    usage, _ = metered(http, fake, "openai", "/v1/chat/completions",
                       {"model": "gpt-4o-mini", "messages": MESSAGES}, BEARER)
    assert usage == Usage("gpt-4o-mini-2025-01-01", N_IN, N_OUT, 2)


def test_openai_chat_stream_with_and_without_usage(fake: FakeInference, http: httpx.Client,
                                                   http2: httpx2.Client) -> None:
    client = oai(fake, http2)
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


def test_openai_responses(fake: FakeInference, http: httpx.Client,
                          http2: httpx2.Client) -> None:
    client = oai(fake, http2)
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


def test_openai_embeddings_and_completions(fake: FakeInference, http: httpx.Client,
                                          http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    emb = client.embeddings.create(model="text-embedding-3-small", input=["one two", "three"])
    assert len(emb.data) == 2 and emb.usage.prompt_tokens == 3 + 2
    usage, _ = metered(http, fake, "openai", "/v1/embeddings",
                       {"model": "text-embedding-3-small", "input": ["one two", "three"]},
                       BEARER)
    assert usage == Usage("text-embedding-3-small-2025-01-01", 5, 0, None)
    legacy = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Say hi")
    assert legacy.usage is not None and legacy.usage.total_tokens == 4 + N_OUT


def test_openai_wrong_key_is_401(fake: FakeInference, http: httpx.Client,
                                 http2: httpx2.Client) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        oai(fake, http2, key="sandbox-token").chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    usage, _ = metered(http, fake, "openai", "/v1/chat/completions",
                       {"model": "gpt-4o-mini", "messages": MESSAGES},
                       {"authorization": "Bearer nope"})
    assert usage == Usage("gpt-4o-mini")


def test_azure_openai(fake: FakeInference, http2: httpx2.Client) -> None:
    client = openai.AzureOpenAI(api_key=KEY, azure_endpoint=fake.url,
                                api_version="2024-10-21", http_client=http2, max_retries=0)
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


# -- the Responses API: stored responses, background mode ---------------------------------

def test_responses_are_stored_under_unique_ids(fake: FakeInference,
                                               http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    first = client.responses.create(model="gpt-4.1", input="Say hello to the tests")
    second = client.responses.create(model="gpt-4.1", input="Say hello to the tests")
    assert first.id.startswith("resp_") and first.id != second.id
    # A retrieval of a foreground response answers it again, usage included (a meter
    # must not count it twice).
    again = client.responses.retrieve(first.id)
    assert (again.id, again.status, again.background) == (first.id, "completed", False)
    assert again.usage is not None and again.usage.input_tokens == 7
    assert again.output_text == "".join(REPLY)
    follow = client.responses.create(model="gpt-4.1", input="And again",
                                     previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    unstored = client.responses.create(model="gpt-4.1", input="Forget me", store=False)
    for rid in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(rid)
        assert info.value.status_code == 404
        assert info.value.body == {"message": f"Response with id '{rid}' not found.",
                                   "type": "invalid_request_error", "param": "response_id",
                                   "code": None}
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="gpt-4.1", input="x", previous_response_id="resp_nope")
    assert bad.value.code == "previous_response_not_found"


def test_responses_background_mode(fake: FakeInference, http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    queued = client.responses.create(model="gpt-4.1", input="Say hello to the tests",
                                     background=True)
    assert queued.id.startswith("resp_")
    assert (queued.status, queued.background, queued.usage, queued.output) == (
        "queued", True, None, [])
    first = client.responses.retrieve(queued.id)  # background_after=2: the 2nd retrieval
    assert (first.status, first.usage) == ("in_progress", None)
    done = client.responses.retrieve(queued.id)
    assert done.status == "completed" and done.output_text == "".join(REPLY)
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens,
            done.usage.input_tokens_details.cached_tokens) == (7, N_OUT, 7 + N_OUT, 2)
    assert client.responses.retrieve(queued.id).status == "completed"  # and stays so
    assert [r.path for r in fake.requests[-4:]] == [
        "/v1/responses", *[f"/v1/responses/{queued.id}"] * 3]


def test_responses_background_stream(fake: FakeInference, http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    queued = client.responses.create(model="gpt-4.1", input="Say hello to the tests",
                                     background=True)
    events = list(client.responses.retrieve(queued.id, stream=True))
    assert [e.type for e in events[:3]] == ["response.created", "response.queued",
                                            "response.in_progress"]
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type == "response.completed" and last.response.usage is not None
    assert last.response.usage.output_tokens == N_OUT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "".join(REPLY)
    tail = list(client.responses.retrieve(queued.id, stream=True, starting_after=5))
    assert [e.sequence_number for e in tail] == list(range(6, len(events)))
    assert client.responses.retrieve(queued.id).status == "completed"  # streamed to its end
    # background + stream on the create: the same events at once.
    created = list(client.responses.create(model="gpt-4.1", input="Hi", background=True,
                                           stream=True))
    assert created[1].type == "response.queued" and created[-1].type == "response.completed"


def test_responses_background_after_seconds(fake: FakeInference, http2: httpx2.Client,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "background_after", timedelta(seconds=0.3))
    client = oai(fake, http2)
    queued = client.responses.create(model="gpt-4.1", input="Hi", background=True)
    assert [client.responses.retrieve(queued.id).status for _ in range(3)] == \
        ["in_progress"] * 3
    time.sleep(0.35)
    assert client.responses.retrieve(queued.id).status == "completed"
    # A stream follows a response to its end.
    other = client.responses.create(model="gpt-4.1", input="Hi", background=True)
    started = time.monotonic()
    events = list(client.responses.retrieve(other.id, stream=True))
    assert time.monotonic() - started >= 0.2
    assert events[-1].type == "response.completed"


def test_responses_cancel(fake: FakeInference, http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    queued = client.responses.create(model="gpt-4.1", input="Hi", background=True)
    cancelled = client.responses.cancel(queued.id)
    assert (cancelled.status, cancelled.usage) == ("cancelled", None)
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # idempotent
    foreground = client.responses.create(model="gpt-4.1", input="Hi")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    client.responses.delete(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(foreground.id)


# -- the OpenAI Batch API -------------------------------------------------------------------

def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def test_openai_batch(fake: FakeInference, http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": text}]}}
             for i, (model, text) in enumerate([("gpt-4o-mini", "one two three"),
                                                ("gpt-4.1", "four five")])]
    upload = client.files.create(file=("batch.jsonl", _jsonl(lines)), purpose="batch")
    assert upload.id.startswith("file-") and upload.purpose == "batch"
    assert upload.bytes == len(_jsonl(lines)) and upload.filename == "batch.jsonl"
    assert client.files.retrieve(upload.id).id == upload.id
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.id.startswith("batch_") and batch.status == "validating"
    assert batch.output_file_id is None and batch.metadata == {"job": "nightly"}
    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress" and running.request_counts is not None
    assert (running.request_counts.total, running.request_counts.completed) == (2, 0)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    assert done.request_counts is not None and done.request_counts.completed == 2
    n_in = (3 + 2) + (2 + 2)  # words + cached_tokens, each request
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.input_tokens_details.cached_tokens,
            done.usage.output_tokens, done.usage.output_tokens_details.reasoning_tokens,
            done.usage.total_tokens) == (n_in, 4, 2 * N_OUT, 0, n_in + 2 * N_OUT)
    output = [json.loads(line) for line in client.files.content(done.output_file_id)
              .text.splitlines()]
    assert [o["custom_id"] for o in output] == ["req-0", "req-1"]
    for o, model in zip(output, ["gpt-4o-mini-2025-01-01", "gpt-4.1-2025-01-01"],
                        strict=True):
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["request_id"].startswith("req_")
        completion = ChatCompletion.model_validate(o["response"]["body"])
        assert completion.model == model and completion.usage is not None
        assert completion.usage.completion_tokens == N_OUT
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list()]


def test_openai_batch_of_responses_cancel_and_invalid(fake: FakeInference,
                                                      http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    good = client.files.create(file=("r.jsonl", _jsonl([
        {"custom_id": "a", "method": "POST", "url": "/v1/responses",
         "body": {"model": "gpt-4.1", "input": "Say hello"}}])), purpose="batch")
    batch = client.batches.create(input_file_id=good.id, endpoint="/v1/responses",
                                  completion_window="24h")
    client.batches.retrieve(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.usage is not None and (done.usage.input_tokens, done.usage.output_tokens) \
        == (2 + 2, N_OUT)
    [line] = client.files.content(str(done.output_file_id)).text.splitlines()
    assert Response.model_validate(json.loads(line)["response"]["body"]).usage is not None

    other = client.batches.create(input_file_id=good.id, endpoint="/v1/responses",
                                  completion_window="24h")
    assert client.batches.cancel(other.id).status == "cancelling"
    cancelled = client.batches.retrieve(other.id)
    assert cancelled.status == "cancelled" and cancelled.output_file_id is None
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(batch.id)  # completed

    wrong = client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # lines for another endpoint
    failed = client.batches.retrieve(wrong.id)
    assert failed.status == "failed" and failed.errors is not None
    assert failed.errors.data and "url /v1/chat/completions" in str(failed.errors.data[0])
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_unknown")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-unknown", endpoint="/v1/responses",
                              completion_window="24h")


# -- Anthropic Message Batches -------------------------------------------------------------

def test_anthropic_message_batches(fake: FakeInference, http2: httpx2.Client) -> None:
    client = claude(fake, http2)
    created = client.messages.batches.create(requests=[
        {"custom_id": "opus", "params": {"model": "claude-opus-4-1-20250805",
                                         "max_tokens": 100, "messages": [
                                             {"role": "user", "content": "Say hello now"}]}},
        {"custom_id": "haiku", "params": {"model": "claude-haiku-4-5", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "Hi"}]}},
    ])
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert created.request_counts.processing == 2
    ended = client.messages.batches.retrieve(created.id)
    assert ended.processing_status == "in_progress"
    ended = client.messages.batches.retrieve(created.id)
    assert ended.processing_status == "ended" and ended.ended_at is not None
    assert ended.results_url == f"{fake.url}/v1/messages/batches/{created.id}/results"
    assert ended.request_counts.succeeded == 2 and ended.request_counts.processing == 0
    results = {r.custom_id: r.result for r in client.messages.batches.results(created.id)}
    opus, haiku = results["opus"], results["haiku"]
    assert opus.type == "succeeded" and haiku.type == "succeeded"
    assert opus.message.model == "claude-opus-4-1-20250805"
    assert (opus.message.usage.input_tokens, opus.message.usage.cache_read_input_tokens,
            opus.message.usage.output_tokens) == (3, 2, N_OUT)
    assert haiku.message.model == "claude-haiku-4-5"
    assert (haiku.message.usage.output_tokens, haiku.message.stop_reason) == (2, "max_tokens")
    assert opus.message.usage.service_tier == "batch"
    assert created.id in [b.id for b in client.messages.batches.list()]
    results_get = fake.requests[-2]  # (this SDK sends the key as a Bearer token)
    assert results_get.path == f"/v1/messages/batches/{created.id}/results"
    assert results_get.headers["authorization"] == f"Bearer {KEY}"
    assert results_get.headers["anthropic-version"]


def test_anthropic_message_batch_cancel_errors_and_auth(fake: FakeInference,
                                                        http2: httpx2.Client) -> None:
    client = claude(fake, http2)
    batch = client.messages.batches.create(requests=[
        {"custom_id": "a", "params": {"model": "claude-opus-4-1-20250805", "max_tokens": 5,
                                      "messages": [{"role": "user", "content": "Hi"}]}}])
    assert client.messages.batches.cancel(batch.id).processing_status == "canceling"
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.request_counts.canceled == 1
    assert [r.result.type for r in client.messages.batches.results(batch.id)] == ["canceled"]
    client.messages.batches.delete(batch.id)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    with pytest.raises(anthropic.AuthenticationError):
        claude(fake, http2, key="sandbox-token").messages.batches.retrieve("msgbatch_x")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=[])


# -- provider-minted secrets ------------------------------------------------------------------

def test_minted_client_secrets(fake: FakeInference, http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    before = time.time()
    secret = client.realtime.client_secrets.create(
        session={"type": "realtime", "model": "gpt-realtime", "instructions": "Be brief."})
    assert secret.value.startswith("ek_") and fake.minted[-1] == secret.value
    assert before + 600 - 1 <= secret.expires_at <= time.time() + 600
    assert secret.session.type == "realtime" and secret.session.model == "gpt-realtime"
    assert secret.session.instructions == "Be brief."
    transcription = client.realtime.client_secrets.create(
        session={"type": "transcription"}, expires_after={"anchor": "created_at",
                                                          "seconds": 30})
    assert transcription.session.type == "transcription"
    assert transcription.expires_at <= time.time() + 30
    session = client.beta.realtime.sessions.create(model="gpt-4o-realtime-preview")
    assert session.client_secret.value.startswith("ek_")
    assert session.client_secret.expires_at <= time.time() + 60
    tsession = client.beta.realtime.transcription_sessions.create()
    assert tsession.client_secret.value == fake.minted[-1]
    assert fake.minted[-4:] == [secret.value, transcription.value,
                                session.client_secret.value, tsession.client_secret.value]

    # A live minted secret is taken where the key is; it cannot mint; expired: 401.
    ephemeral = oai(fake, http2, key=secret.value)
    done = ephemeral.responses.create(model="gpt-4.1", input="Say hello to the tests")
    assert done.usage is not None and done.usage.input_tokens == 7
    with pytest.raises(openai.AuthenticationError):
        ephemeral.realtime.client_secrets.create()
    expired = client.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 0})
    with pytest.raises(openai.AuthenticationError):
        oai(fake, http2, key=expired.value).responses.create(model="gpt-4.1", input="Hi")


# -- request bodies as servers read them; Azure's api-version; output token limits ----------

@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "gzip, br"])
def test_encoded_request_bodies_are_decoded(fake: FakeInference, http: httpx.Client,
                                            coding: str) -> None:
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES}).encode()
    raw = body
    for name in [c.strip() for c in coding.split(",")]:
        raw = {"gzip": gzip.compress, "deflate": zlib.compress,
               "br": brotli.compress}[name](raw)
    answer = http.post(f"{fake.url}/v1/chat/completions", content=raw, headers={
        **BEARER, "content-type": "application/json", "content-encoding": coding})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == N_IN
    seen = fake.requests[-1]
    assert (seen.body, seen.decoded) == (raw, body)
    assert seen.json()["model"] == "gpt-4o-mini"


def test_unsupported_or_broken_encodings_and_chunked_bodies(fake: FakeInference,
                                                            http: httpx.Client) -> None:
    body = json.dumps({"model": "gpt-4o-mini", "messages": MESSAGES}).encode()
    answer = http.post(f"{fake.url}/v1/chat/completions", content=body, headers={
        **BEARER, "content-type": "application/json", "content-encoding": "zstd"})
    assert answer.status_code == 415
    assert answer.json()["error"]["code"] == "unsupported_content_encoding"
    assert fake.requests[-1].decoded is None
    answer = http.post(f"{fake.url}/v1/messages", content=b"not gzip", headers={
        **ANTHROPIC, "content-type": "application/json", "content-encoding": "gzip"})
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"
    chunked = http.post(f"{fake.url}/v1/chat/completions", content=iter([body[:10], body[10:]]),
                        headers={**BEARER, "content-type": "application/json"})
    assert chunked.status_code == 200
    assert fake.requests[-1].headers["transfer-encoding"] == "chunked"
    assert fake.requests[-1].body == body


@pytest.mark.parametrize(("version", "refused"), [
    ("2024-06-01", True), ("2024-08-01-preview", True), ("2024-09-01-preview", False),
    ("2024-10-21", False)])
def test_azure_refuses_stream_options_before_2024_09_01(fake: FakeInference,
                                                        http2: httpx2.Client, version: str,
                                                        refused: bool) -> None:
    client = openai.AzureOpenAI(api_key=KEY, azure_endpoint=fake.url, api_version=version,
                                http_client=http2, max_retries=0)
    if not refused:
        chunks = list(client.chat.completions.create(
            model="prod-4o", messages=MESSAGES, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None
        return
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="prod-4o", messages=MESSAGES, stream=True,
                                       stream_options={"include_usage": True})
    assert info.value.body == {"code": "BadRequest", "message":
                               "Unrecognized request argument supplied: stream_options"}
    assert list(client.chat.completions.create(model="prod-4o", messages=MESSAGES,
                                               stream=True))  # without: fine


def test_output_tokens_override_and_max_tokens(fake: FakeInference, http: httpx.Client,
                                               http2: httpx2.Client,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "output_tokens", 6000)
    client = oai(fake, http2)
    big = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert big.usage is not None and big.usage.completion_tokens == 6000
    assert big.choices[0].finish_reason == "stop"
    usage, _ = metered(http, fake, "openai", "/v1/chat/completions",
                       {"model": "gpt-4o-mini", "messages": MESSAGES}, BEARER)
    assert usage == Usage("gpt-4o-mini-2025-01-01", N_IN, 6000, 2)
    capped = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES,
                                            max_completion_tokens=100)
    assert capped.usage is not None and capped.usage.completion_tokens == 100
    assert capped.choices[0].finish_reason == "length"
    legacy = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES,
                                            max_tokens=50)
    assert legacy.usage is not None and legacy.usage.completion_tokens == 50
    response = client.responses.create(model="gpt-4.1", input="Hi", max_output_tokens=300)
    assert response.usage is not None and response.usage.output_tokens == 300
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model="gpt-4.1", input="Hi", stream=True,
                                          max_output_tokens=300))
    assert events[-1].type == "response.incomplete"
    message = claude(fake, http2).messages.create(
        model="claude-opus-4-1-20250805", max_tokens=1000,
        messages=[{"role": "user", "content": "Hi"}])
    assert (message.usage.output_tokens, message.stop_reason) == (1000, "max_tokens")
    monkeypatch.setattr(fake, "output_tokens", None)
    short = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES,
                                           max_tokens=2)
    assert short.choices[0].message.content == "The fake"
    assert short.usage is not None and short.usage.completion_tokens == 2
    gemini = http.post(f"{fake.url}/v1beta/models/gemini-2.0-flash:generateContent",
                       headers={"x-goog-api-key": KEY},
                       json={"contents": [{"parts": [{"text": "Hi"}]}],
                             "generationConfig": {"maxOutputTokens": 3}}).json()
    assert gemini["usageMetadata"]["candidatesTokenCount"] == 3
    assert gemini["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_objects_validate_strictly_against_the_sdk_types(fake: FakeInference,
                                                         http: httpx.Client) -> None:
    """The SDKs parse leniently; their pydantic models, validating, name every field
    they require: each new object has them."""
    from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
    from openai.types import Batch, FileObject
    from openai.types.beta.realtime import SessionCreateResponse, TranscriptionSession
    from openai.types.realtime import ClientSecretCreateResponse

    def post(path: str, **kw: Any) -> Any:
        answer = http.post(fake.url + path, **kw)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def get(path: str, headers: dict[str, str] = BEARER) -> Any:
        answer = http.get(fake.url + path, headers=headers)
        assert answer.status_code == 200, answer.text
        return answer.json()

    queued = post("/v1/responses", headers=BEARER,
                  json={"model": "gpt-4.1", "input": "Hi", "background": True})
    for view in (queued, get(f"/v1/responses/{queued['id']}"),
                 get(f"/v1/responses/{queued['id']}")):
        Response.model_validate(view)
    upload = post("/v1/files", headers=BEARER, data={"purpose": "batch"}, files={
        "file": ("b.jsonl", _jsonl([{"custom_id": "x", "method": "POST",
                                     "url": "/v1/embeddings",
                                     "body": {"model": "text-embedding-3-small",
                                              "input": "a b"}}]))})
    FileObject.model_validate(upload)
    batch = post("/v1/batches", headers=BEARER, json={
        "input_file_id": upload["id"], "endpoint": "/v1/embeddings",
        "completion_window": "24h"})
    for view in (batch, get(f"/v1/batches/{batch['id']}"), get(f"/v1/batches/{batch['id']}")):
        Batch.model_validate(view)
    assert view["usage"]["input_tokens"] == 2 + 2 and view["usage"]["output_tokens"] == 0
    kinds: list[tuple[str, type[pydantic.BaseModel]]] = [
        ("client_secrets", ClientSecretCreateResponse), ("sessions", SessionCreateResponse),
        ("transcription_sessions", TranscriptionSession)]
    for kind, model in kinds:
        model.model_validate(post(f"/v1/realtime/{kind}", headers=BEARER, json={}))
    ClientSecretCreateResponse.model_validate(post(
        "/v1/realtime/client_secrets", headers=BEARER,
        json={"session": {"type": "transcription"}}))
    mb = post("/v1/messages/batches", headers=ANTHROPIC, json={"requests": [
        {"custom_id": "ok", "params": {"model": "claude-sonnet-4-5", "max_tokens": 9,
                                       "messages": [{"role": "user", "content": "Hi"}]}},
        {"custom_id": "bad", "params": {"model": "claude-sonnet-4-5",
                                        "messages": [{"role": "user", "content": "Hi"}]}}]})
    for view in (mb, get(f"/v1/messages/batches/{mb['id']}", ANTHROPIC),
                 get(f"/v1/messages/batches/{mb['id']}", ANTHROPIC)):
        MessageBatch.model_validate(view)
    assert view["request_counts"] == {"processing": 0, "succeeded": 1, "errored": 1,
                                      "canceled": 0, "expired": 0}
    lines = http.get(view["results_url"], headers=ANTHROPIC).text.splitlines()
    results = [MessageBatchIndividualResponse.model_validate_json(line) for line in lines]
    assert [r.result.type for r in results] == ["succeeded", "errored"]
