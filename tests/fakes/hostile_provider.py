"""A hostile stand-in inference provider: it bills every call what a real provider MAY.

A token budget holds only if the gateway's worst case for a call is the provider's. This
fake takes the provider's side of every doubt, so a budget suite
(tests/integration/test_budget_adversarial.py) can check that what the gateway lets
through never costs more than the budget. Over TLS on 127.0.0.1 (a throwaway CA,
``ca_path``; the names in ``HOSTS``, reached through the gateway's ``network.resolve``):

* **Input** is the request body's size in bytes, as tokens (a byte-level BPE tokenizer
  reaches one token per byte on crafted text), plus all the state the call refers to that
  the provider holds: a stored response (``previous_response_id``: its whole context), a
  conversation (``conversation``), a Gemini cached content (``cachedContent``), an
  uploaded file (``file_id``), a URL it fetches (``image_url``, ``file_url``,
  ``fileUri``: ``url_tokens`` each), all capped by the model's context window.
* **Output** is the largest limit among every output-limit field of the body, in any
  spelling and number form (``max_tokens`` beside ``max_completion_tokens``, ``1e6``,
  ``"8"``, ``"inf"``, ``generation_config.max_output_tokens``), else the model's max
  output, and never more than it; times the choices asked for (``n``, ``candidateCount``,
  numbers in the same forms).
* **Routes** are read by a lenient router: escapes decoded, repeated slashes dropped,
  ``;params`` dropped, any case, PUT and PATCH taken as POST. Beside the endpoints the
  gateway meters it serves inference the gateway may not know, billed the same way:
  Vertex ``endpoints/{id}:generateContent|predict|rawPredict``, Bedrock ``/async-invoke``,
  Mistral ``/v1/conversations`` and ``/v1/ocr``, Gemini ``cachedContents`` (creating one
  bills its tokens), OpenAI ``/v1/containers`` (a code-interpreter session, billed as one
  call of ``container_model``). ``/v1/files`` and OpenAI ``/v1/conversations`` store
  state without billing.
* **WebSockets** (their own port, ``ws_port``, under ``WS_HOST``): the Realtime API
  (``/v1/realtime``) runs each ``response.create`` as it comes (its input: the event's
  bytes plus, in band or without ``input``, the whole conversation), out-of-band ones
  (``response.conversation: "none"``) in parallel; the Responses API over WebSocket
  (``/v1/responses``) runs ``ws_parallel`` responses of a session at a time, the others
  queued before their ``response.created``. A response takes ``interval`` per thousand
  output tokens (at least one, at most 16), so long ones end after short ones.
* **Faults**, per key (``new_key(faults=...)``, drawn from ``seed``): an answer without
  usage; a stream (or WebSocket response) that ends in an error event after some tokens,
  billed what it generated; a stream cut off, billed in full; a 5xx before anything ran,
  billed nothing.
* **Ledger**: every call is billed when it starts generating (``bills``; ``billed(key)``
  sums a key's), in the tokens it reports in its usage when it reports any.

The models served and their limits (``models``) are the caller's, so a test aligns them
with the gateway's model catalogue in one place. Keys come from ``new_key()``; any other
gets 401. State a call refers to may be made by ``hold_*`` (by another client, earlier).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, cast
from urllib.parse import parse_qs, unquote, urlsplit

import websockets.exceptions
from helpers.tls import LocalCA
from websockets.datastructures import Headers
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse
from websockets.sync.server import Server, ServerConnection, serve

from fakes.http_body import read_body

WS_HOST = "ws.openai.test"
HOSTS = ["127.0.0.1", "api.openai.com", "api.anthropic.com", "api.mistral.ai",
         "generativelanguage.googleapis.com", "us-central1-aiplatform.googleapis.com",
         "bedrock-runtime.us-east-1.amazonaws.com", "hostile.openai.azure.com"]

LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens",
              "max_response_output_tokens", "maxOutputTokens", "maxTokens", "max_new_tokens",
              "max_gen_len", "max_tokens_to_sample")
CHOICE_KEYS = ("n", "candidateCount", "candidate_count", "num_return_sequences")
CONFIG_KEYS = ("generationConfig", "generation_config", "inferenceConfig", "inference_config",
               "parameters", "completion_args", "modelInput", "response")
MAX_CHOICES = 16
DELTAS = 4  # words of a whole answer's text, whatever its token count


@dataclass(frozen=True)
class ModelLimits:
    """A model's context window and max output, in tokens."""

    context_window: int
    max_output: int


@dataclass(frozen=True)
class Faults:
    """How often (0..1) a key's calls get each adversarial answer."""

    no_usage: float = 0.0  # the whole answer, without usage
    error_after_tokens: float = 0.0  # an error event after some tokens (billed those)
    cut: float = 0.0  # the stream cut off after some tokens (billed in full)
    refuse_5xx: float = 0.0  # a 5xx before anything ran (billed nothing)
    # A WebSocket session's 1st, 3rd, 5th... response waits before it queues for a slot,
    # so the one created after it starts (and is named in response.created) first.
    stagger: bool = False

    @property
    def errors(self) -> bool:
        """Whether some calls get an error answer."""
        return bool(self.error_after_tokens or self.cut or self.refuse_5xx)

    def draw(self, rng: random.Random) -> str | None:
        roll = rng.random()
        for name in ("refuse_5xx", "no_usage", "error_after_tokens", "cut"):
            rate: float = getattr(self, name)
            if roll < rate:
                return name
            roll -= rate
        return None


@dataclass(frozen=True)
class Bill:
    """One call as the provider billed it."""

    key: str
    endpoint: str
    model: str
    input: int
    output: int

    @property
    def tokens(self) -> int:
        return self.input + self.output


@dataclass
class Plan:
    """What one call generates: ``input`` and ``output`` tokens it reports (``held`` of
    the input came from state the provider holds), its ``fault``, and what it ``bills``."""

    model: str
    input: int
    output: int
    held: int
    fault: str | None
    choices: int = 1

    @property
    def generated(self) -> int:
        """Output tokens generated before the answer ended."""
        return self.output * 3 // 4 if self.fault == "error_after_tokens" else self.output

    @property
    def billed(self) -> int:
        return 0 if self.fault == "refuse_5xx" else self.input + self.generated

    @property
    def deltas(self) -> int:
        """Text deltas its stream carries: one a thousand output tokens (2 to 16)."""
        return max(2, min(16, self.output // 1000))


class Refused(Exception):
    """A call the provider refuses before it runs (nothing billed)."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def number(value: Any) -> float | None:
    """A count as a lenient JSON reader takes it: ints, integral floats (``1e6``),
    numeric strings (``"8"``), ``"inf"`` (math.inf); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("inf", "infinity"):
            return math.inf
        try:
            value = float(text)
        except ValueError:
            return None
    if isinstance(value, int | float) and (value > 0 or math.isinf(value)):
        return math.floor(value) if math.isfinite(value) else math.inf
    return None


def _configs(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield doc
    for key in CONFIG_KEYS:
        inner = doc.get(key)
        if isinstance(inner, dict):
            yield inner


def output_limit(doc: dict[str, Any], limits: ModelLimits,
                 defaults: dict[str, Any] | None = None) -> tuple[int, int]:
    """(output tokens per choice, choices): the largest limit among every field (of
    ``doc``, else of ``defaults``, a session's), else the model's max, capped by it."""
    found = [n for d in _configs(doc) for k in LIMIT_KEYS if (n := number(d.get(k)))]
    if not found and defaults is not None:
        found = [n for k in LIMIT_KEYS if (n := number(defaults.get(k)))]
    out = min(max(found), limits.max_output) if found else limits.max_output
    choices = [n for d in _configs(doc) for k in CHOICE_KEYS if (n := number(d.get(k)))]
    n = min(max(choices), MAX_CHOICES) if choices else 1
    return int(out), int(n)


@dataclass
class _Session:
    """A WebSocket session's state (its conversation, its responses)."""

    conn: ServerConnection
    key: str
    model: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    config: dict[str, Any] = field(default_factory=dict)
    conversation: int = 0  # tokens the session's conversation holds
    in_band: bool = False  # an in-band Realtime response is running
    local: dict[str, int] = field(default_factory=dict)  # this session's responses
    slots: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(1))
    events: int = 0
    creates: int = 0  # response.create events taken
    closed: bool = False  # the client went: what is still queued never runs

    def send(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.events += 1
            self.conn.send(json.dumps({"event_id": f"evt_{self.events}", **event}))


class HostileProvider:
    """See the module docstring. ``models``: name -> limits; ``deployments``: Azure
    deployment / Vertex endpoint id -> model (the first model by default)."""

    def __init__(self, directory: Path, models: dict[str, ModelLimits], *, seed: int = 0,
                 url_tokens: int = 48_000, interval: float = 0.005, ws_parallel: int = 1,
                 deployments: dict[str, str] | None = None,
                 container_model: str | None = None) -> None:
        self.directory = directory
        self.models = dict(models)
        self.rng = random.Random(seed)
        self.url_tokens = url_tokens
        self.interval = interval
        self.ws_parallel = ws_parallel
        self.deployments = dict(deployments or {})
        self.container_model = container_model or next(iter(models))
        self.ca = LocalCA.create(directory, name="hostile provider CA")
        self.lock = threading.Lock()
        self.keys: dict[str, Faults] = {}
        self.parallel: dict[str, int] = {}  # keys whose sessions run another ws_parallel
        self.bills: list[Bill] = []
        self.responses: dict[str, int] = {}  # id -> context tokens
        self.conversations: dict[str, int] = {}
        self.files: dict[str, int] = {}
        self.caches: dict[str, int] = {}
        self._http: ThreadingHTTPServer | None = None
        self._ws: Server | None = None
        self._threads: list[threading.Thread] = []

    # -- the test's side --------------------------------------------------------------------

    @property
    def ca_path(self) -> Path:
        return self.ca.cert_path

    @property
    def port(self) -> int:
        assert self._http is not None
        return int(self._http.server_address[1])

    @property
    def ws_port(self) -> int:
        assert self._ws is not None
        return int(self._ws.socket.getsockname()[1])

    def resolve(self) -> dict[str, str]:
        """``network.resolve`` entries for every name this provider serves."""
        names = {h: f"127.0.0.1:{self.port}" for h in HOSTS if h != "127.0.0.1"}
        return {**names, WS_HOST: f"127.0.0.1:{self.ws_port}"}

    def new_key(self, faults: Faults | None = None, ws_parallel: int | None = None) -> str:
        """A key the provider bills (its calls get ``faults``; its Responses WebSocket
        sessions run ``ws_parallel`` responses at a time, else the provider's number)."""
        key = "sk-hostile-" + secrets.token_hex(12)
        with self.lock:
            self.keys[key] = faults or Faults()
            self.parallel[key] = ws_parallel or self.ws_parallel
        return key

    def billed(self, key: str) -> int:
        with self.lock:
            return sum(b.tokens for b in self.bills if b.key == key)

    def bills_of(self, key: str) -> list[Bill]:
        with self.lock:
            return [b for b in self.bills if b.key == key]

    def _hold(self, table: dict[str, int], prefix: str, tokens: int) -> str:
        ident = prefix + secrets.token_hex(8)
        with self.lock:
            table[ident] = tokens
        return ident

    def hold_response(self, tokens: int) -> str:
        """A stored response of ``tokens`` of context (made earlier, by anyone)."""
        return self._hold(self.responses, "resp_", tokens)

    def hold_conversation(self, tokens: int) -> str:
        return self._hold(self.conversations, "conv_", tokens)

    def hold_file(self, tokens: int) -> str:
        return self._hold(self.files, "file-", tokens)

    def hold_cache(self, tokens: int) -> str:
        return self._hold(self.caches, "cachedContents/", tokens)

    # -- pricing ------------------------------------------------------------------------------

    def limits(self, model: str) -> ModelLimits:
        name = model.removeprefix("models/").rsplit("/", 1)[-1]
        found = self.models.get(name)
        if found is None:
            raise Refused(404, f"The model `{model[:80]}` does not exist", "model_not_found")
        return found

    def held(self, doc: Any) -> int:
        """Tokens of the provider-held state (and fetched URLs) ``doc`` refers to."""
        total = 0

        def look(table: dict[str, int], ident: Any, what: str) -> int:
            if not isinstance(ident, str):
                return 0
            with self.lock:
                if ident not in table:
                    raise Refused(404, f"{what} {ident[:60]!r} not found", "not_found")
                return table[ident]

        def walk(value: Any) -> None:
            nonlocal total
            if isinstance(value, list):
                for item in value:
                    walk(item)
                return
            if not isinstance(value, dict):
                return
            for key, inner in value.items():
                if key == "previous_response_id":
                    total += look(self.responses, inner, "response")
                elif key == "conversation":
                    conv = inner.get("id") if isinstance(inner, dict) else inner
                    if conv not in (None, "none", "auto"):
                        total += look(self.conversations, conv, "conversation")
                elif key in ("cachedContent", "cached_content"):
                    total += look(self.caches, inner, "cached content")
                elif key in ("file_id", "fileId"):
                    total += look(self.files, inner, "file")
                elif key in ("image_url", "file_url", "fileUri", "file_uri"):
                    url = inner.get("url") if isinstance(inner, dict) else inner
                    if isinstance(url, str) and url.startswith(("http://", "https://")):
                        total += self.url_tokens
                else:
                    walk(inner)
        walk(doc)
        return total

    def plan(self, key: str, endpoint: str, model: str, size: int, doc: dict[str, Any], *,
             extra_input: int = 0, defaults: dict[str, Any] | None = None,
             output: bool = True) -> Plan:
        """Price one call (``size``: its body bytes) and bill it."""
        limits = self.limits(model)
        held = self.held(doc) + extra_input
        n_in = min(limits.context_window, size + held)
        out, choices = output_limit(doc, limits, defaults) if output else (0, 1)
        with self.lock:
            fault = self.keys[key].draw(self.rng)
            plan = Plan(model, n_in, out * choices, min(held, n_in), fault, choices)
            if plan.billed:
                self.bills.append(Bill(key, endpoint, model, plan.input, plan.generated))
        return plan

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> HostileProvider:
        self._http = _start_http(self)
        (self.directory / "ws").mkdir(parents=True, exist_ok=True)
        ctx = self.ca.server_context(self.directory / "ws", [WS_HOST])
        ctx.set_alpn_protocols(["http/1.1"])
        self._ws = serve(self._session, "127.0.0.1", 0, ssl=ctx,
                         process_request=self._authorize)
        thread = threading.Thread(target=self._ws.serve_forever, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._ws is not None:
            self._ws.shutdown()
            self._ws = None
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> HostileProvider:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- WebSockets -----------------------------------------------------------------------------

    def _authorize(self, conn: ServerConnection, request: WsRequest) -> WsResponse | None:
        auth = request.headers.get("Authorization", "")
        with self.lock:
            known = auth.startswith("Bearer ") and auth[7:] in self.keys
        if known:
            return None
        body = json.dumps({"error": {"message": "Incorrect API key provided.",
                                     "type": "invalid_request_error",
                                     "code": "invalid_api_key"}}).encode()
        return WsResponse(401, "Unauthorized", Headers([("Content-Type", "application/json"),
                                                        ("Content-Length", str(len(body)))]),
                          body)

    def _session(self, conn: ServerConnection) -> None:
        request = conn.request
        assert request is not None
        key = request.headers.get("Authorization", "")[7:]
        url = urlsplit(request.path)
        path = _normal(url.path).lower()
        model = parse_qs(url.query).get("model", [""])[0]
        session = _Session(conn, key, model)
        session.slots = threading.Semaphore(self.parallel.get(key, self.ws_parallel))
        workers: list[threading.Thread] = []
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            if path.endswith("/realtime"):
                session.model = model or "gpt-realtime"
                session.config = {"model": session.model, "max_output_tokens": "inf"}
                session.send({"type": "session.created", "session": session.config})
            for message in conn:
                try:
                    event = json.loads(message)
                except ValueError:
                    event = None
                if not isinstance(event, dict):
                    session.send({"type": "error", "error": {
                        "type": "invalid_request_error", "code": "invalid_json",
                        "message": "not a JSON object"}})
                    continue
                work = (self._realtime_event if path.endswith("/realtime")
                        else self._responses_event)(session, event, len(message))
                if work is not None:
                    thread = threading.Thread(target=_quietly, args=(work,), daemon=True)
                    thread.start()
                    workers.append(thread)
        session.closed = True
        for thread in workers:
            thread.join(10)

    def _realtime_event(self, session: _Session, event: dict[str, Any], size: int
                        ) -> Callable[[], None] | None:
        kind = event.get("type")
        if kind == "session.update" and isinstance(event.get("session"), dict):
            session.config.update(event["session"])
            session.send({"type": "session.updated", "session": session.config})
            return None
        if kind == "conversation.item.create":
            session.conversation += size
            session.send({"type": "conversation.item.created", "item": event.get("item")})
            return None
        if kind != "response.create":
            return None
        response = event.get("response") if isinstance(event.get("response"), dict) else {}
        assert isinstance(response, dict)
        out_of_band = response.get("conversation") == "none"
        if not out_of_band:
            with session.lock:
                busy, session.in_band = session.in_band, True
            if busy:
                session.send({"type": "error", "error": {
                    "type": "invalid_request_error",
                    "code": "conversation_already_has_active_response",
                    "message": "Conversation already has an active response"}})
                return None
        # An in-band response reads the whole conversation; an out-of-band one its own
        # input, or the conversation when it names none.
        context = 0 if out_of_band and "input" in response else session.conversation
        try:
            plan = self.plan(session.key, "realtime", str(session.config.get("model")),
                             size, {**event, "response": response}, extra_input=context,
                             defaults=session.config)
        except Refused as exc:
            session.in_band = session.in_band and out_of_band
            session.send({"type": "error", "error": {"type": "invalid_request_error",
                                                     "code": exc.code, "message": exc.message}})
            return None

        def run() -> None:
            rid = "resp_" + secrets.token_hex(8)
            try:
                self._realtime_response(session, rid, plan, out_of_band)
            finally:
                if not out_of_band:
                    session.in_band = False
                    session.conversation += plan.generated if plan.billed else 0
        return run

    def _realtime_response(self, session: _Session, rid: str, plan: Plan,
                           out_of_band: bool) -> None:
        conv = None if out_of_band else "conv_session"
        if plan.fault == "refuse_5xx":  # failed before it ran: nothing generated or billed
            session.send({"type": "response.done", "response": {
                "object": "realtime.response", "id": rid, "status": "failed",
                "conversation_id": conv, "output": [], "usage": {
                    "total_tokens": 0, "input_tokens": 0, "output_tokens": 0}}})
            return
        session.send({"type": "response.created", "response": {
            "object": "realtime.response", "id": rid, "status": "in_progress",
            "conversation_id": conv, "output": [], "usage": None}})
        for i in range(plan.deltas):
            if plan.fault in ("error_after_tokens", "cut") and i == plan.deltas // 2:
                break
            time.sleep(self.interval)
            session.send({"type": "response.output_text.delta", "response_id": rid,
                          "item_id": "item_" + rid[5:], "output_index": 0,
                          "content_index": 0, "delta": "tok "})
        if plan.fault == "cut":
            session.conn.close(1011, "server error")
            return
        usage: dict[str, Any] | None = {
            "total_tokens": plan.input + plan.generated, "input_tokens": plan.input,
            "output_tokens": plan.generated,
            "input_token_details": {"cached_tokens": 0, "text_tokens": plan.input,
                                    "audio_tokens": 0},
            "output_token_details": {"text_tokens": plan.generated, "audio_tokens": 0}}
        status = "completed"
        if plan.fault == "error_after_tokens":
            session.send({"type": "error", "error": {
                "type": "server_error", "code": "server_error",
                "message": "The server had an error while processing your request."}})
            usage, status = None, "failed"
        elif plan.fault == "no_usage":
            usage = None
        session.send({"type": "response.done", "response": {
            "object": "realtime.response", "id": rid, "status": status,
            "conversation_id": conv, "output": [], "usage": usage}})

    def _responses_event(self, session: _Session, event: dict[str, Any], size: int
                         ) -> Callable[[], None] | None:
        lane = {"stream_id": event["stream_id"]} if "stream_id" in event else {}

        def error(status: int, code: str, message: str) -> None:
            session.send({"type": "error", "status": status, "error": {
                "type": "invalid_request_error" if status < 500 else "server_error",
                "code": code, "message": message, "param": None}, **lane})

        if event.get("type") != "response.create":
            error(400, "unsupported_event_type", f"Unsupported event {event.get('type')!r}")
            return None
        model = event.get("model")
        if not isinstance(model, str):
            error(400, "missing_required_parameter", "Missing required parameter: 'model'.")
            return None
        previous = event.get("previous_response_id")
        local = session.local.get(previous) if isinstance(previous, str) else None
        doc = {k: v for k, v in event.items() if not (k == "previous_response_id" and local)}
        try:
            self.held(doc)  # (an unknown reference is refused before it queues)
        except Refused as exc:
            error(exc.status, exc.code, exc.message)
            return None

        session.creates += 1
        late = self.keys[session.key].stagger and session.creates % 2 == 1

        def run() -> None:
            if late:
                time.sleep(self.interval * 40)
            with session.slots:  # queued, before its response.created, until a slot frees
                if session.closed:
                    return
                try:
                    plan = self.plan(session.key, "responses_ws", model, size, doc,
                                     extra_input=local or 0)
                except Refused as exc:
                    error(exc.status, exc.code, exc.message)
                    return
                if plan.fault == "refuse_5xx":
                    error(500, "server_error", "The server had an error.")
                    return
                rid = "resp_" + secrets.token_hex(12)
                session.local[rid] = min(self.limits(model).context_window,
                                         plan.input + plan.generated)
                if event.get("store", True) is not False:
                    with self.lock:
                        self.responses[rid] = session.local[rid]
                for item in _response_events(rid, model, plan, self.interval):
                    if item is None:
                        session.conn.close(1011, "server error")
                        return
                    session.send({**item, **lane})
        return run


def _quietly(work: Callable[[], None]) -> None:
    with contextlib.suppress(websockets.exceptions.ConnectionClosed, OSError):
        work()


# -- answers in the providers' shapes --------------------------------------------------------


def _response_usage(plan: Plan) -> dict[str, Any]:
    return {"input_tokens": plan.input,
            "input_tokens_details": {"cached_tokens": plan.held},
            "output_tokens": plan.generated,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": plan.input + plan.generated}


def _response_object(rid: str, model: str, plan: Plan, status: str,
                     usage: bool) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": [] if status == "in_progress" else [{
                "type": "message", "id": "msg_" + rid[5:], "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": "tok " * DELTAS,
                             "annotations": []}]}],
            "usage": _response_usage(plan) if usage else None}


def _response_events(rid: str, model: str, plan: Plan, interval: float
                     ) -> Iterator[dict[str, Any] | None]:
    """A Responses API stream (SSE or WebSocket): None where it is cut off."""
    seq = iter(range(1 << 30))
    start = _response_object(rid, model, plan, "in_progress", False)
    yield {"type": "response.created", "sequence_number": next(seq), "response": start}
    yield {"type": "response.in_progress", "sequence_number": next(seq), "response": start}
    for i in range(plan.deltas):
        if plan.fault in ("error_after_tokens", "cut") and i == plan.deltas // 2:
            break
        time.sleep(interval)
        yield {"type": "response.output_text.delta", "sequence_number": next(seq),
               "item_id": "msg_" + rid[5:], "output_index": 0, "content_index": 0,
               "delta": "tok "}
    if plan.fault == "cut":
        yield None
        return
    if plan.fault == "error_after_tokens":
        yield {"type": "error", "sequence_number": next(seq), "status": 500,
               "code": "server_error", "param": None,
               "error": {"type": "server_error", "code": "server_error",
                         "message": "The server had an error while processing your request."},
               "message": "The server had an error while processing your request."}
        return
    yield {"type": "response.completed", "sequence_number": next(seq),
           "response": _response_object(rid, model, plan, "completed",
                                        plan.fault != "no_usage")}


def _sse(event: dict[str, Any], name: str | None = None) -> bytes:
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(event)}\n\n".encode()


@dataclass
class Answer:
    """An HTTP answer: ``body`` bytes, or chunks to stream (None: cut the connection)."""

    status: int
    body: bytes | list[bytes | None]
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


def _json(status: int, doc: Any, headers: dict[str, str] | None = None) -> Answer:
    return Answer(status, json.dumps(doc).encode(), headers or {})


def _chat(model: str, plan: Plan, stream: bool, include_usage: bool) -> Answer:
    usage = {"prompt_tokens": plan.input, "completion_tokens": plan.generated,
             "total_tokens": plan.input + plan.generated,
             "prompt_tokens_details": {"cached_tokens": plan.held}}
    cid = "chatcmpl-" + secrets.token_hex(8)
    if not stream:
        doc: dict[str, Any] = {
            "id": cid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{
                "index": i, "finish_reason": "length",
                "message": {"role": "assistant", "content": "tok " * DELTAS}}
                for i in range(plan.choices)]}
        if plan.fault != "no_usage":
            doc["usage"] = usage
        return _json(200, doc)
    chunks: list[bytes | None] = []
    base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    for i in range(plan.deltas):
        if plan.fault in ("error_after_tokens", "cut") and i == plan.deltas // 2:
            break
        chunks.append(_sse({**base, "choices": [{"index": 0, "delta": {"content": "tok "},
                                                 "finish_reason": None}]}))
    if plan.fault == "cut":
        return Answer(200, [*chunks, None], content_type="text/event-stream")
    if plan.fault == "error_after_tokens":
        chunks.append(_sse({"error": {"message": "The server had an error while processing "
                                      "your request.", "type": "server_error",
                                      "code": "server_error"}}))
        return Answer(200, chunks, content_type="text/event-stream")
    chunks.append(_sse({**base, "choices": [{"index": 0, "delta": {},
                                             "finish_reason": "length"}]}))
    if include_usage and plan.fault != "no_usage":
        chunks.append(_sse({**base, "choices": [], "usage": usage}))
    chunks.append(b"data: [DONE]\n\n")
    return Answer(200, chunks, content_type="text/event-stream")


def _responses(rid: str, model: str, plan: Plan, stream: bool) -> Answer:
    if not stream:
        status = "incomplete" if plan.fault == "error_after_tokens" else "completed"
        return _json(200, _response_object(rid, model, plan, status,
                                           plan.fault not in ("no_usage",
                                                              "error_after_tokens")))
    chunks: list[bytes | None] = []
    for event in _response_events(rid, model, plan, 0.0):
        chunks.append(None if event is None else _sse(event, event["type"]))
    return Answer(200, chunks, content_type="text/event-stream")


def _gemini(model: str, plan: Plan, method: str, sse: bool, cached: int) -> Answer:
    meta = {"promptTokenCount": plan.input, "candidatesTokenCount": plan.generated,
            "totalTokenCount": plan.input + plan.generated}
    if cached:
        meta["cachedContentTokenCount"] = cached

    def piece(last: bool) -> dict[str, Any]:
        doc: dict[str, Any] = {"candidates": [{
            "content": {"role": "model", "parts": [{"text": "tok "}]}, "index": i,
            **({"finishReason": "MAX_TOKENS"} if last else {})}
            for i in range(plan.choices)], "modelVersion": model}
        if last and plan.fault != "no_usage":
            doc["usageMetadata"] = meta
        return doc

    if method.lower() == "generatecontent":
        return _json(200, piece(True))
    pieces: list[dict[str, Any] | None] = [piece(False) for _ in range(plan.deltas - 1)]
    if plan.fault in ("error_after_tokens", "cut"):
        pieces = pieces[:plan.deltas // 2]
        pieces.append(None if plan.fault == "cut" else {"error": {
            "code": 500, "message": "An internal error has occurred.", "status": "INTERNAL"}})
    else:
        pieces.append(piece(True))
    if sse:
        return Answer(200, [None if p is None else b"data: " + json.dumps(p).encode()
                            + b"\r\n\r\n" for p in pieces], content_type="text/event-stream")
    chunks: list[bytes | None] = []
    for i, p in enumerate(pieces):
        chunks.append(None if p is None else (b"[" if i == 0 else b",\r\n")
                      + json.dumps(p).encode())
    if chunks and chunks[-1] is not None:
        chunks.append(b"]")
    return Answer(200, chunks)


def _anthropic(model: str, plan: Plan, stream: bool, headers: dict[str, str] | None = None
               ) -> Answer:
    usage = {"input_tokens": plan.input, "output_tokens": plan.generated,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    mid = "msg_" + secrets.token_hex(8)
    msg: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "model": model,
                           "content": [{"type": "text", "text": "tok " * DELTAS}],
                           "stop_reason": "max_tokens", "stop_sequence": None}
    if plan.fault != "no_usage":
        msg["usage"] = usage
    if not stream:
        return _json(200, msg, headers)
    start = {**msg, "content": [], "stop_reason": None}
    if plan.fault != "no_usage":
        start["usage"] = {**usage, "output_tokens": 1}
    chunks: list[bytes | None] = [_sse({"type": "message_start", "message": start},
                                       "message_start")]
    for i in range(plan.deltas):
        if plan.fault in ("error_after_tokens", "cut") and i == plan.deltas // 2:
            break
        chunks.append(_sse({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": "tok "}},
                           "content_block_delta"))
    if plan.fault == "cut":
        return Answer(200, [*chunks, None], content_type="text/event-stream")
    if plan.fault == "error_after_tokens":
        chunks.append(_sse({"type": "error", "error": {"type": "overloaded_error",
                                                       "message": "Overloaded"}}, "error"))
        return Answer(200, chunks, content_type="text/event-stream")
    delta: dict[str, Any] = {"type": "message_delta",
                             "delta": {"stop_reason": "max_tokens", "stop_sequence": None}}
    if plan.fault != "no_usage":
        delta["usage"] = {"output_tokens": plan.generated}
    chunks += [_sse(delta, "message_delta"), _sse({"type": "message_stop"}, "message_stop")]
    return Answer(200, chunks, content_type="text/event-stream")


# -- the HTTP side ----------------------------------------------------------------------------


def _normal(path: str) -> str:
    """The path as a lenient router reads it: escapes decoded, repeated slashes and
    ``;params`` dropped (any case is matched by the routes)."""
    path = unquote(path)
    path = "/".join(segment.split(";", 1)[0] for segment in path.split("/"))
    return re.sub(r"//+", "/", path).rstrip("/") or "/"


_I = re.IGNORECASE
_ROUTES: list[tuple[re.Pattern[str], str]] = [(re.compile(p, _I), name) for p, name in (
    (r"^(?:/openai)?(?:/v1)?/chat/completions$", "chat"),
    (r"^/openai/deployments/([^/]+)/chat/completions$", "azure_chat"),
    (r"^(?:/openai)?/v1/responses$", "responses"),
    (r"^(?:/openai)?/v1/embeddings$", "embeddings"),
    (r"^/v1/files$", "files"),
    (r"^/v1/conversations$", "conversations"),
    (r"^/v1/containers$", "containers"),
    (r"^/v1/ocr$", "ocr"),
    (r"^/v1/messages$", "messages"),
    (r"^/v1(?:beta)?/(?:projects/[^/]+/locations/[^/]+/publishers/google/)?models/([^/:]+)"
     r":(generateContent|streamGenerateContent)$", "gemini"),
    (r"^/v1/projects/[^/]+/locations/[^/]+/endpoints/([^/:]+)"
     r":(generateContent|streamGenerateContent)$", "vertex_endpoint"),
    (r"^/v1/projects/[^/]+/locations/[^/]+/endpoints/([^/:]+):(predict|rawPredict)$",
     "vertex_predict"),
    (r"^/v1(?:beta)?/cachedContents$", "cached_contents"),
    (r"^/model/([^/]+)/(invoke|converse)$", "bedrock"),
    (r"^/async-invoke$", "async_invoke"),
)]


def _key(headers: dict[str, str], query: dict[str, list[str]]) -> str:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for name in ("api-key", "x-api-key", "x-goog-api-key"):
        if headers.get(name):
            return headers[name].strip()
    return query.get("key", [""])[0]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    provider: HostileProvider

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    def _serve(self) -> None:
        body = read_body(self.headers, cast(BinaryIO, self.rfile))
        url = urlsplit(self.path)
        headers = {k.lower(): v for k, v in self.headers.items()}
        query = parse_qs(url.query)
        path = _normal(url.path)
        provider = self.provider
        key = _key(headers, query)
        with provider.lock:
            known = key in provider.keys
        if not known:
            return self._answer(_json(401, {"error": {
                "message": "Incorrect API key provided.", "type": "invalid_request_error",
                "code": "invalid_api_key"}}))
        for pattern, name in _ROUTES:
            m = pattern.match(path)
            if m is None:
                continue
            if self.command not in ("POST", "PUT", "PATCH"):
                return self._answer(_json(405, {"error": {"message": "Method not allowed"}}))
            try:
                doc = json.loads(body) if body.strip() else {}
            except ValueError:
                doc = None
            if name != "files" and not isinstance(doc, dict):
                return self._answer(_json(400, {"error": {"message": "not a JSON object"}}))
            try:
                answer = self._route(name, m, key, body, doc or {}, query)
            except Refused as exc:
                answer = _json(exc.status, {"error": {"message": exc.message,
                                                      "code": exc.code}})
            return self._answer(answer)
        return self._answer(_json(404, {"error": {"message": f"no route {path[:80]}"}}))

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _route(self, name: str, m: re.Match[str], key: str, body: bytes,
               doc: dict[str, Any], query: dict[str, list[str]]) -> Answer:
        p = self.provider
        size = len(body)
        stream = doc.get("stream") is True
        model = str(doc.get("model") or "")
        if name == "files":
            return _json(200, {"id": p.hold_file(size), "object": "file", "bytes": size})
        if name == "conversations" and "mistral" not in self.headers.get("Host", ""):
            return _json(200, {"id": p.hold_conversation(size), "object": "conversation"})
        if name == "azure_chat":
            name, model = "chat", p.deployments.get(m.group(1), m.group(1))
        if name in ("gemini", "vertex_endpoint", "vertex_predict"):
            model = m.group(1) if name == "gemini" else p.deployments.get(
                m.group(1), next(iter(p.models)))
        if name == "bedrock":
            model = m.group(1)
        if name == "async_invoke":
            model = str(doc.get("modelId") or "")
        if name == "containers":
            model = p.container_model
        plan = p.plan(key, name, model, size, doc, output=name not in (
            "embeddings", "cached_contents"))
        if plan.fault == "refuse_5xx":
            return _json(503, {"error": {"message": "The engine is currently overloaded",
                                         "type": "server_error", "code": "overloaded"}})
        if name == "chat":
            options = doc.get("stream_options")
            include = isinstance(options, dict) and options.get("include_usage") is True
            return _chat(model, plan, stream, include)
        if name == "responses":
            rid = "resp_" + secrets.token_hex(12)
            context = min(p.limits(model).context_window, plan.input + plan.generated)
            if doc.get("store", True) is not False:
                with p.lock:
                    p.responses[rid] = context
            conv = doc.get("conversation")
            conv = conv.get("id") if isinstance(conv, dict) else conv
            if isinstance(conv, str):
                with p.lock:
                    p.conversations[conv] = context
            return _responses(rid, model, plan, stream)
        if name == "embeddings":
            return _json(200, {"object": "list", "model": model, "data": [
                {"object": "embedding", "index": 0, "embedding": [0.0] * 8}],
                "usage": {"prompt_tokens": plan.input, "total_tokens": plan.input}})
        if name in ("gemini", "vertex_endpoint"):
            sse = query.get("alt") == ["sse"]
            return _gemini(model, plan, m.group(2), sse, plan.held)
        if name == "cached_contents":
            cache = p.hold_cache(plan.input)
            return _json(200, {"name": cache, "model": f"models/{model}",
                               "usageMetadata": {"totalTokenCount": plan.input}})
        if name == "messages":
            return _anthropic(model, plan, stream)
        if name == "bedrock":
            if m.group(2).lower() == "converse":
                return _json(200, {
                    "output": {"message": {"role": "assistant",
                                           "content": [{"text": "tok " * DELTAS}]}},
                    "stopReason": "max_tokens", "metrics": {"latencyMs": 1}, **({} if
                    plan.fault == "no_usage" else {"usage": {
                        "inputTokens": plan.input, "outputTokens": plan.generated,
                        "totalTokens": plan.input + plan.generated}})})
            counts = {} if plan.fault == "no_usage" else {
                "x-amzn-bedrock-input-token-count": str(plan.input),
                "x-amzn-bedrock-output-token-count": str(plan.generated)}
            return _anthropic(model, plan, False, counts)
        if name == "vertex_predict":
            return _json(200, {"predictions": [{"content": "tok " * DELTAS}],
                               "deployedModelId": m.group(1), "model": model})
        if name == "async_invoke":
            return _json(200, {"invocationArn": "arn:aws:bedrock:us-east-1:000000000000:"
                                                "async-invoke/" + secrets.token_hex(6)})
        if name == "ocr":
            return _json(200, {"pages": [{"index": 0, "markdown": "tok " * DELTAS}],
                               "model": model,
                               "usage_info": {"pages_processed": 1, "doc_size_bytes": size}})
        if name == "containers":
            return _json(200, {"id": "cntr_" + secrets.token_hex(8), "object": "container",
                               "status": "running"})
        # Mistral's conversations: an agent's run, usage in the OpenAI shape.
        return _json(200, {"object": "conversation.response",
                           "conversation_id": "conv_" + secrets.token_hex(8),
                           "outputs": [{"type": "message.output", "content": "tok "}],
                           "usage": {"prompt_tokens": plan.input,
                                     "completion_tokens": plan.generated,
                                     "total_tokens": plan.input + plan.generated}})

    def _answer(self, answer: Answer) -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        for name, value in answer.headers.items():
            self.send_header(name, value)
        if isinstance(answer.body, bytes):
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in answer.body:
            if chunk is None:  # cut off: no last chunk, the connection closed
                self.wfile.flush()
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.request.shutdown(socket.SHUT_RDWR)
                return
            time.sleep(self.provider.interval)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    request_queue_size = 256
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # (a client that hung up mid-answer: nothing to report)


def _start_http(provider: HostileProvider) -> ThreadingHTTPServer:
    (provider.directory / "http").mkdir(parents=True, exist_ok=True)
    ctx: ssl.SSLContext = provider.ca.server_context(provider.directory / "http", HOSTS)
    handler = type("Handler", (_Handler,), {"provider": provider})
    server = _Server(("127.0.0.1", 0), handler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    provider._threads.append(thread)
    return server
