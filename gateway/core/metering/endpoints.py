"""Which inference API a request calls, and which model it names (pure, no I/O).

Every check reads the path once, as the provider's router does (``route``: the policy's
normalised path, escapes decoded, repeated and trailing slashes dropped), so no other
spelling of an endpoint is a way around the meter, the usage option or the allowlist.
Classification is by method and path, not by preset: the endpoints of the providers
are distinct, and a custom credential (no preset) on an OpenAI-compatible host is
metered the same way. ``classify`` sorts a request into one of these kinds:

* ``inference``: usage is read from the response (``format`` says how):
  ``openai`` (``.../chat/completions``, ``/completions``, ``/embeddings``,
  ``/responses``, ``/responses/compact``: OpenAI, Azure ``/openai/deployments/{d}/...``
  and ``/openai/v1/...``, Mistral, Groq, OpenRouter, Hugging Face's router),
  ``anthropic`` (``.../v1/messages``; Claude on Vertex AI ``:rawPredict``), ``gemini``
  (``models/{m}:generateContent|streamGenerateContent``, Vertex ``publishers/google``,
  ``tunedModels``), ``bedrock`` (``/model/{id}/converse`` and ``/invoke``);
* ``session``: a WebSocket of many calls, metered from its events: ``realtime`` (OpenAI
  ``GET /v1/realtime``, Azure ``/openai/realtime``, ``/openai/v1/realtime``) and
  ``responses_ws`` (the Responses API over WebSocket, ``GET /v1/responses``);
* ``deferred``: work whose usage is known only later (OpenAI Batch, Anthropic Message
  Batches, Gemini batches; ``POST /v1/responses`` with ``"background": true`` is decided
  on its body by the metering step);
* ``retrieval``: where that usage is read (``GET /v1/responses/{id}``, ``GET
  /v1/batches/{id}``, ``GET /v1/messages/batches/{id}/results``);
* ``minted``: the provider mints a secret for the sandbox (OpenAI Realtime client
  secrets and sessions, ChatKit sessions, Gemini ephemeral auth tokens);
* ``unmetered``: inference the gateway cannot read usage of (images, audio, video,
  fine-tuning, Assistants runs, WebRTC calls, streamed Bedrock, Gemini embeddings,
  predict and Live sessions).

Everything else (``GET /v1/models``, ``/v1/files``, ``count_tokens``...) is not
inference. The model a request names is the path's (Gemini/Vertex model, Azure
deployment, Bedrock model id) when there is one, else the JSON body's ``model``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from gateway.core.metering.jsondoc import document
from gateway.core.policy.paths import normalize_path

__all__ = [
    "Body",
    "Endpoint",
    "Format",
    "Kind",
    "PathModel",
    "RequestBody",
    "body_json",
    "classify",
    "endpoint_text",
    "field_of",
    "json_body",
    "not_inference",
    "path_model",
    "raw_body",
    "request_model",
    "rewrite_request_body",
    "route",
    "stream_usage",
]

Format = Literal["openai", "anthropic", "gemini", "bedrock", "realtime", "responses_ws",
                 "jsonl"]
Kind = Literal["inference", "session", "deferred", "retrieval", "minted", "unmetered"]

_OPENAI_SUFFIXES = ("/chat/completions", "/completions", "/embeddings", "/responses",
                    "/responses/compact")
_STREAM_USAGE_SUFFIXES = ("/chat/completions", "/completions")
_ANTHROPIC_VERTEX = re.compile(r"/publishers/anthropic/models/([^/:]+):(?:stream)?[rR]awPredict$")
_GEMINI = re.compile(r"(?:^|/)(models|tunedModels|endpoints)/([^/:]+):([A-Za-z]+)$")
_GEMINI_METERED = ("generateContent", "streamGenerateContent")
_GEMINI_FREE = ("countTokens", "computeTokens", "get")
_GEMINI_DEFERRED = ("batchGenerateContent", "asyncBatchEmbedContent")
_AZURE_DEPLOYMENT = re.compile(r"^/openai/deployments/([^/]+)/")
_BEDROCK = re.compile(r"^/model/([^/]+)/(invoke|invoke-with-response-stream|converse|"
                      r"converse-stream)$")
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}")
_SAFE_ARN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,299}")
_API_VERSION = re.compile(r"(?:^|&)api-version=(\d{4}-\d{2}-\d{2})")
# Azure OpenAI accepts stream_options from these API versions on (older ones refuse it).
_AZURE_STREAM_OPTIONS_SINCE = "2024-09-01"


@dataclass(frozen=True, slots=True)
class PathModel:
    """A model named in the request path: ``name`` if it is a plain name, else None
    (``raw`` is the undecoded segment, for reasons)."""

    name: str | None
    raw: str


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What a request calls (see the module docstring): its ``kind``, how its usage is
    read (``format``, None where it is not read), the model in its path, if any, and
    ``what`` it is in a reason ("the OpenAI Batch API")."""

    format: Format | None
    path_model: PathModel | None
    kind: Kind = "inference"
    what: str = ""


def _split(path: str) -> tuple[str, str]:
    base, _, query = path.partition("?")
    return base, query


def _decode(segment: str, pattern: re.Pattern[str]) -> PathModel:
    """Percent-decode a path segment once; keep it only if it is a plain name (no
    escapes left, no separators or dot segments a provider could re-interpret)."""
    try:
        name = unquote(segment, errors="strict")
    except UnicodeDecodeError:
        return PathModel(None, segment)
    if not pattern.fullmatch(name) or any(p in (".", "..") for p in name.split("/")):
        return PathModel(None, segment)
    return PathModel(name, segment)


@functools.lru_cache(maxsize=2048)  # agents repeat their paths; PathModel is immutable
def path_model(path: str) -> PathModel | None:
    """The model named by the path (Gemini/Vertex, Azure deployment, Bedrock), or None.
    A path that names a model only once decoded (``models/x%3AgenerateContent``) names
    one that is not a plain name: an allowlist refuses it."""
    base = normalize_path(path)[0]  # (the query stripped, slashes as the router reads them)
    found = _path_model(base)
    if found is None and "%" in base and _path_model(unquote(base, errors="replace")) \
            is not None:
        return PathModel(None, base)
    return found


def _path_model(base: str) -> PathModel | None:
    m = _ANTHROPIC_VERTEX.search(base)
    if m:
        return _decode(m.group(1), _SAFE_NAME)
    m = _GEMINI.search(base)
    if m:
        decoded = _decode(m.group(2), _SAFE_NAME)
        if m.group(1) != "models" and decoded.name is not None:  # (a tuned model's or a
            return PathModel(f"{m.group(1)}/{decoded.name}", decoded.raw)  # Vertex endpoint's)
        return decoded
    m = _AZURE_DEPLOYMENT.match(base)
    if m:
        return _decode(m.group(1), _SAFE_NAME)
    m = _BEDROCK.match(base)
    if m:
        return _decode(m.group(1), _SAFE_ARN)
    return None


_QUERY_MODEL_KEYS = ("model", "deployment")


def query_models(path: str) -> list[PathModel]:
    """Models named in the query string: ``model=`` (OpenAI Realtime) and
    ``deployment=`` (Azure OpenAI Realtime), each decoded once and kept as a name only
    if it is a plain one."""
    _, query = _split(path)
    if not query:
        return []
    found = []
    for part in query.split("&"):
        key, sep, value = part.partition("=")
        if sep and unquote(key, errors="replace").lower() in _QUERY_MODEL_KEYS:
            found.append(_decode(value.replace("+", " "), _SAFE_NAME))
    return found


@functools.lru_cache(maxsize=4096)
def route(path: str) -> str:
    """The path as a provider's router reads it: the policy's normalised path (query
    stripped, repeated and trailing slashes dropped) with every escape decoded, so
    ``/v1/chat/completion%73/`` is ``/v1/chat/completions``. The one reading every
    metering check uses (counting a path the provider then refuses costs one request,
    no more)."""
    base = normalize_path(path)[0]
    return unquote(base, errors="replace") if "%" in base else base


def _endpoint(kind: Kind, what: str, fmt: Format | None = None,
              model: PathModel | None = None) -> Endpoint:
    return Endpoint(fmt, model, kind, what)


_REALTIME = _endpoint("session", "a Realtime session", "realtime")
_RESPONSES_WS = _endpoint("session", "a Responses API WebSocket session", "responses_ws")
_OPENAI_BATCH = _endpoint("deferred", "the OpenAI Batch API")
_ANTHROPIC_BATCH = _endpoint("deferred", "Anthropic Message Batches")
_RESPONSE_GET = _endpoint("retrieval", "a Responses API retrieval", "openai")
_BATCH_GET = _endpoint("retrieval", "an OpenAI batch retrieval", "openai")
_ANTHROPIC_RESULTS = _endpoint("retrieval", "Anthropic Message Batch results", "jsonl")
_MINTED = _endpoint("minted", "a provider-minted secret")
_ID = r"/[A-Za-z0-9_.:-]+"
# Inference whose usage the gateway cannot read (no usage in the answer, or not relayed
# through it): refused on rules that must be metered.
_UNMETERED = [(re.compile(p + "$"), what) for p, what in (
    (r"/images/(?:generations|edits|variations)", "image generation"),
    (r"/audio/(?:speech|transcriptions|translations)", "audio"),
    (r"/videos(?:/.*)?", "video generation"),
    (r"/fine_tuning/(?:jobs|alpha/graders/run)", "fine-tuning"),
    (r"/threads(?:" + _ID + r")?/runs(?:" + _ID + r"/submit_tool_outputs)?",
     "an Assistants run"),
    (r"/realtime/calls(?:/.*)?", "a WebRTC Realtime call"),
    (r"/evals" + _ID + "/runs", "an eval run"),
    (r"/v1/complete", "Anthropic's legacy Text Completions"),
    (r"/async-invoke(?:/.*)?", "a Bedrock asynchronous invocation"),
    (r"/cachedContents(?:/.*)?", "Gemini context caching"),
    (r"/interactions(?:/.*)?", "Gemini's Interactions API"),
    (r"/conversations(?:/.*)?", "a Conversations API call (Mistral runs models there)"),
    (r"/ocr", "OCR"),
    (r"/containers(?:/.*)?", "code-interpreter containers"),
    (r"/(?:chat/)?moderations", "moderation (billed by some providers)"),
)]
# Requests to a provider that are explicitly not inference: nothing is generated or
# billed by the token (listing and reading models, files and jobs, counting tokens,
# cancelling). On a rule that must be metered every other request the gateway does not
# classify is refused (default deny): a new endpoint, method or spelling is never let
# through unread. (method, pattern on the routed path.)
_ID_PART = r"[A-Za-z0-9_.:@+-]+"
_NOT_INFERENCE = [(frozenset(methods.split()), re.compile(pattern + "$")) for methods, pattern in (
    ("GET HEAD", r"(?:^|/)models(?:/" + _ID_PART + r")?"),
    ("GET HEAD", r"(?:^|/)(?:models|tunedModels)/" + _ID_PART + r"/operations(?:/" + _ID_PART
     + ")?"),
    ("POST", r"(?:^|/)(?:models|tunedModels|endpoints)/" + _ID_PART
     + r":(?:countTokens|computeTokens)"),
    ("POST", r"^/model/" + _ID_PART + r"/count-tokens"),
    ("POST", r"/v1/messages/count_tokens"),
    ("POST", r"/responses/input_tokens"),
    ("GET HEAD DELETE", r"/files(?:/" + _ID_PART + r"(?:/content)?)?"),
    ("POST", r"/files"),
    ("POST", r"/uploads(?:/" + _ID_PART + r"(?:/parts|/complete|/cancel)?)?"),
    ("GET HEAD DELETE", r"/responses/" + _ID_PART),
    ("POST", r"/responses/" + _ID_PART + r"/cancel"),
    ("GET HEAD", r"/responses/" + _ID_PART + r"/input_items"),
    ("GET HEAD", r"/batches(?:/" + _ID_PART + r")?"),
    ("POST", r"/batches/" + _ID_PART + r"/cancel"),
    ("GET HEAD", r"/messages/batches(?:/" + _ID_PART + r")?"),
    ("POST", r"/messages/batches/" + _ID_PART + r"/cancel"),
    ("DELETE", r"/messages/batches/" + _ID_PART),
    ("GET HEAD", r"/chat/completions(?:/" + _ID_PART + r"(?:/messages)?)?"),
    ("DELETE", r"/chat/completions/" + _ID_PART),
    ("GET HEAD", r"/fine_tuning/jobs(?:/" + _ID_PART + r"(?:/events|/checkpoints)?)?"),
    ("POST", r"/fine_tuning/jobs/" + _ID_PART + r"/cancel"),
    ("GET HEAD", r"/operations(?:/" + _ID_PART + r")?"),
    ("GET HEAD", r"/cachedContents(?:/" + _ID_PART + r")?"),
    ("DELETE", r"/cachedContents/" + _ID_PART),
    ("GET HEAD", r"/conversations/" + _ID_PART + r"(?:/items(?:/" + _ID_PART + r")?)?"),
    ("DELETE", r"/conversations/" + _ID_PART),
)]
_MINTED_PATHS = re.compile(r"/(?:realtime/(?:client_secrets|sessions|transcription_sessions|"
                           r"translations/client_secrets)|realtimeapi/sessions|"
                           r"chatkit/sessions|v1alpha/auth_tokens)$")


@functools.lru_cache(maxsize=2048)
def not_inference(method: str, path: str) -> str | None:
    """The pattern that says ``method path`` is explicitly not inference (see
    ``_NOT_INFERENCE``: read with the provider's router's reading of the path, method
    and path exactly as listed), or None."""
    method = method.upper()
    base = route(path)
    for methods, pattern in _NOT_INFERENCE:
        if method in methods and pattern.search(base):
            return pattern.pattern
    return None


def endpoint_text(method: str, path: str) -> str:
    """``METHOD /path`` as a reason shows it (the query left out, clipped)."""
    base = path.partition("?")[0]
    return f"{method.upper()[:16]} {base[:120]}{'...' if len(base) > 120 else ''}"


@functools.lru_cache(maxsize=2048)
def classify(method: str, path: str) -> Endpoint | None:
    """What ``method path`` calls (see the module docstring), or None: not inference."""
    method = method.upper()
    base = route(path)
    if method == "GET":  # WebSocket sessions (their upgrade) and retrievals
        if base.endswith("/realtime"):
            return _REALTIME
        if base.endswith("/responses"):
            return _RESPONSES_WS
        if "BidiGenerateContent" in base:
            return _endpoint("unmetered", "a Gemini Live session")
        if re.search(r"/responses" + _ID + "$", base):
            return _RESPONSE_GET
        if re.search(r"/batches/batch_[A-Za-z0-9_-]+$", base):
            return _BATCH_GET
        if re.search(r"/messages/batches" + _ID + "/results$", base):
            return _ANTHROPIC_RESULTS
        return None
    if method != "POST":
        return None
    m = _ANTHROPIC_VERTEX.search(base)
    if m:
        return Endpoint("anthropic", path_model(path))
    m = _GEMINI.search(base)
    if m:
        verb = m.group(3)
        if verb in _GEMINI_METERED:
            return Endpoint("gemini", path_model(path))
        if verb in _GEMINI_FREE:
            return None
        if verb in _GEMINI_DEFERRED:
            return _endpoint("deferred", "the Gemini Batch API", None, path_model(path))
        if m.group(1) == "endpoints":
            return _endpoint("unmetered", f"a Vertex AI endpoint's {verb[:40]}", None,
                             path_model(path))
        return _endpoint("unmetered", f"Gemini's {verb[:40]}", None, path_model(path))
    m = _BEDROCK.match(base)
    if m:
        if m.group(2).endswith("stream"):
            return _endpoint("unmetered", "a streamed Bedrock call", None, path_model(path))
        return Endpoint("bedrock", path_model(path))
    if base.endswith("/v1/messages"):
        return Endpoint("anthropic", None)
    if base.endswith("/messages/batches"):
        return _ANTHROPIC_BATCH
    if base.endswith(_OPENAI_SUFFIXES):
        return Endpoint("openai", path_model(path))
    if base.endswith("/batches") and not base.endswith("/file_batches"):
        return _OPENAI_BATCH
    if _MINTED_PATHS.search(base):
        return _MINTED
    for pattern, what in _UNMETERED:
        if pattern.search(base):
            return _endpoint("unmetered", what, None, path_model(path))
    return None


# The fields the gateway reads are top-level ones, so objects are read as lists of
# (key, value) pairs and only the top level is made a dict, checked for repeated keys:
# `list` as the hook keeps the whole parse in C (a Python hook per object costs a third
# more on an agent's long conversation). A body the gateway re-encodes is read again
# into plain dicts (a repeated key inside them is gone once re-encoded).
_PAIRS = json.JSONDecoder(object_pairs_hook=list)
_DICTS = json.JSONDecoder()


def body_json(body: bytes) -> dict[str, Any] | None:
    """The top-level fields of ``body``, a JSON object, or None: strict UTF-8, the top
    level an object, no key repeated there, not even in another case (``"model"`` and
    ``"Model"``: a provider could read the other copy). A field whose value is an object
    holds its (key, value) pairs."""
    if body.lstrip()[:1] != b"{":
        return None
    try:
        pairs = document(body, _PAIRS)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    fields = dict(pairs)
    if len(fields) != len(pairs):
        return None
    keys = "".join(fields)  # (cheap: only a body with an upper-case key needs the set)
    if keys != keys.lower() and len({k.lower() for k in fields}) != len(fields):
        return None
    return fields


def field_of(value: Any, key: str) -> Any:
    """``value[key]`` of a JSON object read as a dict or as (key, value) pairs (how
    ``body_json`` leaves the objects inside the top level); None if absent."""
    if isinstance(value, dict):
        return value.get(key)
    if isinstance(value, list):
        for pair in value:
            if isinstance(pair, list | tuple) and len(pair) == 2 and pair[0] == key:
                return pair[1]
    return None


class RequestBody:
    """A held request body whose JSON object is parsed at most once: the allowlist, the
    meter and the ``include_usage`` rewrite all read it. Treat ``json()`` as read-only."""

    __slots__ = ("_doc", "_parsed", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._doc: dict[str, Any] | None = None
        self._parsed = False

    def json(self) -> dict[str, Any] | None:
        if not self._parsed:
            self._doc, self._parsed = body_json(self.raw), True
        return self._doc


Body = bytes | RequestBody


def raw_body(body: Body | None) -> bytes | None:
    return body.raw if isinstance(body, RequestBody) else body


def json_body(body: Body) -> dict[str, Any] | None:
    return body.json() if isinstance(body, RequestBody) else body_json(body)


def request_model(preset: str | None, path: str, body: Body | None) -> str | None:
    """The model a request names: the path's, else the JSON body's ``model``, else the
    query's (a Realtime session); None if none says (or the body is not a JSON object).
    ``preset`` is accepted for symmetry with the other entry points; classification does
    not depend on it."""
    del preset
    named = path_model(path)
    if named is not None:
        return named.name
    if body is None or not raw_body(body):
        return next((q.name for q in query_models(path) if q.name is not None), None)
    data = json_body(body)
    model = data.get("model") if data is not None else None
    return model if isinstance(model, str) else None


# Providers whose OpenAI-shaped streams end with usage whether or not it is asked for.
_USAGE_ALWAYS = frozenset(("mistral", "groq", "openrouter"))
# Providers that take `stream_options` (asked for on every streamed call).
_USAGE_ASKED = frozenset(("openai", "huggingface"))


def stream_usage(preset: str | None, path: str, body: Body | None, *,
                 required: bool = False) -> tuple[bytes | None, str | None]:
    """How a streamed OpenAI-shaped chat/completions call will carry its usage:
    ``(body, problem)``. ``body`` is the request body to send instead (usage asked for:
    ``rewrite_request_body``), or None to send it unchanged; ``problem`` says why the
    usage cannot be read (only when ``required``: a rule that must be metered).

    Usage is asked for on OpenAI and Hugging Face's router always, on Azure OpenAI from
    api-version 2024-09-01 (and its ``/openai/v1`` API); Mistral, Groq and OpenRouter
    stream it unasked; on other hosts (a custom OpenAI-compatible API) it is asked for
    only where it is required. Anthropic, Gemini and the Responses API always stream it.
    """
    base = route(path)
    if not base.endswith(_STREAM_USAGE_SUFFIXES) or preset in _USAGE_ALWAYS:
        return None, None
    raw = raw_body(body)
    data = json_body(body) if body is not None and raw else None
    if data is None or data.get("stream") is not True:
        return None, None
    if preset == "azure-openai" and not base.startswith("/openai/v1/"):
        m = _API_VERSION.search(path.partition("?")[2])
        if m is None or m.group(1) < _AZURE_STREAM_OPTIONS_SINCE:
            version = m.group(1) if m else "none"
            problem = (f"a streamed call with api-version {version} cannot report its usage "
                       f"(Azure OpenAI takes stream_options from api-version "
                       f"{_AZURE_STREAM_OPTIONS_SINCE}); use api-version "
                       f"{_AZURE_STREAM_OPTIONS_SINCE} or later, or call without stream")
            return None, problem if required else None
    elif preset not in _USAGE_ASKED and not required and preset != "azure-openai":
        return None, None
    assert raw is not None
    return _ask_usage(raw, data), None


def rewrite_request_body(preset: str | None, path: str, body: Body | None) -> bytes | None:
    """The body to send instead of ``body`` (None: unchanged) on a rule that need not be
    metered: ``stream_usage`` without its problem."""
    return stream_usage(preset, path, body)[0]


def _ask_usage(raw: bytes, data: dict[str, Any]) -> bytes | None:
    """Add ``"stream_options": {"include_usage": true}`` to a streamed request (``data``
    its top-level fields) that has no ``stream_options`` (or set ``include_usage`` in the
    one it has), so the stream ends with a usage chunk the meter can count. None: it
    already asks.

    Without ``stream_options`` the key is inserted as text right after the opening brace:
    every other byte of the body stays as the client sent it (with one, the body is
    re-encoded). The caller must update Content-Length. The client
    then receives one more SSE chunk (``"choices": [], "usage": {...}``) before
    ``[DONE]``; the official SDKs handle it.
    """
    if "stream_options" in data:
        whole = document(raw, _DICTS)  # (it parsed as _PAIRS: it parses)
        options = whole["stream_options"]
        if options is None:
            options = {}  # null: as if absent (inserting a second key would repeat it)
        if not isinstance(options, dict):
            return None  # (the provider refuses the request anyway)
        if options.get("include_usage") is True and len(data["stream_options"]) == len(
                options):  # (its pairs: no key repeated, so true is what is read)
            return None
        # `include_usage: false` would stream tokens past every token budget: set it.
        # Re-encoded, the body has no repeated key left for the provider to read.
        return json.dumps({**whole, "stream_options": {**options, "include_usage": True}},
                          ensure_ascii=False).encode()
    start = raw.index(b"{")  # the JSON object parsed, so its opening brace exists
    return raw[: start + 1] + b'"stream_options":{"include_usage":true},' + raw[start + 1:]
