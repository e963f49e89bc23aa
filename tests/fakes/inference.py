"""A local fake of the inference APIs the gateway meters, over TLS (HTTP/1.1).

It listens on 127.0.0.1:<random port> in background threads, behind a certificate from
a throwaway CA (``ca_path``) whose SANs are 127.0.0.1 and the providers' host names
(``api.openai.com``, ``api.anthropic.com``, ``generativelanguage.googleapis.com``,
``*.openai.azure.com``), so a gateway can reach it by name through
``network.resolve``. Responses copy the providers' documented shapes, usage included:

* OpenAI: ``POST /v1/chat/completions`` (JSON; SSE with a final usage chunk only when
  ``stream_options.include_usage`` is true, then ``[DONE]``), ``/v1/completions``,
  ``/v1/responses`` (JSON; SSE ``response.created`` ... ``response.completed`` with
  ``response.usage``), ``/v1/embeddings``; ``Authorization: Bearer <key>``.
* Azure OpenAI: ``/openai/deployments/{d}/chat/completions?api-version=...`` with
  ``api-key: <key>``, or ``Authorization: Bearer <Entra ID token>`` that ``entra``
  accepts (same bodies; ``model`` is the deployment's model).
* Anthropic: ``POST /v1/messages`` (JSON; SSE ``message_start`` ... ``message_stop``),
  ``x-api-key`` (or Bearer) and ``anthropic-version`` required.
* Gemini: ``POST /v1beta/models/{m}:generateContent`` and ``:streamGenerateContent``
  (``?alt=sse``: SSE with CRLF line ends; without: a streamed JSON array), key in
  ``x-goog-api-key`` or ``?key=``.

A wrong or missing key gets 401 in the provider's error shape. Token counts are
deterministic: input = words of the request's text (+ ``cached_tokens`` reported as the
cached part when set), output = words of the reply. Every request is recorded.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from helpers.tls import LocalCA

HOSTS = ["127.0.0.1", "localhost", "api.openai.com", "api.anthropic.com",
         "generativelanguage.googleapis.com", "*.openai.azure.com"]
REPLY = ["The", " fake", " provider", " answers."]
_GEMINI = re.compile(r"^/v1(?:beta)?/models/([^/:]+):(generateContent|streamGenerateContent)$")
_AZURE = re.compile(r"^/openai/deployments/([^/]+)/(chat/completions|completions|embeddings)$")


@dataclass
class Recorded:
    """One request the fake received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0


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


def _snapshot(model: str) -> str:
    """The dated snapshot an alias resolves to, as OpenAI reports it."""
    return model if re.search(r"\d{4}-\d{2}-\d{2}$", model) else f"{model}-2025-01-01"


@dataclass
class FakeInference:
    """The fake server; use as a context manager or call ``start`` / ``stop``."""

    directory: Path
    api_key: str = "sk-fake-provider-key"
    cached_tokens: int = 0
    interval: float = 0.0  # seconds between streamed events
    entra: Callable[[str], bool] | None = None  # Azure: accepts this bearer token?
    requests: list[Recorded] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ca = LocalCA.create(self.directory, name="fake inference CA")
        self._server: ThreadingHTTPServer | None = None

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
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeInference:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def usage_counts(self, request: Any) -> tuple[int, int, int]:
        """(input, output, cached) tokens for a request body."""
        return max(1, _words(request)) + self.cached_tokens, len(REPLY), self.cached_tokens


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeInference

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    # -- plumbing ------------------------------------------------------------------------

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
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

    def do_POST(self) -> None:
        body = self._body()
        url = urlsplit(self.path)
        self.seen = Recorded(self.command, self.path,
                             {k.lower(): v for k, v in self.headers.items()}, body)
        self.fake.requests.append(self.seen)
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return self._send(400, {"error": {"message": "We could not parse the JSON body "
                                              "of your request.", "type":
                                              "invalid_request_error", "param": None,
                                              "code": None}})
        gemini = _GEMINI.match(url.path)
        azure = _AZURE.match(url.path)
        if gemini:
            return self._gemini(request, gemini.group(1), gemini.group(2), url.query)
        if url.path == "/v1/messages":
            return self._anthropic(request)
        if azure:
            auth = self.headers.get("Authorization", "")
            entra = self.fake.entra is not None and auth.startswith("Bearer ") and \
                self.fake.entra(auth[7:])
            if self.headers.get("api-key") != self.fake.api_key and not entra:
                return self._send(401, {"error": {"code": "401", "message": "Access denied "
                                                  "due to invalid subscription key or wrong "
                                                  "API endpoint."}})
            request["model"] = "gpt-4o"  # the deployment's model
            return self._openai(request, "/v1/" + azure.group(2))
        if url.path in ("/v1/chat/completions", "/v1/completions", "/v1/responses",
                        "/v1/embeddings"):
            if self.headers.get("Authorization") != f"Bearer {self.fake.api_key}":
                return self._send(401, {"error": {
                    "message": "Incorrect API key provided. You can find your API key at "
                               "https://platform.openai.com/account/api-keys.",
                    "type": "invalid_request_error", "param": None,
                    "code": "invalid_api_key"}})
            return self._openai(request, url.path)
        return self._send(404, {"error": {"message": f"Unknown path {url.path}",
                                          "type": "invalid_request_error"}})

    # -- OpenAI --------------------------------------------------------------------------

    def _openai(self, req: dict[str, Any], path: str) -> None:
        model = _snapshot(str(req.get("model", "gpt-4o-mini")))
        counted = {k: v for k, v in req.items() if k in ("messages", "prompt", "input")}
        n_in, n_out, cached = self.fake.usage_counts(counted)
        created = int(time.time())
        if path == "/v1/embeddings":
            inputs = req.get("input", "")
            items = inputs if isinstance(inputs, list) else [inputs]
            return self._send(200, {
                "object": "list", "model": model,
                "data": [{"object": "embedding", "index": i,
                          "embedding": [round(0.01 * (i + j), 4) for j in range(8)]}
                         for i in range(len(items))],
                "usage": {"prompt_tokens": n_in, "total_tokens": n_in}})
        if path == "/v1/responses":
            return self._responses(req, model, n_in, n_out, cached, created)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out,
                 "total_tokens": n_in + n_out,
                 "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                 "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                               "accepted_prediction_tokens": 0,
                                               "rejected_prediction_tokens": 0}}
        text = "".join(REPLY)
        if path == "/v1/completions":
            return self._send(200, {
                "id": "cmpl-fake1", "object": "text_completion", "created": created,
                "model": model, "choices": [{"text": text, "index": 0, "logprobs": None,
                                             "finish_reason": "stop"}],
                "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens",
                                                "total_tokens")}})
        base = {"id": "chatcmpl-fake1", "created": created, "model": model,
                "system_fingerprint": "fp_fake", "service_tier": "default"}
        if not req.get("stream"):
            return self._send(200, {**base, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                        "annotations": []},
                "logprobs": None, "finish_reason": "stop"}], "usage": usage})
        include = (req.get("stream_options") or {}).get("include_usage") is True
        chunk = {**base, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include else {}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": "", "refusal": None},
                                         "logprobs": None, "finish_reason": None}], **extra}]
        events += [{**chunk, "choices": [{"index": 0, "delta": {"content": w},
                                          "logprobs": None, "finish_reason": None}], **extra}
                   for w in REPLY]
        events.append({**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                             "finish_reason": "stop"}], **extra})
        if include:
            events.append({**chunk, "choices": [], "usage": usage})
        parts = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n"
                 for e in events]
        self._stream([*parts, b"data: [DONE]\n\n"])

    def _responses(self, req: dict[str, Any], model: str, n_in: int, n_out: int,
                   cached: int, created: int) -> None:
        text = "".join(REPLY)
        msg_id = "msg_fake1"
        response: dict[str, Any] = {
            "id": "resp_fake1", "object": "response", "created_at": created,
            "status": "completed", "background": False, "error": None,
            "incomplete_details": None, "instructions": req.get("instructions"),
            "max_output_tokens": None, "model": model,
            "output": [{"type": "message", "id": msg_id, "status": "completed",
                        "role": "assistant", "content": [{"type": "output_text", "text": text,
                                                          "annotations": [],
                                                          "logprobs": []}]}],
            "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": True,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto",
            "tools": [], "top_p": 1.0, "truncation": "disabled",
            "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": n_out,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_in + n_out},
            "user": None, "metadata": {}}
        if not req.get("stream"):
            return self._send(200, response)
        start = {**response, "status": "in_progress", "output": [], "usage": None}
        item = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": start},
            {"type": "response.in_progress", "response": start},
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.content_part.added", "item_id": msg_id, "output_index": 0,
             "content_index": 0, "part": part}]
        events += [{"type": "response.output_text.delta", "item_id": msg_id,
                    "output_index": 0, "content_index": 0, "delta": w, "logprobs": []}
                   for w in REPLY]
        events += [
            {"type": "response.output_text.done", "item_id": msg_id, "output_index": 0,
             "content_index": 0, "text": text, "logprobs": []},
            {"type": "response.content_part.done", "item_id": msg_id, "output_index": 0,
             "content_index": 0, "part": {**part, "text": text}},
            {"type": "response.output_item.done", "output_index": 0,
             "item": response["output"][0]},
            {"type": "response.completed", "response": response}]
        parts = []
        for seq, event in enumerate(events):
            event = {**event, "sequence_number": seq}
            parts.append(f"event: {event['type']}\ndata: "
                         f"{json.dumps(event, separators=(',', ':'))}\n\n".encode())
        self._stream(parts)

    # -- Anthropic -----------------------------------------------------------------------

    def _anthropic(self, req: dict[str, Any]) -> None:
        given = self.headers.get("x-api-key") or (
            self.headers.get("Authorization", "").removeprefix("Bearer "))
        if given != self.fake.api_key:
            return self._send(401, {"type": "error", "error": {
                "type": "authentication_error", "message": "invalid x-api-key"},
                "request_id": "req_fake"})
        if not self.headers.get("anthropic-version"):
            return self._send(400, {"type": "error", "error": {
                "type": "invalid_request_error",
                "message": "anthropic-version: header is required"}})
        model = str(req.get("model", "claude-opus-4-1-20250805"))
        counted = {k: v for k, v in req.items() if k in ("messages", "system")}
        n_in, n_out, cached = self.fake.usage_counts(counted)
        usage = {"input_tokens": n_in - cached, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached, "output_tokens": n_out,
                 "service_tier": "standard"}
        text = "".join(REPLY)
        msg = {"id": "msg_fake01", "type": "message", "role": "assistant", "model": model,
               "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
               "stop_sequence": None, "usage": usage}
        if not req.get("stream"):
            return self._send(200, msg)
        start = {**msg, "content": [], "stop_reason": None,
                 "usage": {**usage, "output_tokens": 1}}
        seq: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("ping", {"type": "ping"})]
        seq += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": w}})
                for w in REPLY]
        seq += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                   "usage": {"output_tokens": n_out}}),
                ("message_stop", {"type": "message_stop"})]
        self._stream([f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                      for name, data in seq])

    # -- Gemini --------------------------------------------------------------------------

    def _gemini(self, req: dict[str, Any], model: str, method: str, query: str) -> None:
        params = parse_qs(query)
        given = self.headers.get("x-goog-api-key") or params.get("key", [""])[0]
        if given != self.fake.api_key:
            return self._send(401, {"error": {
                "code": 401, "message": "API key not valid. Please pass a valid API key.",
                "status": "UNAUTHENTICATED"}})
        n_in, n_out, cached = self.fake.usage_counts(req.get("contents", []))
        version = f"{model}-001"

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
            c: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"},
                                 "index": 0}
            if last:
                c["finishReason"] = "STOP"
            return c

        if method == "generateContent":
            return self._send(200, {"candidates": [candidate("".join(REPLY), True)],
                                    "usageMetadata": usage(n_out), "modelVersion": version,
                                    "responseId": "fake-response-1"})
        chunks = [{"candidates": [candidate(w, i == len(REPLY) - 1)],
                   "usageMetadata": usage(i + 1 if i == len(REPLY) - 1 else 0),
                   "modelVersion": version, "responseId": "fake-response-1"}
                  for i, w in enumerate(REPLY)]
        chunks[-1]["usageMetadata"] = usage(n_out)
        if params.get("alt") == ["sse"]:
            return self._stream([b"data: " + json.dumps(c).encode() + b"\r\n\r\n"
                                 for c in chunks])
        encoded = [json.dumps(c, indent=2).encode() for c in chunks]
        parts = [b"[" + encoded[0]] + [b"\n,\r\n" + e for e in encoded[1:]] + [b"]"]
        self._stream(parts, content_type="application/json; charset=UTF-8")
