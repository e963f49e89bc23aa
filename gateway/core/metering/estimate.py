"""What an inference call may use at most, read from its request (pure, no I/O).

A call admitted under a ``tokens`` or ``cost_usd`` budget reserves this bound while it
runs (``budgets.Reservation``) and settles to what it used when it ends; a call whose
usage never arrives counts its reservation. The bound must hold for anything a provider
may bill for the request, so it is read as the most generous provider would read it:

* **Output**: the *largest* limit among every output-limit field the request gives, of
  any provider family (``max_completion_tokens``, ``max_tokens``, ``max_output_tokens``,
  Gemini's ``maxOutputTokens`` in either spelling, Bedrock's ``maxTokens``,
  ``max_gen_len``, ``maxTokenCount``, ``max_new_tokens``, Realtime's
  ``max_response_output_tokens``), capped by the model's maximum output; without one,
  the model's maximum output. Times the number of choices (the largest of ``n``,
  ``best_of``, ``candidateCount``). Embeddings produce no output.
* **Input**: the body's size in bytes less its JSON layout (newlines, tabs and the
  indentation after them, which no string holds: JSON escapes them there); a byte-level
  BPE tokenizer makes at most one token of each byte, so no text in the body can be
  billed as more tokens than it has bytes. Capped by the model's context window. A call
  that makes the provider read more than its body - state the provider keeps (response
  chains, conversations, cached content, files, stored prompts, containers), content it
  fetches (image, file or document URLs), inlined media (a base64 run of 1 KiB or
  more: images, audio, PDFs), or hosted tools that run more model turns (web search,
  file search, code interpreter, remote MCP) - is bounded by the context window alone
  (times the turns its tools may take: ``max_tool_calls``, ``max_uses``).

Numbers are read in every form a provider may coerce: integers, exponents (``1e6``),
integral decimals and numeric strings (``"8"``); a fractional value counts rounded up.
A limit that cannot be read as a number (``true``, ``"lots"``, NaN, a negative or a
nested object) makes the call's bound unknown: ``Unreadable``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.core.metering.endpoints import Endpoint, route

__all__ = [
    "DEFAULT_OUTPUT",
    "INLINE_TOKENS",
    "Bound",
    "Unreadable",
    "choices",
    "estimate_input",
    "hosted_tools",
    "input_bound",
    "number",
    "output_bound",
    "output_limit",
    "provider_state",
    "text_bytes",
]

DEFAULT_OUTPUT = 4096
"""Output tokens a call that names no limit reserves when neither the catalogue nor the
rule (``metering.reserve``) knows the model's maximum output: only where no budget
needs a bound (``policy test``'s report of a call)."""
INLINE_TOKENS = 1600
"""Input tokens an inlined base64 object counts in ``estimate_input`` (a report)."""

_BASE64_RUN = re.compile(rb"[A-Za-z0-9+/=]{1024,}")
# JSON layout: a raw newline, tab or carriage return is never inside a string (JSON
# escapes them there), and nor is whitespace after one (a string cannot span it).
_LAYOUT = re.compile(rb"[\n\r\t][ \n\r\t]*")
_BYTES_PER_TOKEN = 4


class Unreadable(ValueError):
    """A limit or count that cannot be read as a number: the field and the value."""


def number(value: Any, field: str) -> int | None:
    """A non-negative whole number as a provider may read ``value`` (None: absent or
    null); raises Unreadable for a value no provider reads as one."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise Unreadable(f"{field} is {str(value).lower()}, not a number")
    if isinstance(value, int):
        if value < 0:
            raise Unreadable(f"{field} is negative ({value})")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise Unreadable(f"{field} is {value!r}, not a usable number")
        return math.ceil(value)
    if isinstance(value, str):
        text = value.strip()
        if len(text) > 40:
            raise Unreadable(f"{field} is a string of {len(value)} characters")
        try:
            parsed = float(text)
        except ValueError:
            raise Unreadable(f'{field} is "{value[:40]}", not a number') from None
        if not math.isfinite(parsed) or parsed < 0:
            raise Unreadable(f'{field} is "{value[:40]}", not a usable number')
        return math.ceil(parsed)
    raise Unreadable(f"{field} is a JSON {type(value).__name__}, not a number")


# Every field a provider family reads as the most output tokens a call may produce:
# (path of keys from the top level). Read all of them, whatever the endpoint's family:
# an OpenAI-compatible server may be backed by anything.
_OUTPUT_FIELDS: tuple[tuple[str, ...], ...] = (
    ("max_completion_tokens",), ("max_tokens",), ("max_output_tokens",),
    ("max_response_output_tokens",), ("max_gen_len",), ("max_new_tokens",), ("maxTokens",),
    ("generationConfig", "maxOutputTokens"), ("generationConfig", "max_output_tokens"),
    ("generation_config", "maxOutputTokens"), ("generation_config", "max_output_tokens"),
    ("inferenceConfig", "maxTokens"), ("inferenceConfig", "max_tokens"),
    ("inferenceConfig", "max_new_tokens"), ("inference_config", "max_tokens"),
    ("textGenerationConfig", "maxTokenCount"), ("parameters", "max_new_tokens"),
    ("response", "max_output_tokens"), ("response", "max_response_output_tokens"),
    ("session", "max_response_output_tokens"), ("session", "max_output_tokens"),
)
_CHOICE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("n",), ("best_of",), ("candidateCount",), ("candidate_count",),
    ("generationConfig", "candidateCount"), ("generationConfig", "candidate_count"),
    ("generation_config", "candidateCount"), ("generation_config", "candidate_count"),
)
_UNLIMITED = "inf"  # Realtime's max_response_output_tokens: the model's maximum


def _field(obj: Any, key: str) -> Any:
    """``obj[key]``, the key matched in any case (a provider's parser may: Go's
    ``encoding/json`` does); with several spellings, the last one's value."""
    found = None
    lowered = key.lower()
    if isinstance(obj, dict):
        if key in obj and len(obj) == 1:
            return obj[key]
        for k, v in obj.items():
            if k.lower() == lowered:
                found = v
    elif isinstance(obj, list):
        for pair in obj:
            if isinstance(pair, tuple) and len(pair) == 2 and \
                    isinstance(pair[0], str) and pair[0].lower() == lowered:
                found = pair[1]
    return found


def _all(obj: Any, key: str) -> list[Any]:
    """Every value of ``key`` in ``obj``, the key matched in any case (a provider may
    read any of the spellings: each is a limit it may honour)."""
    lowered = key.lower()
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k.lower() == lowered]
    if isinstance(obj, list):
        return [p[1] for p in obj if isinstance(p, tuple) and len(p) == 2
                and isinstance(p[0], str) and p[0].lower() == lowered]
    return []


def _walk(fields: dict[str, Any], keys: tuple[str, ...]) -> list[Any]:
    """The values at ``keys`` (every spelling of each key)."""
    values: list[Any] = [fields]
    for key in keys:
        values = [found for value in values for found in _all(value, key)]
    return values


def choices(fields: dict[str, Any] | None) -> int:
    """How many answers the call asks for (the largest count given, at least 1)."""
    if fields is None:
        return 1
    most = 1
    for keys in _CHOICE_FIELDS:
        for value in _walk(fields, keys):
            found = number(value, ".".join(keys))
            if found is not None:
                most = max(most, found)
    return most


def output_bound(endpoint: Endpoint, fields: dict[str, Any] | None, path: str,
                 model_max: int | None) -> int | None:
    """The most output tokens the call may produce (see the module docstring), None if
    it names no limit and the model's maximum is unknown; raises Unreadable."""
    if endpoint.format == "openai" and route(path).endswith("/embeddings"):
        return 0
    limit: int | None = None
    unlimited = False
    for keys in _OUTPUT_FIELDS if fields is not None else ():
        assert fields is not None
        for value in _walk(fields, keys):
            if value == _UNLIMITED:
                unlimited = True
                continue
            found = number(value, ".".join(keys))
            if found is not None:
                limit = found if limit is None else max(limit, found)
    if unlimited or limit is None:
        limit = model_max
    elif model_max is not None:
        limit = min(limit, model_max)
    if limit is None:
        return None
    return limit * choices(fields)


def output_limit(endpoint: Endpoint, fields: dict[str, Any] | None, path: str,
                 default: int) -> int:
    """The output bound with ``default`` for a call whose limit is unknown, an
    unreadable limit counted as ``default`` too (reports, not budgets)."""
    try:
        found = output_bound(endpoint, fields, path, None)
    except Unreadable:
        return default * max(1, _safe_choices(fields))
    return found if found is not None else default * max(1, _safe_choices(fields))


def _safe_choices(fields: dict[str, Any] | None) -> int:
    try:
        return choices(fields)
    except Unreadable:
        return 1


# -- input -------------------------------------------------------------------------------

# Keys whose presence makes the provider read what the body does not carry.
_STATE_KEYS = frozenset((
    "previous_response_id", "conversation", "conversation_id", "cachedContent",
    "cached_content", "file_id", "fileUri", "file_uri", "file_url", "fileData",
    "file_data", "document_url", "container", "mcp_servers", "s3Location", "s3_location",
    "agent_id", "prompt_cache_key_ref", "item_reference",
))
_STATE_TYPES = frozenset(("item_reference", "input_file", "file", "document_url",
                          "container_upload", "mcp_tool_result", "search_result_ref"))
_URL_KEYS = frozenset(("image_url", "url", "uri", "imageUri", "image_uri"))
_FETCHED = ("http://", "https://", "gs://", "s3://")
# Tool types that run on the provider (more model turns, content read as input).
_CLIENT_TOOL_TYPES = frozenset(("function", "custom", "local_shell", "apply_patch",
                                "shell", "computer", "computer_use_preview"))
_CLIENT_TOOL_PREFIXES = ("bash_", "text_editor_", "computer_", "memory_")
_GEMINI_TOOL_KEYS = frozenset(("googleSearch", "google_search", "googleSearchRetrieval",
                               "google_search_retrieval", "urlContext", "url_context",
                               "codeExecution", "code_execution", "retrieval", "fileSearch",
                               "file_search", "googleMaps", "google_maps", "enterpriseWebSearch",
                               "enterprise_web_search", "computerUse", "computer_use"))
_MAX_DEPTH = 64
_STATE_KEYS_L = frozenset(k.lower() for k in _STATE_KEYS)
_URL_KEYS_L = frozenset(k.lower() for k in _URL_KEYS)
_GEMINI_TOOL_KEYS_L = frozenset(k.lower() for k in _GEMINI_TOOL_KEYS)
# A body none of whose strings is one of these (escapes aside) cannot refer to state:
# the walk over its objects is skipped (most chat bodies). Searched in the body made
# lower-case (one C pass; a case-insensitive regex costs twice as much).
_CANDIDATE = re.compile(
    rb'"(?=[a-z0-9_]{3,24}")(?:' + b"|".join(re.escape(k.lower().encode()) for k in sorted(
        _STATE_KEYS | _STATE_TYPES | _URL_KEYS | {"prompt", "source"})) + rb')"')
# Base64 runs found by mapping every base64 byte to "A" and every other to " " (one C
# pass) and searching for 1,024 "A"s: a regex of the run costs ~30 times as much.
_B64_TABLE = bytes(65 if chr(c).isascii() and (chr(c).isalnum() or chr(c) in "+/=")
                   else 32 for c in range(256))
_B64_RUN = b"A" * 1024


def _objects(value: Any, depth: int = 0) -> Iterator[list[Any] | dict[str, Any]]:
    """Every JSON object in ``value`` (as pairs or a dict), depth-first, bounded."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _objects(v, depth + 1)
    elif isinstance(value, list):
        if value and isinstance(value[0], tuple):  # an object read as (key, value) pairs
            yield value  # (body_json's hook makes pairs tuples; JSON arrays are lists)
            for _, v in value:
                yield from _objects(v, depth + 1)
        else:
            for v in value:
                yield from _objects(v, depth + 1)


def _items(obj: list[Any] | dict[str, Any]) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        yield from obj.items()
    else:
        for pair in obj:
            if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str):
                yield pair


def provider_state(fields: dict[str, Any] | None, raw: bytes) -> str | None:
    """What the call makes the provider read beyond its body (a few words naming the
    field), or None: provider-kept state, fetched content, inlined media."""
    if fields is None:
        return None
    if raw.find(b"\\u") >= 0 or _CANDIDATE.search(raw.lower()):  # (an escaped key: anything)
        for obj in _objects(fields):
            for key, value in _items(obj):
                if value is None or value == "" or value == [] or value is False:
                    continue
                name = key.lower()
                if name in _STATE_KEYS_L:
                    return f'"{key[:40]}"'
                if name == "type" and isinstance(value, str) and value in _STATE_TYPES:
                    return f'a "{value}" item'
                if name == "prompt" and isinstance(value, dict | list) and \
                        _field(value, "id") is not None:
                    return 'a stored "prompt"'
                if name in _URL_KEYS_L:
                    url = value if isinstance(value, str) else _field(value, "url")
                    if isinstance(url, str) and url.lstrip().lower().startswith(_FETCHED):
                        return f'a fetched "{key[:40]}"'
                if name == "source" and _field(value, "type") in ("url", "file"):
                    return f'a "{_field(value, "type")}" source'
    if len(raw) >= 1024 and _B64_RUN in raw.translate(_B64_TABLE):
        return "inlined media (a base64 run)"
    return None


def hosted_tools(fields: dict[str, Any] | None) -> tuple[str, int | None] | None:
    """The first tool the provider runs itself (its name) and the most turns its tools
    may take (None: no bound given), or None if the call has no such tool."""
    if fields is None:
        return None
    found: str | None = None
    tools = _field(fields, "tools")
    uses = 0
    bounded = True
    for tool in tools if isinstance(tools, list) else ():
        kind = _field(tool, "type")
        if isinstance(kind, str):
            if kind in _CLIENT_TOOL_TYPES or kind.startswith(_CLIENT_TOOL_PREFIXES):
                continue
            found = found or kind[:40]
            most = number(_field(tool, "max_uses"), f"tools[{kind[:40]}].max_uses")
            if most is None:
                bounded = False
            else:
                uses += most
            continue
        for key, _ in _items(tool) if isinstance(tool, dict | list) else ():
            if key.lower() in _GEMINI_TOOL_KEYS_L:
                found = found or key[:40]
                bounded = False
    if _field(fields, "mcp_servers"):
        found = found or "mcp_servers"
        bounded = False
    if found is None:
        return None
    calls = number(_field(fields, "max_tool_calls"), "max_tool_calls")
    if calls is not None:
        return found, calls
    return found, uses if bounded else None


@dataclass(frozen=True, slots=True)
class Bound:
    """The input bound of a call: ``tokens`` (None: unknown, the call cannot be
    bounded) and ``why`` when it is not the body's own (a reason's words)."""

    tokens: int | None
    why: str | None = None


def input_bound(raw: bytes, fields: dict[str, Any] | None, context: int | None) -> Bound:
    """The most input tokens the call may be billed (see the module docstring): raises
    Unreadable for an unreadable tool bound."""
    tools = hosted_tools(fields)
    state = provider_state(fields, raw)
    if tools is not None:
        name, turns = tools
        if turns is None:
            return Bound(None, f'the provider runs its "{name}" tool, for as many model '
                         "turns as it likes (set max_tool_calls, or max_uses on the tool)")
        if context is None:
            return Bound(None, f'the provider runs its "{name}" tool')
        return Bound(context * (1 + turns), f'its "{name}" tool may take {turns} more '
                     "model turns")
    if state is not None:
        return Bound(context, f"it makes the provider read {state}")
    size = text_bytes(raw)
    return Bound(size if context is None else min(size, context))


def text_bytes(raw: bytes) -> int:
    """The body's bytes less its JSON layout (see ``_LAYOUT``): no more tokens than this
    can be read from it."""
    if raw.find(b"\n") < 0 and raw.find(b"\t") < 0 and raw.find(b"\r") < 0:  # (not `in`:
        # CPython 3.12's bytes `in` raises and clears a TypeError first; core/leaks.py)
        return len(raw)
    return len(raw) - sum(m.end() - m.start() for m in _LAYOUT.finditer(raw))


def estimate_input(raw: bytes) -> int:
    """A typical input size of a body (a token per four bytes that are not whitespace,
    ``INLINE_TOKENS`` per inlined base64 run): for reports that show what a call is
    likely to use, never for a budget's bound."""
    size = len(raw)
    size -= raw.count(b" ") + raw.count(b"\n") + raw.count(b"\t") + raw.count(b"\r")
    if len(raw) < 1024:
        return math.ceil(size / _BYTES_PER_TOKEN)
    inline = 0
    for match in _BASE64_RUN.finditer(raw):
        size -= match.end() - match.start()
        inline += 1
    return math.ceil(size / _BYTES_PER_TOKEN) + inline * INLINE_TOKENS
