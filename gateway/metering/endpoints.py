"""Which inference API a request calls, and which model it names (pure, no I/O).

Classification is by method and path, not by preset: the endpoints of the providers
are distinct, and a custom credential (no preset) on an OpenAI-compatible host is
metered the same way. Only POSTs are inference calls; ``GET /v1/responses/{id}``
(retrieval) and the like are not.

* ``openai`` format: a path ending in ``/chat/completions``, ``/completions``,
  ``/embeddings`` or ``/responses`` (OpenAI ``/v1/...``, Azure
  ``/openai/deployments/{d}/...`` and ``/openai/v1/...``, Mistral ``/v1/fim/completions``,
  Groq ``/openai/v1/...``, OpenRouter ``/api/v1/...``, Hugging Face's router);
* ``anthropic`` format: ``.../v1/messages``, and Claude on Vertex AI
  (``.../publishers/anthropic/models/{m}:rawPredict|streamRawPredict``);
* ``gemini`` format: ``.../models/{m}:generateContent|streamGenerateContent`` (Gemini API
  and Vertex AI ``publishers/google``), ``tunedModels/{m}:...`` too;
* ``realtime`` format: ``GET .../realtime`` (OpenAI ``/v1/realtime``, Azure OpenAI
  ``/openai/realtime`` and ``/openai/v1/realtime``), the WebSocket of a Realtime session,
  metered from its server events.

The model a request names is the path's (Gemini/Vertex model, Azure deployment, Bedrock
model id) when there is one, else the JSON body's ``model``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

from gateway.metering.jsondoc import document

__all__ = [
    "Body",
    "Endpoint",
    "Format",
    "PathModel",
    "RequestBody",
    "body_json",
    "classify",
    "json_body",
    "path_model",
    "raw_body",
    "request_model",
    "rewrite_request_body",
]

Format = Literal["openai", "anthropic", "gemini", "realtime"]

_OPENAI_SUFFIXES = ("/chat/completions", "/completions", "/embeddings", "/responses")
_STREAM_USAGE_SUFFIXES = ("/chat/completions", "/completions")
_ANTHROPIC_VERTEX = re.compile(r"/publishers/anthropic/models/([^/:]+):(?:stream)?[rR]awPredict$")
_GEMINI = re.compile(
    r"(?:^|/)(models|tunedModels)/([^/:]+):"
    r"(generateContent|streamGenerateContent|countTokens|embedContent|batchEmbedContents)$"
)
_GEMINI_METERED = ("generateContent", "streamGenerateContent")
_AZURE_DEPLOYMENT = re.compile(r"^/openai/deployments/([^/]+)/")
_BEDROCK = re.compile(r"^/model/([^/]+)/(?:invoke|invoke-with-response-stream|converse|"
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
    """An inference endpoint: its response ``format`` and the model in its path, if any."""

    format: Format
    path_model: PathModel | None


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
    base, _ = _split(path)
    found = _path_model(base)
    if found is None and "%" in base and _path_model(_route(base)) is not None:
        return PathModel(None, base)
    return found


def _path_model(base: str) -> PathModel | None:
    m = _ANTHROPIC_VERTEX.search(base)
    if m:
        return _decode(m.group(1), _SAFE_NAME)
    m = _GEMINI.search(base)
    if m:
        decoded = _decode(m.group(2), _SAFE_NAME)
        if m.group(1) == "tunedModels" and decoded.name is not None:
            return PathModel(f"tunedModels/{decoded.name}", decoded.raw)
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


_SLASHES = re.compile(r"//+")


def _route(base: str) -> str:
    """The path as a provider's router sees it: escapes decoded, repeated and trailing
    slashes dropped, so ``/v1/chat/completion%73/`` is not an unmetered way to the same
    endpoint (counting a path the provider then refuses costs one request, no more)."""
    if "%" in base:
        base = unquote(base, errors="replace")
    if "//" in base:
        base = _SLASHES.sub("/", base)
    return base.rstrip("/") if len(base) > 1 else base


_REALTIME = Endpoint("realtime", None)


@functools.lru_cache(maxsize=2048)
def classify(method: str, path: str) -> Endpoint | None:
    """The metered endpoint ``method path`` calls, or None (not an inference call)."""
    method = method.upper()
    if method == "GET":  # a Realtime session: the WebSocket upgrade (its model: the query)
        return _REALTIME if _route(_split(path)[0]).endswith("/realtime") else None
    if method != "POST":
        return None
    base = _route(_split(path)[0])
    if _ANTHROPIC_VERTEX.search(base):
        return Endpoint("anthropic", path_model(path))
    m = _GEMINI.search(base)
    if m:
        if m.group(3) not in _GEMINI_METERED:
            return None
        return Endpoint("gemini", path_model(path))
    if base.endswith("/v1/messages"):
        return Endpoint("anthropic", None)
    if base.endswith(_OPENAI_SUFFIXES):
        return Endpoint("openai", path_model(path))
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
    level an object, no key repeated there (a provider could read the other copy). A
    field whose value is an object holds its (key, value) pairs."""
    if body.lstrip()[:1] != b"{":
        return None
    try:
        pairs = document(body, _PAIRS)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return None
    fields = dict(pairs)
    return fields if len(fields) == len(pairs) else None


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


def _wants_stream_usage(preset: str | None, path: str) -> bool:
    base, query = _split(path)
    if not base.endswith(_STREAM_USAGE_SUFFIXES):
        return False
    if preset == "openai":
        return True
    if preset == "azure-openai":
        if base.startswith("/openai/v1/"):
            return True
        m = _API_VERSION.search(query)
        return m is not None and m.group(1) >= _AZURE_STREAM_OPTIONS_SINCE
    return False


def rewrite_request_body(preset: str | None, path: str, body: Body | None) -> bytes | None:
    """Add ``"stream_options": {"include_usage": true}`` to an OpenAI (or recent Azure
    OpenAI) streaming chat/completions request that has no ``stream_options`` (or set
    ``include_usage`` in the one it has), so the stream ends with a usage chunk the
    meter can count. None = leave the body as is.

    Without ``stream_options`` the key is inserted as text right after the opening brace:
    every other byte of the body stays as the client sent it (with one, the body is
    re-encoded). The caller must update Content-Length. The client
    then receives one more SSE chunk (``"choices": [], "usage": {...}``) before
    ``[DONE]``; the official SDKs handle it.
    """
    raw = raw_body(body)
    if not raw or not _wants_stream_usage(preset, path):
        return None
    assert body is not None
    data = json_body(body)
    if data is None or data.get("stream") is not True:
        return None
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
    body = raw
    start = body.index(b"{")  # the JSON object parsed, so its opening brace exists
    return body[: start + 1] + b'"stream_options":{"include_usage":true},' + body[start + 1:]
