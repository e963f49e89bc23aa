"""Token usage read from inference responses as they are relayed (pure, no I/O).

``meter_for`` picks a ``Meter`` for a request (None: not an inference call); the caller
feeds it the response body chunks exactly as relayed (already decoded: the core removes
any gzip/br ``Content-Encoding`` before metering, as it does before scanning for leaks)
and calls ``finish`` once. Nothing is buffered beyond small bounds: an SSE stream is
scanned event by event, a JSON body is kept up to ``JSON_CAP`` (beyond, the usage is
salvaged from its last 64 KiB, where every provider puts it).

The body format is sniffed, not taken from the request: ``{`` is one JSON document, ``[``
a streamed JSON array (Gemini without ``alt=sse``), anything else SSE. So an error
answered as JSON to a streaming request is read right.

Normalised counts (``Usage``):

* ``input_tokens``: every input token, cached ones included (OpenAI ``prompt_tokens`` /
  ``input_tokens``; Anthropic ``input_tokens + cache_creation_input_tokens +
  cache_read_input_tokens``; Gemini ``promptTokenCount + toolUsePromptTokenCount``);
* ``output_tokens``: generated tokens, reasoning/thinking included (Gemini
  ``candidatesTokenCount + thoughtsTokenCount``); for embeddings ``total - input`` = 0;
* ``cached_input_tokens``: the part of the input read from a cache (OpenAI
  ``*_tokens_details.cached_tokens``, Anthropic ``cache_read_input_tokens``, Gemini
  ``cachedContentTokenCount``); None when the provider does not say.

Streams report cumulative counts, so for each provider field the last value seen wins
(Anthropic: ``message_start`` has the input, ``message_delta`` the final output).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gateway.core.metering.endpoints import Body, Format, classify, request_model
from gateway.core.metering.jsondoc import document
from gateway.core.metering.scan import ArrayScanner, Capture, SseScanner, salvage

__all__ = ["HOLD", "JSON_CAP", "RESPONSE_HOLD", "JsonlMeter", "Meter", "RealtimeMeter",
           "SessionMeter", "Usage", "meter_for"]

JSON_CAP = 1 << 20
"""Largest JSON body (or SSE line, or array element) kept whole for metering."""
HOLD = 16 << 10
"""Response bytes a meter holds (references to the relayed chunks) before scanning them
(at most this plus one chunk per metered exchange in flight)."""

RESPONSE_HOLD = 256 << 10
"""Largest answer held whole (a provider-minted secret's, read before it is relayed)."""

log = logging.getLogger("sandbox_gateway.metering")
_DECODER = json.JSONDecoder()
_BEDROCK_HEADERS = {"x-amzn-bedrock-input-token-count": "inputTokens",
                    "x-amzn-bedrock-output-token-count": "outputTokens"}


@dataclass(frozen=True, slots=True)
class Usage:
    """What one inference exchange used. None = the response did not say."""

    model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_input_tokens: int | None = None

    @property
    def known(self) -> bool:
        """True if the response reported token counts."""
        return self.input_tokens is not None or self.output_tokens is not None

    @property
    def tokens(self) -> int:
        """Input plus output tokens (unknown counts as 0), what ``tokens:`` budgets count."""
        return (self.input_tokens or 0) + (self.output_tokens or 0)

    def as_record(self) -> dict[str, Any]:
        """The ``usage`` object of the audit line."""
        return {
            "model": self.model,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_input_tokens": self.cached_input_tokens,
        }


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return int(value)


def _model(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _fields(doc: Mapping[str, Any], fmt: Format) -> tuple[str | None, dict[str, int]]:
    """The model and the raw provider counts one event/document carries."""
    counts: dict[str, int] = {}
    if fmt == "gemini":
        usage = doc.get("usageMetadata")
        if isinstance(usage, dict):
            # proto3 JSON leaves out zero counts: a usage object means absent = 0.
            for key in ("promptTokenCount", "candidatesTokenCount", "cachedContentTokenCount",
                        "thoughtsTokenCount", "toolUsePromptTokenCount"):
                counts[key] = _int(usage.get(key, 0)) or 0
        return _model(doc.get("modelVersion")) or _model(doc.get("model")), counts
    target: Any = doc
    if fmt == "anthropic" and isinstance(doc.get("message"), dict):
        target = doc["message"]  # message_start
    elif fmt in ("openai", "responses_ws") and isinstance(doc.get("response"), dict):
        target = doc["response"]  # Responses API stream events
    usage = target.get("usage")
    if not isinstance(usage, dict):
        groq = doc.get("x_groq")
        usage = groq.get("usage") if isinstance(groq, dict) else None
    if isinstance(usage, dict):
        for key, value in usage.items():
            number = _int(value)
            if number is not None:
                counts[key] = number
            elif isinstance(value, dict):  # *_tokens_details
                for sub, inner in value.items():
                    number = _int(inner)
                    if number is not None:
                        counts[f"{key}.{sub}"] = number
    return _model(target.get("model")), counts


def _normalise(fmt: Format, raw: Mapping[str, int], model: str | None) -> Usage:
    if not raw:
        return Usage(model)
    if fmt == "gemini":
        return Usage(
            model,
            raw["promptTokenCount"] + raw["toolUsePromptTokenCount"],
            raw["candidatesTokenCount"] + raw["thoughtsTokenCount"],
            raw["cachedContentTokenCount"],
        )
    if fmt == "bedrock":
        if "inputTokens" in raw or "outputTokens" in raw:  # Converse
            read = raw.get("cacheReadInputTokens")
            given = raw.get("inputTokens")
            total_in = None if given is None else (
                given + (read or 0) + raw.get("cacheWriteInputTokens", 0))
            return Usage(model, total_in, raw.get("outputTokens"), read)
        fmt = "anthropic"  # Claude through InvokeModel: the Messages API's body
    if fmt == "anthropic":
        base = raw.get("input_tokens")
        created = raw.get("cache_creation_input_tokens", 0)
        read = raw.get("cache_read_input_tokens")
        total_in = None if base is None else base + created + (read or 0)
        return Usage(model, total_in, raw.get("output_tokens"), read)
    given_in = raw.get("prompt_tokens", raw.get("input_tokens"))
    given_out = raw.get("completion_tokens", raw.get("output_tokens"))
    total = raw.get("total_tokens")
    if given_out is None and given_in is not None and total is not None and total >= given_in:
        given_out = total - given_in  # embeddings: no completion, total = prompt
    cached = raw.get("prompt_tokens_details.cached_tokens",
                     raw.get("input_tokens_details.cached_tokens"))
    return Usage(model, given_in, given_out, cached)


class Meter:
    """Reads the usage of one response from its body chunks (see the module docstring).

    ``feed`` and ``finish`` never raise: a body the meter cannot read yields a Usage
    with unknown (None) counts and the request's model.
    """

    __slots__ = ("_broken", "_held", "_held_size", "_model", "_raw", "_scanner", "cap",
                 "format", "hold", "request_model")

    def __init__(self, fmt: Format, request_model: str | None = None, *,
                 cap: int = JSON_CAP, hold: int = HOLD) -> None:
        self.format: Format = fmt
        self.request_model = request_model
        self.cap = cap
        self.hold = hold
        self._scanner: SseScanner | ArrayScanner | Capture | None = None
        self._model: str | None = None
        self._raw: dict[str, int] = {}
        self._broken = False
        self._held: list[bytes] = []  # chunks not scanned yet: up to HOLD bytes
        self._held_size = 0

    def head(self, header: Callable[[str], str | None]) -> None:
        """The response's headers (``header(name)``: a field's value, or None): Bedrock's
        InvokeModel reports its token counts there, for every model."""
        if self.format != "bedrock":
            return
        for name, key in _BEDROCK_HEADERS.items():
            value = (header(name) or "").strip()
            if value.isdigit():
                self._raw.setdefault(key, int(value))

    def feed(self, chunk: bytes) -> None:
        """One response body chunk, as relayed (any split). Chunks are scanned in runs
        of HOLD bytes: one scan of a run costs much less than one per chunk (a
        provider streams an event per chunk)."""
        if chunk and not self._broken:
            if type(chunk) is not bytes:  # a buffer the engine may reuse: keep a copy
                chunk = bytes(chunk)
            self._held.append(chunk)
            self._held_size += len(chunk)
            if self._held_size >= self.hold:
                self._scan()

    def _scan(self) -> None:
        held = self._held
        data = held[0] if len(held) == 1 else b"".join(held)
        self._held, self._held_size = [], 0
        try:
            scanner = self._scanner
            if scanner is None:
                stripped = data.lstrip()
                if not stripped:
                    return
                if stripped[:1] == b"{":
                    scanner = Capture(self.cap)
                elif stripped[:1] == b"[":
                    scanner = ArrayScanner(self._take, self.cap)
                else:
                    scanner = SseScanner(self._take, self.cap)
                self._scanner = scanner
            scanner.feed(data)
        except Exception:  # a metering bug must never break the relay
            log.exception("metering: cannot read a %s response body", self.format)
            self._broken = True

    def _take(self, data: bytes, tail: bytes | None) -> None:
        """One event/element (``tail`` None) or the head and tail of an oversized one."""
        if tail is not None:
            doc: Any = salvage(data, tail)
        else:
            try:
                doc = document(data, _DECODER)
            except ValueError:  # (UnicodeDecodeError too)
                return
        if isinstance(doc, dict):
            model, counts = _fields(doc, self.format)
            if model is not None and self._model is None:
                self._model = model
            self._raw.update(counts)

    def finish(self, status: int) -> Usage:
        """The usage once the body has ended (or was cut off). ``status`` is the
        response's HTTP status (0 if none arrived): an error body is read the same way,
        it just carries no usage."""
        del status
        if self._held and not self._broken:
            self._scan()
        try:
            scanner = self._scanner
            if not self._broken and scanner is not None:
                if isinstance(scanner, Capture):
                    body, tail = scanner.result()
                    self._take(body, tail)
                elif isinstance(scanner, SseScanner):
                    scanner.finish()
            return _normalise(self.format, self._raw, self._model or self.request_model)
        except Exception:
            log.exception("metering: cannot read a %s response body", self.format)
            return Usage(self.request_model)


class SessionMeter(Meter):
    """Reads the usage of a WebSocket session from its server events, one message each
    (``feed`` takes whole messages): a Realtime session (every ``response.done`` carries
    the usage of that one response) or the Responses API over WebSocket
    (``response.completed``, ``response.incomplete``, ``response.failed``). The
    responses add up; ``event`` also returns each one's own usage as it ends. The model
    is the session's (``session.created`` / ``session.updated``) or the response's,
    else the one the request named."""

    __slots__ = ("_responses", "_sums", "auto_responses", "last_id")

    _DONE: ClassVar[dict[str, tuple[bytes, ...]]] = {
        "realtime": (b'"response.done"',),
        "responses_ws": (b'"response.completed"', b'"response.incomplete"',
                         b'"response.failed"')}

    def __init__(self, fmt: Format = "realtime", request_model: str | None = None) -> None:
        super().__init__(fmt, request_model)
        self._sums = [0, 0, 0]  # input, output, cached input
        self._responses = 0
        # Whether the provider may start responses on its own (a Realtime session's
        # turn detection with create_response): True until the provider says otherwise.
        self.auto_responses = fmt == "realtime"
        self.last_id: str | None = None  # the id of the response the last event ended

    def feed(self, chunk: bytes) -> None:
        """One server event (a whole WebSocket message)."""
        self.event(chunk)

    def event(self, chunk: bytes) -> Usage | None:
        """One server event; the usage of the response it ends, if it ends one."""
        if self._broken or not (any(m in chunk for m in self._DONE[self.format])
                                or b'"session.' in chunk):
            return None
        try:
            try:
                doc = document(chunk, _DECODER)
            except ValueError:  # not a JSON event: nothing to read in it
                return None
            kind = doc.get("type") if isinstance(doc, dict) else None
            if kind in ("session.created", "session.updated"):
                session = doc.get("session")
                model = _model(session.get("model")) if isinstance(session, dict) else None
                if model is not None:
                    self._model = model
                if isinstance(session, dict) and self.format == "realtime":
                    self.auto_responses = _auto_responses(session, self.auto_responses)
                return None
            if not isinstance(kind, str) or kind.encode() not in {
                    m.strip(b'"') for m in self._DONE[self.format]}:
                return None
            response = doc.get("response")
            if not isinstance(response, dict):
                return None
            found_id = response.get("id")
            self.last_id = found_id if isinstance(found_id, str) else None
            model = _model(response.get("model")) or self._model or self.request_model
            usage = response.get("usage")
            if not isinstance(usage, dict):
                return Usage(model)
            details = usage.get("input_token_details", usage.get("input_tokens_details"))
            cached = details.get("cached_tokens") if isinstance(details, dict) else 0
            counts = [_int(usage.get("input_tokens")), _int(usage.get("output_tokens")),
                      _int(cached)]
            for i, value in enumerate(counts):
                self._sums[i] += value or 0
            self._responses += 1
            if self._model is None and model is not None:
                self._model = model
            return Usage(model, counts[0], counts[1], counts[2])
        except Exception:  # (RecursionError...) a metering bug must never break the relay
            log.exception("metering: cannot read a session's server event")
            self._broken = True
            return None

    @property
    def model(self) -> str | None:
        """The session's model as the provider named it (None: not yet)."""
        return self._model

    def so_far(self) -> Usage:
        """The usage of the responses done so far (unknown if none reported usage)."""
        model = self._model or self.request_model
        if not self._responses:
            return Usage(model)
        return Usage(model, *self._sums)

    def finish(self, status: int) -> Usage:
        """The session's usage once it has ended: the sum over its responses."""
        del status
        return self.so_far()


def _auto_responses(session: dict[str, Any], before: bool) -> bool:
    """Whether a Realtime session (as the provider describes it) starts responses on its
    own: turn detection on (``session.turn_detection`` or, in the GA shape,
    ``session.audio.input.turn_detection``) without ``create_response: false``."""
    found: Any = before
    audio = session.get("audio")
    sources = [session]
    if isinstance(audio, dict) and isinstance(audio.get("input"), dict):
        sources.append(audio["input"])
    for source in sources:
        if "turn_detection" in source:
            detection = source["turn_detection"]
            found = isinstance(detection, dict) and detection.get("create_response") is not False
    return bool(found)


class RealtimeMeter(SessionMeter):
    """A Realtime session's meter (``SessionMeter`` for the ``realtime`` format)."""

    __slots__ = ()

    def __init__(self, request_model: str | None = None) -> None:
        super().__init__("realtime", request_model)


class JsonlMeter(Meter):
    """Reads Anthropic Message Batch results: one JSON line per request, each a
    ``result`` whose ``message`` has its usage. Lines add up, per model (``by_model``);
    a line longer than ``JSON_CAP`` is skipped (no request's answer is that long)."""

    __slots__ = ("_line", "_models", "_skip")

    def __init__(self) -> None:
        super().__init__("anthropic")
        self._line = b""
        self._skip = False  # inside a line longer than the cap: dropped to its end
        self._models: dict[str, list[int]] = {}

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        lines = (self._line + chunk).split(b"\n")
        self._line = lines.pop()
        for line in lines:
            if not self._skip:
                self._take_line(line)
            self._skip = False
        if len(self._line) > self.cap:
            self._line, self._skip = b"", True

    def _take_line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            doc = document(line, _DECODER)
        except ValueError:
            return
        result = doc.get("result") if isinstance(doc, dict) else None
        message = result.get("message") if isinstance(result, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("usage"), dict):
            return
        model, counts = _fields(message, "anthropic")
        usage = _normalise("anthropic", counts, model)
        sums = self._models.setdefault(model or "", [0, 0, 0])
        for i, value in enumerate((usage.input_tokens, usage.output_tokens,
                                   usage.cached_input_tokens)):
            sums[i] += value or 0

    def by_model(self) -> dict[str | None, Usage]:
        """The usage of every model the results name."""
        return {m or None: Usage(m or None, *sums) for m, sums in self._models.items()}

    def finish(self, status: int) -> Usage:
        del status
        if self._line and not self._skip:
            self._take_line(self._line)
            self._line = b""
        found = self.by_model()
        if not found:
            return Usage(None)
        models = {u.model for u in found.values()}
        totals = [sum(getattr(u, f) or 0 for u in found.values())
                  for f in ("input_tokens", "output_tokens", "cached_input_tokens")]
        return Usage(models.pop() if len(models) == 1 else None, *totals)


def meter_for(preset: str | None, method: str, path: str,
              request_body: Body | None, *, hold: int = HOLD) -> Meter | None:
    """A Meter for this request's response, or None if its usage is not read here."""
    endpoint = classify(method, path)
    if endpoint is None or endpoint.format is None:
        return None
    model = request_model(preset, path, request_body)
    if endpoint.format in ("realtime", "responses_ws"):
        return SessionMeter(endpoint.format, model)
    if endpoint.format == "jsonl":
        return JsonlMeter()
    return Meter(endpoint.format, model, hold=hold)
