"""A local fake of the inference APIs the gateway meters, over TLS (HTTP/1.1).

It listens on 127.0.0.1:<random port> in background threads, behind a certificate from
a throwaway CA (``ca_path``) whose SANs are 127.0.0.1 and the providers' host names
(``api.openai.com``, ``api.anthropic.com``, ``generativelanguage.googleapis.com``,
``*.openai.azure.com``), so a gateway can reach it by name through
``network.resolve``. Responses copy the providers' documented shapes, usage included:

* OpenAI: ``POST /v1/chat/completions`` (JSON; SSE with a final usage chunk only when
  ``stream_options.include_usage`` is true, then ``[DONE]``), ``/v1/completions``,
  ``/v1/responses`` (JSON; SSE ``response.created`` ... ``response.completed`` with
  ``response.usage``), ``/v1/embeddings``; ``Authorization: Bearer <key>`` (or a live
  secret the fake minted, see below).

  - Responses are stored (unless ``store: false``) under unique ids:
    ``GET /v1/responses/{id}`` (``?stream=true[&starting_after=N]``: its SSE events),
    ``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``. With
    ``background: true`` the create answers at once ``status: queued``, ``usage: null``;
    retrievals answer ``in_progress`` until ``background_after`` (the n-th retrieval, or
    a ``timedelta`` after creation), then the finished response with its usage.
  - Batch API: ``POST /v1/files`` (multipart, ``purpose=batch``), ``GET /v1/files/{id}``,
    ``GET /v1/files/{id}/content``, ``POST /v1/batches``, ``GET /v1/batches[/{id}]``,
    ``POST /v1/batches/{id}/cancel``; a batch is ``validating`` when created,
    ``in_progress`` on retrievals until ``background_after``, then ``completed`` with an
    output file and ``usage`` summed over its requests.
  - Minted secrets (the real key only): ``POST /v1/realtime/client_secrets``,
    ``/v1/realtime/sessions``, ``/v1/realtime/transcription_sessions`` answer an
    ``ek_...`` value; until it expires it is accepted wherever the key is (``minted``).
* Azure OpenAI: ``/openai/deployments/{d}/chat/completions?api-version=...`` with
  ``api-key: <key>``, or ``Authorization: Bearer <Entra ID token>`` that ``entra``
  accepts (same bodies; ``model`` is the deployment's model); ``stream_options`` with an
  ``api-version`` before 2024-09-01 is refused (400) as Azure does.
* Anthropic: ``POST /v1/messages`` (JSON; SSE ``message_start`` ... ``message_stop``),
  Message Batches (``POST /v1/messages/batches``, ``GET /v1/messages/batches[/{id}]``,
  ``.../{id}/results`` (JSONL), ``.../{id}/cancel``, ``DELETE .../{id}``); ``x-api-key``
  (or Bearer) and ``anthropic-version`` required.
* Gemini: ``POST /v1beta/models/{m}:generateContent`` and ``:streamGenerateContent``
  (``?alt=sse``: SSE with CRLF line ends; without: a streamed JSON array), key in
  ``x-goog-api-key`` or ``?key=``.

A wrong or missing key gets 401 in the provider's error shape, an unknown id 404.
Request bodies may be chunked and ``Content-Encoding: gzip | deflate | br`` (decoded; any
other coding: 415). Token counts are deterministic: input = words of the request's text
(+ ``cached_tokens`` reported as the cached part when set), output = words of the reply
(or ``output_tokens`` when set), at most the request's ``max_tokens`` /
``max_completion_tokens`` / ``max_output_tokens`` / ``maxOutputTokens`` (then the reply
stops for length). Every request is recorded in ``requests``. With ``websocket=True`` a
WebSocket server (``fakes.realtime.FakeRealtime``: the Realtime API and the Responses
API over WebSocket) shares the fake's CA, counts, stored responses and minted secrets;
it has its own port (``ws_url``), and a WebSocket upgrade on the HTTP port (one host for
both, as the real API and the Codex CLI have it) is relayed to it.
"""

from __future__ import annotations

import gzip
import json
import re
import secrets
import select
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email import policy
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

import brotli
from helpers.tls import LocalCA

from fakes.http_body import read_body

if TYPE_CHECKING:
    from fakes.realtime import FakeRealtime

HOSTS = ["127.0.0.1", "localhost", "api.openai.com", "api.anthropic.com",
         "generativelanguage.googleapis.com", "*.openai.azure.com",
         # the agent CLIs' other hosts (tests/integration/test_agent_clis.py): 404s
         "chatgpt.com", "ab.chatgpt.com", "github.com", "api.github.com",
         "raw.githubusercontent.com", "models.opencode.ai", "pypi.org"]
REPLY = ["The", " fake", " provider", " answers."]
_GEMINI = re.compile(r"^/v1(?:beta)?/models/([^/:]+):(generateContent|streamGenerateContent)$")
_AZURE = re.compile(r"^/openai/deployments/([^/]+)/(chat/completions|completions|embeddings)$")
_OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
BATCH_ENDPOINTS = _OPENAI_PATHS
AZURE_STREAM_OPTIONS_SINCE = "2024-09-01"  # api-versions before this refuse stream_options
MINTED_TTL = 600  # seconds a client secret lives unless expires_after says otherwise
SESSION_SECRET_TTL = 60  # the older /v1/realtime/sessions secrets: one minute


@dataclass
class Recorded:
    """One request the fake received: ``body`` as it came over the wire (de-chunked),
    ``decoded`` after its ``Content-Encoding`` (the same bytes without one; None when
    it could not be decoded)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    decoded: bytes | None = None

    def json(self) -> Any:
        return json.loads(self.decoded if self.decoded is not None else self.body)


def _words(value: Any) -> int:
    """Words in every string of a JSON value except keys and roles/types/models."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(v) for v in value)
    if isinstance(value, dict):
        return sum(_words(v) for k, v in value.items()
                   if k not in ("role", "type", "model", "mime_type", "mimeType"))
    return 0


def _route(path: str) -> str:
    """The path as the providers' routers read it: escapes decoded, repeated and
    trailing slashes dropped (so `/v1/chat/completion%73/` is the chat endpoint)."""
    path = re.sub(r"//+", "/", unquote(path))
    return path.rstrip("/") or "/"


def snapshot(model: str) -> str:
    """The dated snapshot an alias resolves to, as OpenAI reports it."""
    return model if re.search(r"\d{4}-\d{2}-\d{2}$", model) else f"{model}-2025-01-01"


def new_id(prefix: str, size: int = 12) -> str:
    return prefix + secrets.token_hex(size)


def _rfc3339(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def max_output(req: dict[str, Any], *keys: str) -> int | None:
    """The first integer limit among ``keys`` (a request's max output tokens)."""
    for key in keys:
        value = req.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True)
class Counts:
    """The tokens the fake reports for one request."""

    input: int
    output: int
    cached: int
    truncated: bool = False  # the reply stopped at the request's max output tokens

    @property
    def words(self) -> list[str]:
        return REPLY[:self.output] if self.output < len(REPLY) else list(REPLY)

    @property
    def text(self) -> str:
        return "".join(self.words)


def count(request: Any, *, cached: int = 0, output: int | None = None,
          cap: int | None = None) -> Counts:
    """Counts for a request's counted fields: ``output`` overrides the reply's length,
    ``cap`` (the request's max output tokens, at least 1) bounds it."""
    natural = len(REPLY) if output is None else output
    out = natural if cap is None else min(natural, max(1, cap))
    return Counts(max(1, _words(request)) + cached, out, cached, out < natural)


# -- the Responses API's objects and events (shared with the WebSocket fake) -------------

def response_object(req: dict[str, Any], counts: Counts, *, rid: str, model: str,
                    created: int, background: bool = False) -> dict[str, Any]:
    """The finished Response (``completed``, or ``incomplete`` when cut at
    ``max_output_tokens``) for a ``POST /v1/responses`` body."""
    msg_id = "msg_" + rid.removeprefix("resp_")[:24]
    status = "incomplete" if counts.truncated else "completed"
    output = [] if req.get("generate") is False else [{
        "type": "message", "id": msg_id, "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": counts.text, "annotations": [],
                     "logprobs": []}]}]
    n_out = counts.output if output else 0
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "background": background, "completed_at": created, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if counts.truncated else None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"), "model": model,
        "output": output, "parallel_tool_calls": True,
        "previous_response_id": req.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": req.get("store", True),
        "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
        "tools": [], "top_p": 1.0, "truncation": "disabled",
        "usage": {"input_tokens": counts.input,
                  "input_tokens_details": {"cached_tokens": counts.cached,
                                           "cache_write_tokens": 0},
                  "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": counts.input + n_out},
        "user": None, "metadata": req.get("metadata") or {}}


def pending(final: dict[str, Any], status: str) -> dict[str, Any]:
    """A response as it looks before it finished (``queued``, ``in_progress``,
    ``cancelled``): no output, no usage."""
    return {**final, "status": status, "output": [], "usage": None, "completed_at": None,
            "incomplete_details": None}


def response_events(final: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream of a response, numbered from 0 (``sequence_number``): a background one
    starts ``response.created`` (queued), ``response.queued``; then
    ``response.in_progress`` (a foreground one: ``response.created``,
    ``response.in_progress``), the output item's events with one text delta per word,
    and ``response.completed`` (``response.incomplete`` when cut short) with usage."""
    events: list[dict[str, Any]]
    if final.get("background"):
        queued = pending(final, "queued")
        events = [{"type": "response.created", "response": queued},
                  {"type": "response.queued", "response": queued},
                  {"type": "response.in_progress",
                   "response": pending(final, "in_progress")}]
    else:
        start = pending(final, "in_progress")
        events = [{"type": "response.created", "response": start},
                  {"type": "response.in_progress", "response": start}]
    for index, item in enumerate(final["output"]):
        text = item["content"][0]["text"]
        msg_id = item["id"]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events += [
            {"type": "response.output_item.added", "output_index": index,
             "item": {**item, "status": "in_progress", "content": []}},
            {"type": "response.content_part.added", "item_id": msg_id,
             "output_index": index, "content_index": 0, "part": part}]
        events += [{"type": "response.output_text.delta", "item_id": msg_id,
                    "output_index": index, "content_index": 0, "delta": w, "logprobs": []}
                   for w in re.findall(r"\s*\S+", text)]
        events += [
            {"type": "response.output_text.done", "item_id": msg_id, "output_index": index,
             "content_index": 0, "text": text, "logprobs": []},
            {"type": "response.content_part.done", "item_id": msg_id, "output_index": index,
             "content_index": 0, "part": {**part, "text": text}},
            {"type": "response.output_item.done", "output_index": index, "item": item}]
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    events.append({"type": kind, "response": final})
    return [{**event, "sequence_number": seq} for seq, event in enumerate(events)]


def _oai_error(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _ant_error(type: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "message": message},
            "request_id": new_id("req_", 12)}


class _Progress:
    """When a background job finishes: on its ``after``-th retrieval (int), or once
    ``after`` (a timedelta) has passed since it was created."""

    def __init__(self, after: int | timedelta) -> None:
        self.after = after
        self.started = time.monotonic()
        self.retrievals = 0

    def retrieve(self) -> bool:
        self.retrievals += 1
        return self.due()

    def due(self) -> bool:
        if isinstance(self.after, timedelta):
            return time.monotonic() - self.started >= self.after.total_seconds()
        return self.retrievals >= self.after

    def wait(self) -> None:
        """Until it is due (a stream follows the job to its end)."""
        if isinstance(self.after, timedelta):
            time.sleep(max(0.0, self.started + self.after.total_seconds() - time.monotonic()))


@dataclass
class StoredResponse:
    final: dict[str, Any]  # as it finishes
    status: str  # what it is now: queued, in_progress, completed, incomplete, cancelled
    progress: _Progress | None = None  # background responses

    def view(self) -> dict[str, Any]:
        if self.status in ("completed", "incomplete"):
            return self.final
        return pending(self.final, self.status)

    def finish(self) -> None:
        if self.status in ("queued", "in_progress"):
            self.status = self.final["status"]
            self.final["completed_at"] = int(time.time())


@dataclass
class StoredFile:
    meta: dict[str, Any]
    content: bytes


@dataclass
class _Batch:
    obj: dict[str, Any]
    lines: list[dict[str, Any]]
    progress: _Progress
    invalid: str | None = None  # why validation fails it


@dataclass
class _MessageBatch:
    obj: dict[str, Any]
    requests: list[dict[str, Any]]
    progress: _Progress
    results: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class FakeInference:
    """The fake server; use as a context manager or call ``start`` / ``stop``."""

    directory: Path
    api_key: str = "sk-fake-provider-key"
    cached_tokens: int = 0
    interval: float = 0.0  # seconds between streamed events
    entra: Callable[[str], bool] | None = None  # Azure: accepts this bearer token?
    requests: list[Recorded] = field(default_factory=list)
    output_tokens: int | None = None  # reported output tokens (default: the reply's words)
    # Background responses and batches finish on this retrieval of theirs (GET by id),
    # or (a timedelta) once that long has passed since they were created.
    background_after: int | timedelta = 2
    websocket: bool = False  # also start the WebSocket fake (``ws``, ``ws_url``)
    minted: list[str] = field(default_factory=list)  # every ek_ value minted, in order

    def __post_init__(self) -> None:
        self.ca = LocalCA.create(self.directory, name="fake inference CA")
        self._server: ThreadingHTTPServer | None = None
        self.ws: FakeRealtime | None = None
        self.lock = threading.RLock()
        self.responses: dict[str, StoredResponse] = {}
        self.files: dict[str, StoredFile] = {}
        self.batches: dict[str, _Batch] = {}
        self.message_batches: dict[str, _MessageBatch] = {}
        self.minted_expiry: dict[str, int] = {}  # ek_ value -> expires_at (unix seconds)

    @property
    def ca_path(self) -> Path:
        return self.ca.cert_path

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        """The WebSocket fake's base (an SDK's ``websocket_base_url``)."""
        assert self.ws is not None, "start the fake with websocket=True"
        return f"wss://127.0.0.1:{self.ws.port}/v1"

    def client_context(self) -> ssl.SSLContext:
        """A client context trusting only the fake's CA."""
        return ssl.create_default_context(cafile=str(self.ca_path))

    def start(self) -> FakeInference:
        handler = type("Handler", (_Handler,), {"fake": self})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.socket = self.ca.server_context(self.directory, HOSTS).wrap_socket(
            server.socket, server_side=True)
        self._server = server
        # (`shutdown()` waits for serve_forever's next poll: every 0.05 s, not the default
        # 0.5 s, which each test using a fake paid at its end)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        if self.websocket:
            from fakes.realtime import FakeRealtime

            self.ws = FakeRealtime(self.directory / "ws", self.ca, HOSTS, inference=self)
        return self

    def stop(self) -> None:
        if self.ws is not None:
            self.ws.stop()
            self.ws = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeInference:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- counts, secrets, stored responses (also used by the WebSocket fake) ------------

    def counts(self, request: Any, cap: int | None = None) -> Counts:
        return count(request, cached=self.cached_tokens, output=self.output_tokens, cap=cap)

    def usage_counts(self, request: Any, cap: int | None = None) -> tuple[int, int, int]:
        """(input, output, cached) tokens for a request body."""
        c = self.counts(request, cap)
        return c.input, c.output, c.cached

    def mint(self, seconds: int) -> tuple[str, int]:
        """A new client secret: (value, expires_at)."""
        value, expires_at = new_id("ek_", 16), int(time.time()) + seconds
        with self.lock:
            self.minted.append(value)
            self.minted_expiry[value] = expires_at
        return value, expires_at

    def openai_token_ok(self, token: str) -> bool:
        """The API key, or a minted secret that has not expired."""
        if secrets.compare_digest(token.encode(), self.api_key.encode()):
            return True
        with self.lock:
            expires_at = self.minted_expiry.get(token)
        return expires_at is not None and time.time() < expires_at

    def new_response(self, req: dict[str, Any], *, background: bool = False) -> dict[str, Any]:
        """A finished Response for a ``POST /v1/responses`` body (stored unless
        ``store: false``; a background one starts ``queued``)."""
        model = snapshot(str(req.get("model", "gpt-4o-mini")))
        counts = self.counts({"input": req.get("input")}, max_output(req, "max_output_tokens"))
        final = response_object(req, counts, rid=new_id("resp_", 24), model=model,
                                created=int(time.time()), background=background)
        if req.get("store", True) is not False or background:
            stored = StoredResponse(final, "queued" if background else final["status"],
                                    _Progress(self.background_after) if background else None)
            with self.lock:
                self.responses[final["id"]] = stored
        return final

    def openai_reply(self, req: dict[str, Any], path: str) -> dict[str, Any]:
        """The JSON body a non-streamed call of an OpenAI endpoint answers."""
        if path == "/v1/responses":
            return self.new_response(req)
        model = snapshot(str(req.get("model", "gpt-4o-mini")))
        counted = {k: v for k, v in req.items() if k in ("messages", "prompt", "input")}
        created = int(time.time())
        if path == "/v1/embeddings":
            n_in = self.counts(counted).input
            inputs = req.get("input", "")
            items = inputs if isinstance(inputs, list) else [inputs]
            return {"object": "list", "model": model,
                    "data": [{"object": "embedding", "index": i,
                              "embedding": [round(0.01 * (i + j), 4) for j in range(8)]}
                             for i in range(len(items))],
                    "usage": {"prompt_tokens": n_in, "total_tokens": n_in}}
        c = self.counts(counted, max_output(req, "max_completion_tokens", "max_tokens"))
        usage = _chat_usage(c)
        finish = "length" if c.truncated else "stop"
        if path == "/v1/completions":
            return {"id": "cmpl-fake1", "object": "text_completion", "created": created,
                    "model": model, "choices": [{"text": c.text, "index": 0, "logprobs": None,
                                                 "finish_reason": finish}],
                    "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens",
                                                    "total_tokens")}}
        return {"id": "chatcmpl-fake1", "created": created, "model": model,
                "system_fingerprint": "fp_fake", "service_tier": "default",
                "object": "chat.completion", "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": c.text,
                                            "refusal": None, "annotations": []},
                    "logprobs": None, "finish_reason": finish}], "usage": usage}

    def anthropic_message(self, req: dict[str, Any], msg_id: str = "msg_fake01",
                          service_tier: str = "standard") -> dict[str, Any]:
        model = str(req.get("model", "claude-opus-4-1-20250805"))
        counted = {k: v for k, v in req.items() if k in ("messages", "system")}
        c = self.counts(counted, max_output(req, "max_tokens"))
        usage = {"input_tokens": c.input - c.cached, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": c.cached, "output_tokens": c.output,
                 "service_tier": service_tier}
        return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": c.text}],
                "stop_reason": "max_tokens" if c.truncated else "end_turn",
                "stop_sequence": None, "usage": usage}


def _chat_usage(c: Counts) -> dict[str, Any]:
    return {"prompt_tokens": c.input, "completion_tokens": c.output,
            "total_tokens": c.input + c.output,
            "prompt_tokens_details": {"cached_tokens": c.cached, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0,
                                          "rejected_prediction_tokens": 0}}


def _batch_usage(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's batch ``usage``: the sum over its requests' responses."""
    n_in = n_out = cached = reasoning = 0
    for body in bodies:
        u = body.get("usage") or {}
        if "prompt_tokens" in u:  # chat, completions, embeddings
            n_in += u["prompt_tokens"]
            n_out += u.get("completion_tokens", 0)
            cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            reasoning += (u.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        else:  # responses
            n_in += u.get("input_tokens", 0)
            n_out += u.get("output_tokens", 0)
            cached += (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
            reasoning += (u.get("output_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": n_in + n_out}


class _BadBody(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _decode(body: bytes, coding: str) -> bytes:
    """A body after its Content-Encoding (codings applied in order, undone in reverse)."""
    for name in reversed([c.strip().lower() for c in coding.split(",") if c.strip()]):
        try:
            if name in ("gzip", "x-gzip"):
                body = gzip.decompress(body)
            elif name == "deflate":  # zlib-wrapped as the RFC says; raw deflate as sent
                try:
                    body = zlib.decompress(body)
                except zlib.error:
                    body = zlib.decompress(body, -zlib.MAX_WBITS)
            elif name == "br":
                body = brotli.decompress(body)
            elif name != "identity":
                raise _BadBody(415, f"Unsupported Content-Encoding: {name}",
                               "unsupported_content_encoding")
        except (OSError, EOFError, zlib.error, brotli.error) as exc:
            raise _BadBody(400, f"Could not decode the {name} request body: {exc}",
                           "invalid_content_encoding") from exc
    return body


def _instance(schema: dict[str, Any], text: str) -> Any:
    """A value of a JSON schema (Gemini's or standard spelling of types): the first enum
    value, else `text` for strings, 1 for numbers, true, one item, every property."""
    if schema.get("enum"):
        return schema["enum"][0]
    kind = str(schema.get("type", "object")).lower()
    if kind == "object":
        return {name: _instance(sub, text)
                for name, sub in (schema.get("properties") or {}).items()}
    if kind == "array":
        return [_instance(schema.get("items") or {"type": "string"}, text)]
    return {"integer": 1, "number": 1, "boolean": True}.get(kind, text)


def _multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a multipart/form-data body: name -> (filename, content)."""
    message = BytesParser(policy=policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise ValueError("not multipart/form-data")
    parts: dict[str, tuple[str | None, bytes]] = {}
    for part in message.get_payload():
        assert not isinstance(part, str)
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        if isinstance(name, str):
            parts[name] = (part.get_filename(),
                           payload if isinstance(payload, bytes) else b"")
    return parts


_ROUTES: list[tuple[str, re.Pattern[str], str]] = [(m, re.compile(p), h) for m, p, h in [
    ("GET", r"^/v1/responses/([^/]+)$", "_response_get"),
    ("DELETE", r"^/v1/responses/([^/]+)$", "_response_delete"),
    ("POST", r"^/v1/responses/([^/]+)/cancel$", "_response_cancel"),
    ("POST", r"^/v1/files$", "_file_create"),
    ("GET", r"^/v1/files/([^/]+)$", "_file_get"),
    ("GET", r"^/v1/files/([^/]+)/content$", "_file_content"),
    ("POST", r"^/v1/batches$", "_batch_create"),
    ("GET", r"^/v1/batches$", "_batch_list"),
    ("GET", r"^/v1/batches/([^/]+)$", "_batch_get"),
    ("POST", r"^/v1/batches/([^/]+)/cancel$", "_batch_cancel"),
    ("POST", r"^/v1/realtime/(client_secrets|sessions|transcription_sessions)$", "_mint"),
]]
_ANTHROPIC_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (m, re.compile(p), h) for m, p, h in [
        ("POST", r"^/v1/messages/batches$", "_mb_create"),
        ("GET", r"^/v1/messages/batches$", "_mb_list"),
        ("GET", r"^/v1/messages/batches/([^/]+)$", "_mb_get"),
        ("DELETE", r"^/v1/messages/batches/([^/]+)$", "_mb_delete"),
        ("GET", r"^/v1/messages/batches/([^/]+)/results$", "_mb_results"),
        ("POST", r"^/v1/messages/batches/([^/]+)/cancel$", "_mb_cancel"),
    ]]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeInference
    seen: Recorded

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    # -- plumbing ------------------------------------------------------------------------

    def _body(self) -> bytes:
        return read_body(self.headers, self.rfile)

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_bytes(self, status: int, body: bytes, content_type: str,
                    headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.seen.status = status  # before the client can read the answer
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, parts: list[bytes], content_type: str = "text/event-stream") -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i, data in enumerate(parts):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            if self.fake.interval and i < len(parts) - 1:
                time.sleep(self.fake.interval)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.seen.status = 200

    def _error(self, status: int, message: str, code: str | None = None,
               param: str | None = None) -> None:
        """An error in the shape of the provider the path belongs to."""
        path = urlsplit(self.path).path
        if _GEMINI.match(path):
            return self._send(status, {"error": {"code": status, "message": message,
                                                 "status": "INVALID_ARGUMENT"}})
        if path.startswith("/v1/messages"):
            kind = {404: "not_found_error", 401: "authentication_error"}.get(
                status, "invalid_request_error")
            return self._send(status, _ant_error(kind, message))
        if path.startswith("/openai/"):
            return self._send(status, {"error": {"code": code or str(status),
                                                 "message": message}})
        return self._send(status, _oai_error(message, param=param, code=code))

    def do_GET(self) -> None:
        if self.fake.ws is not None and self.headers.get("Upgrade", "").lower() == "websocket":
            return self._relay_upgrade(self.fake.ws.port)
        self._serve()

    def _relay_upgrade(self, port: int) -> None:
        """A WebSocket upgrade on this port (where the real API takes it, beside the HTTP
        endpoints) is relayed byte for byte to the WebSocket fake, which answers it."""
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.seen = Recorded(self.command, self.path, headers, b"", status=101)
        self.fake.requests.append(self.seen)
        head = self.requestline + "\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in self.headers.items()) + "\r\n"
        client = self.connection
        with self.fake.client_context().wrap_socket(
                socket.create_connection(("127.0.0.1", port), timeout=60),
                server_hostname="api.openai.com") as upstream:
            upstream.sendall(head.encode("latin-1"))
            peer = {client: upstream, upstream: client}
            while True:
                ready = [s for s in peer if s.pending()] or select.select(
                    list(peer), [], [], 60)[0]
                if not ready:
                    break
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        self.close_connection = True
                        return
                    peer[sock].sendall(data)
        self.close_connection = True

    def do_POST(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def _serve(self) -> None:
        body = self._body()
        url = urlsplit(self.path)
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.seen = Recorded(self.command, self.path, headers, body)
        self.fake.requests.append(self.seen)
        try:
            self.seen.decoded = _decode(body, headers.get("content-encoding", ""))
        except _BadBody as bad:
            return self._error(bad.status, bad.message, bad.code)
        path = _route(url.path)
        for method, pattern, name in _ANTHROPIC_ROUTES:
            match = pattern.match(path)
            if match and method == self.command:
                if self._anthropic_auth():
                    getattr(self, name)(*match.groups())
                return None
        for method, pattern, name in _ROUTES:
            match = pattern.match(path)
            if match and method == self.command:
                if not self._openai_auth(minting=name == "_mint"):
                    return None
                getattr(self, name)(*match.groups())
                return None
        if self.command != "POST":
            return self._send(404, {"error": {"message": f"Unknown path {url.path}",
                                              "type": "invalid_request_error"}})
        try:
            request = json.loads(self.seen.decoded or b"{}")
        except ValueError:
            return self._send(400, {"error": {"message": "We could not parse the JSON body "
                                              "of your request.", "type":
                                              "invalid_request_error", "param": None,
                                              "code": None}})
        gemini = _GEMINI.match(path)
        azure = _AZURE.match(path)
        if gemini:
            return self._gemini(request, gemini.group(1), gemini.group(2), url.query)
        if path == "/v1/messages":
            if self._anthropic_auth():
                self._anthropic(request)
            return None
        if azure:
            auth = self.headers.get("Authorization", "")
            entra = self.fake.entra is not None and auth.startswith("Bearer ") and \
                self.fake.entra(auth[7:])
            if self.headers.get("api-key") != self.fake.api_key and not entra:
                return self._send(401, {"error": {"code": "401", "message": "Access denied "
                                                  "due to invalid subscription key or wrong "
                                                  "API endpoint."}})
            version = parse_qs(url.query).get("api-version", [""])[0]
            if "stream_options" in request and re.match(r"\d{4}-\d{2}-\d{2}", version) and \
                    version[:10] < AZURE_STREAM_OPTIONS_SINCE:
                return self._send(400, {"error": {
                    "code": "BadRequest",
                    "message": "Unrecognized request argument supplied: stream_options"}})
            request["model"] = "gpt-4o"  # the deployment's model
            return self._openai(request, "/v1/" + azure.group(2))
        if path in _OPENAI_PATHS:
            if self._openai_auth():
                self._openai(request, path)
            return None
        return self._send(404, {"error": {"message": f"Unknown path {url.path}",
                                          "type": "invalid_request_error"}})

    def _openai_auth(self, minting: bool = False) -> bool:
        """The key (or, unless minting, a live minted secret) as a Bearer token; else
        answers 401."""
        auth = self.headers.get("Authorization", "")
        token = auth[7:] if auth.startswith("Bearer ") else None
        if token is not None and (token == self.fake.api_key if minting
                                  else self.fake.openai_token_ok(token)):
            return True
        self._send(401, _oai_error(
            "Incorrect API key provided. You can find your API key at "
            "https://platform.openai.com/account/api-keys.", code="invalid_api_key"))
        return False

    def _anthropic_auth(self) -> bool:
        given = self.headers.get("x-api-key") or (
            self.headers.get("Authorization", "").removeprefix("Bearer "))
        if given != self.fake.api_key:
            self._send(401, {"type": "error", "error": {
                "type": "authentication_error", "message": "invalid x-api-key"},
                "request_id": "req_fake"})
            return False
        if not self.headers.get("anthropic-version"):
            self._send(400, {"type": "error", "error": {
                "type": "invalid_request_error",
                "message": "anthropic-version: header is required"}})
            return False
        return True

    def _json_body(self) -> dict[str, Any] | None:
        """The request's JSON object, or None after answering 400."""
        try:
            value = json.loads(self.seen.decoded or b"{}")
        except ValueError:
            value = None
        if not isinstance(value, dict):
            self._error(400, "We could not parse the JSON body of your request.")
            return None
        return value

    # -- OpenAI --------------------------------------------------------------------------

    def _openai(self, req: dict[str, Any], path: str) -> None:
        if path == "/v1/responses":
            return self._responses(req)
        if not req.get("stream") or path == "/v1/embeddings":
            return self._send(200, self.fake.openai_reply(req, path))
        model = snapshot(str(req.get("model", "gpt-4o-mini")))
        counted = {k: v for k, v in req.items() if k in ("messages", "prompt", "input")}
        c = self.fake.counts(counted, max_output(req, "max_completion_tokens", "max_tokens"))
        usage = _chat_usage(c)
        created = int(time.time())
        base = {"id": "chatcmpl-fake1", "created": created, "model": model,
                "system_fingerprint": "fp_fake", "service_tier": "default"}
        include = (req.get("stream_options") or {}).get("include_usage") is True
        chunk = {**base, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include else {}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": "", "refusal": None},
                                         "logprobs": None, "finish_reason": None}], **extra}]
        events += [{**chunk, "choices": [{"index": 0, "delta": {"content": w},
                                          "logprobs": None, "finish_reason": None}], **extra}
                   for w in c.words]
        events.append({**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                             "finish_reason": "length" if c.truncated
                                             else "stop"}], **extra})
        if include:
            events.append({**chunk, "choices": [], "usage": usage})
        parts = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
                 for e in events]
        self._stream([*parts, b"data: [DONE]\n\n"])

    def _responses(self, req: dict[str, Any]) -> None:
        background = req.get("background") is True
        if background and req.get("store") is False:
            return self._send(400, _oai_error(
                "Background mode requires store=true.", param="store",
                code="invalid_value"))
        previous = req.get("previous_response_id")
        if previous is not None:
            with self.fake.lock:
                known = previous in self.fake.responses
            if not known:
                return self._send(400, _oai_error(
                    f"Previous response with id '{previous}' not found.",
                    param="previous_response_id", code="previous_response_not_found"))
        final = self.fake.new_response(req, background=background)
        if req.get("stream"):
            if background:
                with self.fake.lock:
                    stored = self.fake.responses[final["id"]]
                    stored.status = "in_progress"
                    stored.finish()
            return self._sse(response_events(final))
        return self._send(200, pending(final, "queued") if background else final)

    def _sse(self, events: list[dict[str, Any]]) -> None:
        self._stream([f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}"
                      f"\n\n".encode() for e in events])

    def _stored(self, rid: str) -> StoredResponse | None:
        with self.fake.lock:
            stored = self.fake.responses.get(rid)
        if stored is None:
            self._send(404, _oai_error(f"Response with id '{rid}' not found.",
                                       param="response_id"))
        return stored

    def _response_get(self, rid: str) -> None:
        stored = self._stored(rid)
        if stored is None:
            return None
        query = parse_qs(urlsplit(self.path).query)
        if query.get("stream", [""])[0] == "true":
            if stored.progress is not None:
                stored.progress.wait()
            with self.fake.lock:
                if stored.status == "cancelled":
                    return self._send(400, _oai_error(
                        f"Response with id '{rid}' was cancelled.", code="invalid_value"))
                stored.finish()
            try:
                after = int(query.get("starting_after", ["-1"])[0])
            except ValueError:
                return self._send(400, _oai_error("Invalid value for 'starting_after'.",
                                                  param="starting_after",
                                                  code="invalid_value"))
            return self._sse([e for e in response_events(stored.final)
                              if e["sequence_number"] > after])
        with self.fake.lock:
            if stored.progress is not None and stored.status in ("queued", "in_progress"):
                if stored.progress.retrieve():
                    stored.finish()
                else:
                    stored.status = "in_progress"
            view = stored.view()
        return self._send(200, view)

    def _response_cancel(self, rid: str) -> None:
        stored = self._stored(rid)
        if stored is None:
            return None
        with self.fake.lock:
            if stored.progress is None:
                return self._send(400, _oai_error(
                    "Only responses created with background=true can be cancelled.",
                    code="invalid_value"))
            if stored.status in ("queued", "in_progress"):
                stored.status = "cancelled"
            elif stored.status != "cancelled":
                return self._send(400, _oai_error(
                    f"Cannot cancel a response with status '{stored.status}'.",
                    code="invalid_value"))
            view = stored.view()
        return self._send(200, view)

    def _response_delete(self, rid: str) -> None:
        with self.fake.lock:
            stored = self.fake.responses.pop(rid, None)
        if stored is None:
            return self._send(404, _oai_error(f"Response with id '{rid}' not found.",
                                              param="response_id"))
        return self._send(200, {"id": rid, "object": "response", "deleted": True})

    # -- OpenAI files and batches ----------------------------------------------------------

    def _file_create(self) -> None:
        try:
            parts = _multipart(self.headers.get("Content-Type", ""), self.seen.decoded or b"")
        except ValueError:
            return self._error(400, "Expected a multipart/form-data body.")
        if "file" not in parts:
            return self._error(400, "Missing required parameter: 'file'.",
                               "missing_required_parameter", "file")
        purpose = parts.get("purpose", (None, b""))[1].decode()
        if purpose not in ("assistants", "batch", "fine-tune", "vision", "user_data", "evals"):
            return self._error(400, f"Invalid value for 'purpose': '{purpose}'.",
                               "invalid_value", "purpose")
        filename, content = parts["file"]
        meta = self._store_file(content, filename or "upload", purpose)
        return self._send(200, meta)

    def _store_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": new_id("file-", 12), "object": "file", "bytes": len(content),
                                "created_at": int(time.time()), "filename": filename,
                                "purpose": purpose, "status": "processed",
                                "expires_at": None, "status_details": None}
        with self.fake.lock:
            self.fake.files[meta["id"]] = StoredFile(meta, content)
        return meta

    def _file(self, fid: str) -> StoredFile | None:
        with self.fake.lock:
            stored = self.fake.files.get(fid)
        if stored is None:
            self._send(404, _oai_error(f"No such File object: {fid}", param="id"))
        return stored

    def _file_get(self, fid: str) -> None:
        stored = self._file(fid)
        if stored is not None:
            self._send(200, stored.meta)

    def _file_content(self, fid: str) -> None:
        stored = self._file(fid)
        if stored is not None:
            self._send_bytes(200, stored.content, "application/octet-stream")

    def _batch_create(self) -> None:
        req = self._json_body()
        if req is None:
            return None
        endpoint = req.get("endpoint")
        if endpoint not in BATCH_ENDPOINTS:
            return self._error(400, f"Invalid value for 'endpoint': '{endpoint}'.",
                               "invalid_value", "endpoint")
        if req.get("completion_window") != "24h":
            return self._error(400, "Invalid value for 'completion_window': only '24h' is "
                               "supported.", "invalid_value", "completion_window")
        with self.fake.lock:
            source = self.fake.files.get(str(req.get("input_file_id")))
        if source is None:
            return self._send(404, _oai_error(
                f"No such File object: {req.get('input_file_id')}", param="input_file_id"))
        lines: list[dict[str, Any]] = []
        invalid = None
        for number, raw in enumerate(source.content.splitlines(), 1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                invalid = f"Line {number}: not valid JSON."
                break
            if not isinstance(line, dict) or line.get("url") != endpoint or \
                    not isinstance(line.get("body"), dict) or "custom_id" not in line:
                invalid = (f"Line {number}: expected custom_id, method POST, url "
                           f"{endpoint} and a JSON body.")
                break
            if any(seen["custom_id"] == line["custom_id"] for seen in lines):
                invalid = f"Line {number}: duplicate custom_id '{line['custom_id']}'."
                break
            lines.append(line)
        now = int(time.time())
        obj: dict[str, Any] = {
            "id": new_id("batch_", 12), "object": "batch", "endpoint": endpoint,
            "model": str(lines[0]["body"].get("model")) if lines and not invalid else None,
            "errors": None, "input_file_id": req["input_file_id"],
            "completion_window": "24h", "status": "validating", "output_file_id": None,
            "error_file_id": None, "created_at": now, "in_progress_at": None,
            "expires_at": now + 86400, "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": _batch_usage([]), "metadata": req.get("metadata")}
        with self.fake.lock:
            self.fake.batches[obj["id"]] = _Batch(obj, lines,
                                                  _Progress(self.fake.background_after),
                                                  invalid)
        return self._send(200, obj)

    def _batch(self, bid: str) -> _Batch | None:
        with self.fake.lock:
            batch = self.fake.batches.get(bid)
        if batch is None:
            self._send(404, _oai_error(f"No batch found with id '{bid}'.", param="batch_id"))
        return batch

    def _batch_get(self, bid: str) -> None:
        batch = self._batch(bid)
        if batch is None:
            return None
        with self.fake.lock:
            obj = batch.obj
            now = int(time.time())
            if obj["status"] == "cancelling":
                obj.update(status="cancelled", cancelled_at=now)
            elif obj["status"] in ("validating", "in_progress"):
                done = batch.progress.retrieve()
                if batch.invalid is not None:
                    obj.update(status="failed", failed_at=now, errors={
                        "object": "list", "data": [{"code": "invalid_request",
                                                    "message": batch.invalid,
                                                    "param": None, "line": None}]})
                elif not done:
                    obj.update(status="in_progress", in_progress_at=obj["in_progress_at"] or now,
                               request_counts={"total": len(batch.lines), "completed": 0,
                                               "failed": 0})
                else:
                    self._complete_batch(batch, now)
            view = dict(obj)
        return self._send(200, view)

    def _complete_batch(self, batch: _Batch, now: int) -> None:
        bodies, out = [], []
        for line in batch.lines:
            body = self.fake.openai_reply({**line["body"], "stream": False}, line["url"])
            bodies.append(body)
            out.append({"id": new_id("batch_req_", 12), "custom_id": line["custom_id"],
                        "response": {"status_code": 200, "request_id": new_id("req_", 16),
                                     "body": body}, "error": None})
        content = b"".join(json.dumps(o).encode() + b"\n" for o in out)
        output = self._store_file(content, f"{batch.obj['id']}_output.jsonl", "batch_output")
        batch.obj.update(status="completed", in_progress_at=batch.obj["in_progress_at"] or now,
                         finalizing_at=now, completed_at=now, output_file_id=output["id"],
                         request_counts={"total": len(batch.lines),
                                         "completed": len(batch.lines), "failed": 0},
                         usage=_batch_usage(bodies))

    def _batch_list(self) -> None:
        with self.fake.lock:
            data = [dict(b.obj) for b in reversed(self.fake.batches.values())]
        query = parse_qs(urlsplit(self.path).query)
        limit = int(query.get("limit", ["20"])[0])
        after = query.get("after", [None])[0]
        if after is not None:
            ids = [b["id"] for b in data]
            data = data[ids.index(after) + 1:] if after in ids else []
        page = data[:limit]
        return self._send(200, {"object": "list", "data": page,
                                "first_id": page[0]["id"] if page else None,
                                "last_id": page[-1]["id"] if page else None,
                                "has_more": len(data) > limit})

    def _batch_cancel(self, bid: str) -> None:
        batch = self._batch(bid)
        if batch is None:
            return None
        with self.fake.lock:
            obj = batch.obj
            if obj["status"] in ("validating", "in_progress"):
                obj.update(status="cancelling", cancelling_at=int(time.time()))
            elif obj["status"] not in ("cancelling", "cancelled"):
                return self._send(400, _oai_error(
                    f"Cannot cancel a batch with status '{obj['status']}'.",
                    code="invalid_value"))
            view = dict(obj)
        return self._send(200, view)

    # -- OpenAI minted secrets -------------------------------------------------------------

    def _mint(self, kind: str) -> None:
        req = self._json_body()
        if req is None:
            return None
        sess = new_id("sess_", 12)
        if kind == "client_secrets":
            after = (req.get("expires_after") or {}).get("seconds", MINTED_TTL)
            value, expires_at = self.fake.mint(int(after))
            asked = dict(req.get("session") or {"type": "realtime"})
            if asked.get("type") == "transcription":
                session: dict[str, Any] = {
                    "type": "transcription", "object": "realtime.transcription_session",
                    "id": sess, "expires_at": 0, "include": None,
                    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                        "transcription": None, "noise_reduction": None,
                                        "turn_detection": {"type": "server_vad"}}}}
            else:
                session = {
                    "type": "realtime", "object": "realtime.session", "id": sess,
                    "model": "gpt-realtime", "output_modalities": ["audio"],
                    "instructions": "", "tools": [], "tool_choice": "auto",
                    "max_output_tokens": "inf", "tracing": None, "truncation": "auto",
                    "prompt": None, "expires_at": 0, "include": None,
                    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
                              "output": {"format": {"type": "audio/pcm", "rate": 24000},
                                         "voice": "alloy", "speed": 1.0}}}
            session.update({k: v for k, v in asked.items() if k != "type"})
            return self._send(200, {"value": value, "expires_at": expires_at,
                                    "session": session})
        secret = req.get("client_secret") or {}
        after = (secret.get("expires_after") or {}).get("seconds", SESSION_SECRET_TTL)
        value, expires_at = self.fake.mint(int(after))
        asked = {k: v for k, v in req.items() if k != "client_secret"}
        if kind == "sessions":
            session = {"id": sess, "object": "realtime.session",
                       "model": "gpt-4o-realtime-preview", "modalities": ["audio", "text"],
                       "instructions": "", "voice": "alloy", "input_audio_format": "pcm16",
                       "output_audio_format": "pcm16", "input_audio_transcription": None,
                       "turn_detection": {"type": "server_vad", "threshold": 0.5,
                                          "prefix_padding_ms": 300,
                                          "silence_duration_ms": 200},
                       "tools": [], "tool_choice": "auto", "temperature": 0.8,
                       "max_response_output_tokens": "inf", "speed": 1.0, "tracing": None}
        else:
            session = {"id": sess, "object": "realtime.transcription_session",
                       "modalities": ["audio", "text"], "input_audio_format": "pcm16",
                       "input_audio_transcription": {"model": "gpt-4o-transcribe",
                                                     "language": None, "prompt": ""},
                       "turn_detection": {"type": "server_vad", "threshold": 0.5,
                                          "prefix_padding_ms": 300,
                                          "silence_duration_ms": 200},
                       "include": None}
        session.update(asked)
        session["client_secret"] = {"value": value, "expires_at": expires_at}
        return self._send(200, session)

    # -- Anthropic -----------------------------------------------------------------------

    def _anthropic(self, req: dict[str, Any]) -> None:
        msg = self.fake.anthropic_message(req)
        if not req.get("stream"):
            return self._send(200, msg)
        usage = msg["usage"]
        start = {**msg, "content": [], "stop_reason": None,
                 "usage": {**usage, "output_tokens": 1}}
        seq: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("ping", {"type": "ping"})]
        seq += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": w}})
                for w in re.findall(r"\s*\S+", msg["content"][0]["text"])]
        seq += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": msg["stop_reason"],
                                             "stop_sequence": None},
                                   "usage": {"output_tokens": usage["output_tokens"]}}),
                ("message_stop", {"type": "message_stop"})]
        self._stream([f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                      for name, data in seq])

    def _mb_create(self) -> None:
        req = self._json_body()
        if req is None:
            return None
        requests = req.get("requests")
        if not isinstance(requests, list) or not requests:
            return self._error(400, "requests: Field required (a non-empty list)")
        ids = [r.get("custom_id") if isinstance(r, dict) else None for r in requests]
        if any(not isinstance(i, str) for i in ids) or len(set(ids)) != len(ids):
            return self._error(400, "requests: every request needs a unique custom_id")
        if any(not isinstance(r.get("params"), dict) for r in requests):
            return self._error(400, "requests.params: Field required")
        now = time.time()
        obj: dict[str, Any] = {"id": new_id("msgbatch_", 12), "type": "message_batch",
               "processing_status": "in_progress",
               "request_counts": {"processing": len(requests), "succeeded": 0, "errored": 0,
                                  "canceled": 0, "expired": 0},
               "ended_at": None, "created_at": _rfc3339(now),
               "expires_at": _rfc3339(now + 86400), "archived_at": None,
               "cancel_initiated_at": None, "results_url": None}
        with self.fake.lock:
            self.fake.message_batches[obj["id"]] = _MessageBatch(
                obj, requests, _Progress(self.fake.background_after))
        return self._send(200, obj)

    def _mb(self, bid: str) -> _MessageBatch | None:
        with self.fake.lock:
            batch = self.fake.message_batches.get(bid)
        if batch is None:
            self._error(404, f"message_batch {bid} not found")
        return batch

    def _mb_get(self, bid: str) -> None:
        batch = self._mb(bid)
        if batch is None:
            return None
        with self.fake.lock:
            if batch.obj["processing_status"] == "canceling":
                self._end_mb(batch, canceled=True)
            elif batch.obj["processing_status"] == "in_progress" and batch.progress.retrieve():
                self._end_mb(batch, canceled=False)
            view = dict(batch.obj)
        return self._send(200, view)

    def _end_mb(self, batch: _MessageBatch, canceled: bool) -> None:
        counts = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        for r in batch.requests:
            params = r["params"]
            missing = [k for k in ("model", "max_tokens", "messages") if k not in params]
            result: dict[str, Any]
            if canceled:
                result = {"type": "canceled"}
            elif missing:
                result = {"type": "errored", "error": {
                    "type": "error", "error": {"type": "invalid_request_error",
                                               "message": f"{missing[0]}: Field required"},
                    "request_id": None}}
            else:
                result = {"type": "succeeded", "message": self.fake.anthropic_message(
                    params, new_id("msg_", 12), service_tier="batch")}
            counts[result["type"]] += 1
            batch.results.append({"custom_id": r["custom_id"], "result": result})
        host = self.headers.get("Host") or f"127.0.0.1:{self.fake.port}"
        batch.obj.update(processing_status="ended", ended_at=_rfc3339(time.time()),
                         request_counts=counts,
                         results_url=f"https://{host}/v1/messages/batches/"
                                     f"{batch.obj['id']}/results")

    def _mb_list(self) -> None:
        with self.fake.lock:
            data = [dict(b.obj) for b in reversed(self.fake.message_batches.values())]
        limit = int(parse_qs(urlsplit(self.path).query).get("limit", ["20"])[0])
        page = data[:limit]
        return self._send(200, {"data": page, "has_more": len(data) > limit,
                                "first_id": page[0]["id"] if page else None,
                                "last_id": page[-1]["id"] if page else None})

    def _mb_results(self, bid: str) -> None:
        batch = self._mb(bid)
        if batch is None:
            return None
        with self.fake.lock:
            ended = batch.obj["processing_status"] == "ended"
            lines = list(batch.results)
        if not ended:
            return self._error(404, f"message_batch {bid} has not ended: no results yet")
        body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        return self._send_bytes(200, body, "application/binary")

    def _mb_cancel(self, bid: str) -> None:
        batch = self._mb(bid)
        if batch is None:
            return None
        with self.fake.lock:
            if batch.obj["processing_status"] == "in_progress":
                batch.obj.update(processing_status="canceling",
                                 cancel_initiated_at=_rfc3339(time.time()))
            view = dict(batch.obj)
        return self._send(200, view)

    def _mb_delete(self, bid: str) -> None:
        batch = self._mb(bid)
        if batch is None:
            return None
        if batch.obj["processing_status"] != "ended":
            return self._error(400, "Cannot delete a message batch that has not ended; "
                               "cancel it first.")
        with self.fake.lock:
            self.fake.message_batches.pop(bid, None)
        return self._send(200, {"id": bid, "type": "message_batch_deleted"})

    # -- Gemini --------------------------------------------------------------------------

    def _gemini(self, req: dict[str, Any], model: str, method: str, query: str) -> None:
        params = parse_qs(query)
        given = self.headers.get("x-goog-api-key") or params.get("key", [""])[0]
        if given != self.fake.api_key:
            return self._send(401, {"error": {
                "code": 401, "message": "API key not valid. Please pass a valid API key.",
                "status": "UNAUTHENTICATED"}})
        c = self.fake.counts(req.get("contents", []),
                             max_output(req.get("generationConfig") or {}, "maxOutputTokens"))
        n_in, n_out, cached = c.input, c.output, c.cached
        version = f"{model}-001"
        words = c.words or [""]

        def usage(out: int) -> dict[str, Any]:
            meta: dict[str, Any] = {"promptTokenCount": n_in, "totalTokenCount": n_in + out,
                                    "promptTokensDetails": [{"modality": "TEXT",
                                                             "tokenCount": n_in}]}
            if out:  # proto3 JSON leaves zero counts out
                meta["candidatesTokenCount"] = out
            if cached:
                meta["cachedContentTokenCount"] = cached
            return meta

        def candidate(text: str, last: bool) -> dict[str, Any]:
            cand: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"},
                                    "index": 0}
            if last:
                cand["finishReason"] = "MAX_TOKENS" if c.truncated else "STOP"
            return cand

        config = req.get("generationConfig") or {}
        schema = config.get("responseJsonSchema") or config.get("responseSchema")
        if config.get("responseMimeType") == "application/json" and isinstance(schema, dict):
            # Structured output (what the Gemini CLI's model router asks for): an instance
            # of the schema, the reply's words in its strings.
            words = [json.dumps(_instance(schema, c.text))]
        if method == "generateContent":
            return self._send(200, {"candidates": [candidate("".join(words), True)],
                                    "usageMetadata": usage(n_out), "modelVersion": version,
                                    "responseId": "fake-response-1"})
        chunks = [{"candidates": [candidate(w, i == len(words) - 1)],
                   "usageMetadata": usage(i + 1 if i == len(words) - 1 else 0),
                   "modelVersion": version, "responseId": "fake-response-1"}
                  for i, w in enumerate(words)]
        chunks[-1]["usageMetadata"] = usage(n_out)
        if params.get("alt") == ["sse"]:
            return self._stream([b"data: " + json.dumps(ch).encode() + b"\r\n\r\n"
                                 for ch in chunks])
        encoded = [json.dumps(ch, indent=2).encode() for ch in chunks]
        parts = [b"[" + encoded[0]] + [b"\n,\r\n" + e for e in encoded[1:]] + [b"]"]
        self._stream(parts, content_type="application/json; charset=UTF-8")
