"""The WebSocket fake (tests/fakes/realtime.py) is real-shaped: the openai SDK's
`client.responses.connect()` (the Responses API over WebSocket) and
`client.realtime.connect()` talk to it over TLS, with the API key or a secret the HTTP
fake minted, and read the events and usage back; alone, it still accepts any upgrade."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import websockets.exceptions
from fakes.inference import REPLY, FakeInference
from fakes.realtime import SNAPSHOT, FakeRealtime
from helpers import ws_client
from helpers.tls import LocalCA
from openai.types.realtime import RealtimeSessionCreateRequest
from openai.types.responses import ResponsesServerEvent

KEY = "sk-fake-provider-key"
N_OUT = len(REPLY)


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInference]:
    with FakeInference(tmp_path_factory.mktemp("fake"), api_key=KEY, cached_tokens=2,
                       websocket=True) as server:
        yield server


@pytest.fixture
def http2(fake: FakeInference) -> Iterator[httpx2.Client]:
    with httpx2.Client(verify=fake.client_context(), timeout=10) as client:
        yield client


def oai(fake: FakeInference, http2: httpx2.Client, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{fake.url}/v1", http_client=http2,
                         websocket_base_url=fake.ws_url, max_retries=0)


def ws_options(fake: FakeInference) -> Any:
    """Options the SDK passes through to websockets' `connect` (outside its TypedDict):
    the fake's CA, and `legacy=True`: the SDK calls `connect()` without a `with`, which
    websockets >= 17.1 warns about (a DeprecationWarning: an error in this suite)."""
    return {"ssl": fake.client_context(), "open_timeout": 5, "legacy": True}


def until(events: Iterator[ResponsesServerEvent], kind: str) -> list[ResponsesServerEvent]:
    seen = []
    for event in events:
        seen.append(event)
        if event.type == kind:
            return seen
    raise AssertionError(f"the connection ended before {kind}")


def test_responses_over_websocket(fake: FakeInference, http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    with client.responses.connect(websocket_connection_options=ws_options(fake)) as conn:
        conn.response.create(model="gpt-4.1", input="Say hello to the tests",
                             stream_id="lane-1")
        first = until(iter(conn), "response.completed")
        done = first[-1]
        assert done.type == "response.completed"
        conn.response.create(model="gpt-4.1", input="And once more",
                             previous_response_id=done.response.id,
                             max_output_tokens=2)
        second = until(iter(conn), "response.incomplete")
    assert [e.type for e in first] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * N_OUT,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in first] == list(range(len(first)))
    assert {e.stream_id for e in first} == {"lane-1"}
    assert done.response.usage is not None
    usage = done.response.usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens,
            usage.output_tokens, usage.total_tokens) == (5 + 2, 2, N_OUT, 7 + N_OUT)
    assert done.response.model == "gpt-4.1-2025-01-01"
    assert done.response.output_text == "".join(REPLY)
    assert {e.stream_id for e in second} == {None}
    last = second[-1]
    assert last.type == "response.incomplete" and last.response.usage is not None
    assert last.response.usage.output_tokens == 2
    assert last.response.previous_response_id == done.response.id
    # Stored like an HTTP response: retrievable (already metered) over HTTP.
    again = client.responses.retrieve(done.response.id)
    assert again.usage is not None and again.usage.output_tokens == N_OUT

    [record] = [c for c in fake.ws.connections if c.path == "/v1/responses"]  # type: ignore[union-attr]
    assert record.headers["authorization"] == f"Bearer {KEY}"
    assert [e["type"] for e in record.received] == ["response.create"] * 2
    assert record.received[0]["stream_id"] == "lane-1"
    assert record.sent[-1]["type"] == "response.incomplete"


def test_responses_websocket_errors_keep_the_socket_open(fake: FakeInference,
                                                         http2: httpx2.Client) -> None:
    client = oai(fake, http2)
    with client.responses.connect(websocket_connection_options=ws_options(fake)) as conn:
        conn.response.create(input="no model", stream_id="s1")
        conn.response.create(model="gpt-4.1", input="later", background=True)
        conn.response.create(model="gpt-4.1", input="x", previous_response_id="resp_nope")
        conn.send_raw("not json")
        errors = [conn.recv() for _ in range(4)]
        conn.response.create(model="gpt-4.1", input="still open")
        ok = until(iter(conn), "response.completed")
    assert [e.type for e in errors] == ["error"] * 4
    missing, background, previous, garbage = errors
    assert missing.type == "error" and missing.status == 400 and missing.stream_id == "s1"
    assert (missing.error.type, missing.error.code, missing.error.param) == (
        "invalid_request_error", "missing_required_parameter", "model")
    assert background.type == "error" and background.error.param == "background"
    assert background.stream_id is None
    assert previous.type == "error" and previous.error.code == "previous_response_not_found"
    assert garbage.type == "error" and garbage.error.code == "invalid_json"
    assert ok[-1].type == "response.completed"


def test_websocket_auth_takes_the_key_or_a_live_minted_secret(fake: FakeInference,
                                                              http2: httpx2.Client) -> None:
    assert fake.ws is not None
    secret = oai(fake, http2).realtime.client_secrets.create(
        session={"type": "realtime", "model": "gpt-realtime"})
    ephemeral = oai(fake, http2, key=secret.value)
    with ephemeral.responses.connect(websocket_connection_options=ws_options(fake)) as conn:
        conn.response.create(model="gpt-4.1", input="minted")
        assert until(iter(conn), "response.completed")[-1].type == "response.completed"
    assert fake.ws.upgrades[-1]["authorization"] == f"Bearer {secret.value}"
    sessions = len(fake.ws.upgrades)
    wrong = oai(fake, http2, key="sk-wrong").responses.connect(
        websocket_connection_options=ws_options(fake))
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        wrong.enter()
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body or b"{}")["error"]["code"] == \
        "invalid_api_key"
    assert len(fake.ws.upgrades) == sessions
    assert fake.ws.rejected[-1]["authorization"] == "Bearer sk-wrong"


def test_realtime_session_update(fake: FakeInference, http2: httpx2.Client) -> None:
    secret = oai(fake, http2).realtime.client_secrets.create()
    client = oai(fake, http2, key=secret.value)
    with client.realtime.connect(model="gpt-realtime",
                                 websocket_connection_options=ws_options(fake)) as conn:
        created = conn.recv()
        assert created.type == "session.created"
        assert isinstance(created.session, RealtimeSessionCreateRequest)
        assert created.session.model == "gpt-realtime" + SNAPSHOT
        conn.session.update(session={"type": "realtime", "model": "gpt-realtime-mini",
                                     "instructions": "Be brief."})
        updated = conn.recv()
        assert updated.type == "session.updated"
        assert isinstance(updated.session, RealtimeSessionCreateRequest)
        assert updated.session.model == "gpt-realtime-mini"
        assert updated.session.instructions == "Be brief."
        assert updated.session.to_dict()["id"] == "sess_1"  # (not a field of this type)
        conn.response.create()
        events = [conn.recv() for _ in range(3)]
    done = events[-1]
    assert done.type == "response.done" and done.response.usage is not None
    n_in, n_out, cached = FakeRealtime.usage(0)
    assert (done.response.usage.input_tokens, done.response.usage.output_tokens) == (n_in,
                                                                                    n_out)
    assert done.response.usage.input_token_details is not None
    assert done.response.usage.input_token_details.cached_tokens == cached


def test_alone_it_accepts_any_upgrade(tmp_path: Path) -> None:
    ca = LocalCA.create(tmp_path, name="ws CA")
    server = FakeRealtime(tmp_path / "ws", ca, ["127.0.0.1"])
    ctx = ssl.create_default_context(cafile=str(ca.cert_path))
    try:
        with ws_client.connect(
                f"wss://127.0.0.1:{server.port}/v1/realtime?model=gpt-realtime",
                ssl=ctx, additional_headers={"Authorization": "Bearer anything"}) as ws:
            assert json.loads(ws.recv(timeout=5))["type"] == "session.created"
            ws.send(json.dumps({"type": "response.create"}))
            kinds = [json.loads(ws.recv(timeout=5))["type"] for _ in range(3)]
            assert kinds == ["response.created", "response.audio_transcript.delta",
                             "response.done"]
        with ws_client.connect(f"wss://127.0.0.1:{server.port}/v1/responses",
                               ssl=ctx) as ws:
            ws.send(json.dumps({"type": "response.create", "model": "gpt-4.1",
                                "input": "one two"}))
            while (event := json.loads(ws.recv(timeout=5)))["type"] != "response.completed":
                pass
            usage = event["response"]["usage"]
            assert (usage["input_tokens"], usage["output_tokens"]) == (2, N_OUT)
        assert [u["authorization"] for u in server.upgrades[:1]] == ["Bearer anything"]
        assert [e["type"] for e in server.received] == ["response.create"] * 2
        assert server.rejected == []
    finally:
        server.stop()
