"""Model allowlists on credential rules, and model names safe to use as labels (pure).

``models:`` globs are matched with ``fnmatch.fnmatchcase``: case-sensitive, ``*`` any
run of characters (``/`` included), ``?`` one character, ``[...]`` a set. Case-sensitive
is the stricter choice: a spelling the operator did not write is refused, never let
through on a provider that happens to treat case differently.

Every model a call can reach is checked, not only the one it calls first: the model in
the path (Gemini/Vertex, Azure deployments, Bedrock), in the query (``model=``, Azure's
``deployment=``: the Realtime WebSocket APIs), the body's ``model``, and every field
through which the provider (or a router in front of it: OpenRouter, LiteLLM, Vercel's AI
Gateway) sends the call on to another model — fallback lists, a tool or plugin that runs
a model of its own, a moderation or transcription model. ``reached`` lists the fields it
reads (docs/metering.md "Model allowlists" too); a field that lets the provider pick the
model itself (``"fallbacks": "default"``, OpenRouter's ``route`` without ``models``, a
fusion panel left to its defaults, an image tool without its model) cannot be checked
and is refused, and so is a value where a model is expected that is not a name or a list
of names. Keys are read in any case (Go's ``encoding/json`` matches them so).

Fail closed: on a rule with ``models``, a request whose model cannot be determined is
refused (body not available, not a JSON object, duplicate keys, no ``model`` string, a
path model that is not a plain name). A model named in the query must be allowed too,
whatever the method. Requests without a body that name no model in the path or query
(``GET /v1/models``, ``GET /v1/responses/{id}``) are not inference calls and pass.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from gateway.core.metering.endpoints import (
    Body,
    classify,
    field_of,
    json_body,
    path_model,
    query_models,
    raw_body,
    route,
)
from gateway.core.policy.model import Rule

__all__ = ["MODEL_BODY_LIMIT", "ModelNames", "ModelRefusal", "Reached", "check_event_models",
           "check_model", "model_in_body", "named_models", "reached"]

MODEL_BODY_LIMIT = 32 << 20
"""Request bodies up to this size should be held for a ``models`` rule whose model is
in the body (images make chat requests large); a larger one cannot be checked."""

_BODYLESS = frozenset(("GET", "HEAD", "DELETE", "OPTIONS"))
_SHOWN = 100

# Path-model routes whose body can still send the call to other models: Bedrock (its
# additionalModelRequestFields, a model's native body) and Claude on Vertex AI (an
# Anthropic body: fallbacks, an advisor tool). Gemini's and Azure deployments' bodies
# name no other model; they are not read.
_ROUTING_BODY = re.compile(r"^/model/|/publishers/anthropic/models/")

# The fields read, in any case (docs/metering.md lists them with their providers):
_NAMES = frozenset(("model", "models", "analysis_models"))  # a name, or a list of names
_CHAINS = frozenset(("fallbacks", "context_window_fallbacks", "content_policy_fallbacks"))
_MAPS = frozenset(("context_window_fallback_dict",))  # {model: fallback model(s)}
_NESTED = frozenset(("extra_body", "additionalmodelrequestfields", "session", "response",
                     "moderation", "input_audio_transcription"))  # read as a request
_PER_PROVIDER = frozenset(("provideroptions",))  # {provider: options read as a request}
_ENTRIES = frozenset(("tools", "plugins"))  # lists of objects, each read as a request
_DEPTH = 6  # request objects nested deeper than this are refused, not read
_DEFAULT_MODEL_TOOLS = frozenset(("image_generation",))  # a default model if none is named
_PANELS = frozenset(("fusion", "openrouter:fusion"))  # OpenRouter's panel of models
_READ = _NAMES | _CHAINS | _MAPS | _NESTED | _PER_PROVIDER | _ENTRIES | {"route", "audio"}
_SPECIAL = _DEFAULT_MODEL_TOOLS | _PANELS


@dataclass(frozen=True, slots=True)
class ModelRefusal:
    """``403 model_not_allowed``: ``reason`` names the model, the rule and its list."""

    reason: str
    model: str | None
    rule: str
    status: int = 403
    code: str = "model_not_allowed"
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class Reached:
    """A model a request reaches through ``where`` (a JSON path: ``models[1]``,
    ``extra_body.fallbacks[0].model``): ``name``, or None with ``why`` it cannot be
    read and ``fix``, what to send instead."""

    where: str
    name: str | None
    why: str = ""
    fix: str = ""


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _routing_body(path: str) -> bool:
    return _ROUTING_BODY.search(route(path)) is not None


def model_in_body(rule: Rule, method: str, path: str) -> bool:
    """True if checking ``rule``'s allowlist needs the request body (the model is not
    in the path, or the body can send the call to others): the core must then hold the
    body (up to ``MODEL_BODY_LIMIT``)."""
    return (rule.models is not None and method.upper() not in _BODYLESS
            and (path_model(path) is None or _routing_body(path)))


def check_model(rule: Rule, method: str, path: str,
                request_body: Body | None) -> ModelRefusal | None:
    """None if ``rule`` allows every model this request reaches (or has no ``models``).

    ``request_body`` None means the body was not held (streamed or too large): with the
    model expected there, the request is refused.
    """
    allowed = rule.models
    if allowed is None:
        return None
    where = _where(rule)
    for queried in query_models(path):  # a Realtime session names its model here
        if queried.name is None:
            return ModelRefusal(
                f'the model in the query ("{_clip(queried.raw)}") is not a plain model name, '
                f"so {where} cannot allow it; send the model name unencoded", None,
                rule.source)
        if not _allowed(queried.name, allowed):
            return _not_allowed(rule, queried.name)
    named = path_model(path)
    bodyless = method.upper() in _BODYLESS and not raw_body(request_body)
    if named is not None:
        if named.name is None:
            return ModelRefusal(
                f'the model in the path ("{_clip(named.raw)}") is not a plain model name, so '
                f"{where} cannot allow it; send the model name unencoded", None, rule.source)
        if not _allowed(named.name, allowed):
            return _not_allowed(rule, named.name)
        if bodyless or not _routing_body(path):
            return None
    elif bodyless:
        return None
    if request_body is None:
        return ModelRefusal(
            f"the request body was not available to check its model against {where} (a "
            f"streamed or over {MODEL_BODY_LIMIT >> 20} MiB body); send a JSON body with "
            "Content-Length", None, rule.source)
    data = json_body(request_body)
    if data is None:
        send = "one JSON object" if named is not None else 'a JSON body with one "model"'
        return ModelRefusal(
            f"the request body is not a JSON object (or repeats a key), so its model "
            f"cannot be checked against {where}; send {send}", None, rule.source)
    if named is None:  # (a path's model is the one called: the body's "model" is ignored)
        value = data.get("model")
        if value is None:  # a Realtime client secret names the model of its session
            value = field_of(data.get("session"), "model")
        if not isinstance(value, str):
            return ModelRefusal(
                f'the request names no "model", which {where} requires; add "model" to '
                f"the JSON body{_not_inference(method, path)}", None, rule.source)
        if not _allowed(value, allowed):
            return _not_allowed(rule, value)
    return _first_refused(rule, reached(data, top=True))


def named_models(method: str, path: str, request_body: Body | None,
                 limit: int = 16) -> tuple[str, ...]:
    """Every model name this request reaches that ``check_model`` reads (the query's,
    the path's, the body's ``model`` and every field ``reached`` follows), in that
    order, each once, at most ``limit``, each clipped: the audit line's ``models``, which
    ``policy diff --replay`` decides again. A field that names no readable model is left
    out (the line's reason says why it was refused)."""
    names: list[str] = [q.name for q in query_models(path) if q.name is not None]
    named = path_model(path)
    if named is not None and named.name is not None:
        names.append(named.name)
    bodyless = method.upper() in _BODYLESS and not raw_body(request_body)
    data = json_body(request_body) if request_body is not None and not bodyless else None
    if data is not None:
        if named is None:
            value = data.get("model")
            if value is None:
                value = field_of(data.get("session"), "model")
            if isinstance(value, str):
                names.append(value)
        names.extend(one.name for one in reached(data, top=True) if one.name is not None)
    return tuple(_clip(n) for n in dict.fromkeys(names))[:limit]


def check_event_models(rule: Rule, fields: dict[str, Any], kind: Any,
                       fmt: str) -> ModelRefusal | None:
    """None if ``rule`` allows every model a WebSocket session's message reaches (a
    ``session.update``'s session, a ``response.create``); a Responses API
    ``response.create`` must name its ``model``."""
    if rule.models is None:
        return None
    if kind == "response.create" and fmt == "responses_ws" and fields.get("model") is None:
        return ModelRefusal(f'this response.create names no "model", which {_where(rule)} '
                            'requires; add "model" to the event', None, rule.source)
    return _first_refused(rule, reached(fields, top=False))


def _where(rule: Rule) -> str:
    return f"rule {rule.source} (models: {_clip(', '.join(rule.models or ()))})"


def _allowed(name: str, allowed: tuple[str, ...]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in allowed)


def _not_allowed(rule: Rule, name: str, field: str | None = None) -> ModelRefusal:
    named = f' (in "{_clip(field)}")' if field is not None and field != "model" else ""
    return ModelRefusal(
        f'model "{_clip(name)}"{named} is not allowed by {_where(rule)}; use one of these '
        "models or add it to the rule's models", name, rule.source)


def _first_refused(rule: Rule, found: Iterator[Reached]) -> ModelRefusal | None:
    allowed = rule.models or ()
    for one in found:
        if one.name is None:
            return ModelRefusal(
                f'"{_clip(one.where)}" {one.why}, so {_where(rule)} cannot check the model '
                f"it reaches; {one.fix}", None, rule.source)
        if not _allowed(one.name, allowed):
            return _not_allowed(rule, one.name, one.where)
    return None


# -- the fields through which a request reaches a model -----------------------------------

def reached(fields: dict[str, Any] | list[tuple[str, Any]], *, top: bool) -> Iterator[Reached]:
    """Every model a JSON request object reaches, in body order, as ``Reached``
    (``fields``: ``body_json``'s top level, or a parsed dict). ``top``: the request's
    own ``model`` is left out (its caller checks it with its own reason).

    Read, in any case: ``model``, ``models``, ``analysis_models`` (a name or a list);
    the fallback chains ``fallbacks``, ``context_window_fallbacks``,
    ``content_policy_fallbacks`` (names, ``{"model": ...}`` objects, or ``{model:
    [fallbacks]}`` maps) and ``context_window_fallback_dict``; OpenRouter's ``route``;
    inside ``extra_body``, ``additionalModelRequestFields``, ``session``, ``response``,
    ``moderation``, ``input_audio_transcription``, ``audio.input.transcription``, each
    ``providerOptions.<provider>`` and each entry of ``tools`` and ``plugins`` (and an
    OpenRouter server tool's ``parameters``) the same fields again."""
    members = list(fields.items()) if isinstance(fields, dict) else fields
    yield from _request(members, "", 0, top)


def _members(value: Any) -> list[tuple[str, Any]] | None:
    """The (key, value) pairs of a JSON object (a dict, or ``body_json``'s pairs); None
    if ``value`` is not one. (An empty list is an empty object or array: nothing.)"""
    if isinstance(value, dict):
        return list(value.items())
    if isinstance(value, list) and (not value or isinstance(value[0], tuple)):
        return value  # (only objects' pairs are tuples: an array's elements never are)
    return None


def _elements(value: Any) -> list[Any] | None:
    """The elements of a JSON array, or None if ``value`` is not one."""
    if isinstance(value, list) and _members(value) is None:
        return value
    return [] if value == [] else None


def _get(members: list[tuple[str, Any]], key: str) -> list[tuple[str, Any]]:
    """Every (key as sent, value) of ``members`` whose key is ``key`` in any case."""
    return [(k, v) for k, v in members if isinstance(k, str) and k.lower() == key]


def _join(at: str, key: str) -> str:
    return f"{at}.{key}" if at else key


def _unreadable(where: str, why: str, fix: str) -> Reached:
    return Reached(where, None, why, fix)


def _request(members: list[tuple[str, Any]], at: str, depth: int,
             top: bool = False) -> Iterator[Reached]:
    if depth > _DEPTH:
        yield _unreadable(at, "nests request options too deep to read",
                          f"send them at most {_DEPTH} objects deep")
        return
    for key, value in members:
        if value is None or not isinstance(key, str):
            continue
        k, where = key.lower(), _join(at, key)
        if k == "model":
            if not top:
                yield _name(where, value)
        elif k in _NAMES:
            yield from _names(where, value)
        elif k in _CHAINS:
            yield from _chain(where, value, depth)
        elif k in _MAPS:
            yield from _mapping(where, value)
        elif k == "route":
            if value != "fallback" or all(v is None for _, v in _get(members, "models")):
                yield _unreadable(where, "lets the provider pick a fallback model",
                                  'list the fallback models in "models" (with "route": '
                                  '"fallback")')
        elif k in _NESTED:
            inner = _members(value)
            if inner is not None:
                yield from _request(inner, where, depth + 1)
        elif k in _PER_PROVIDER:
            for provider, options in _members(value) or ():
                inner = _members(options)
                if inner is not None:
                    yield from _request(inner, _join(where, provider), depth + 1)
        elif k in _ENTRIES:
            for i, item in enumerate(_elements(value) or ()):
                inner = _members(item)
                if inner is None:
                    continue
                kind, read = _kind(inner)  # (most are function tools: nothing to read)
                if read or kind.startswith("openrouter:") or kind in _SPECIAL:
                    yield from _entry(inner, kind, read, f"{where}[{i}]", depth + 1)
        elif k == "audio":  # a Realtime session's transcription model
            for ik, input_ in _get(_members(value) or [], "input"):
                for tk, transcription in _get(_members(input_) or [], "transcription"):
                    inner = _members(transcription)
                    if inner is not None:
                        yield from _request(inner, f"{where}.{ik}.{tk}", depth + 1)


def _name(where: str, value: Any) -> Reached:
    """A model name."""
    if isinstance(value, str):
        return Reached(where, value)
    return _unreadable(where, "is not a model name (a string)", "send the model name as a "
                       "string")


def _names(where: str, value: Any) -> Iterator[Reached]:
    """A model name, or a list of names."""
    if isinstance(value, str):
        yield Reached(where, value)
        return
    items = _elements(value)
    if items is None:
        yield _unreadable(where, "is not a model name or a list of names",
                          "send model names as strings")
        return
    for i, item in enumerate(items):
        yield _name(f"{where}[{i}]", item)


def _chain(where: str, value: Any, depth: int) -> Iterator[Reached]:
    """A fallback chain: a list of names, of ``{"model": ...}`` objects (with their
    own options), or of ``{model: [fallbacks]}`` maps; ``"default"`` (Anthropic: the
    provider's own chain) cannot be checked."""
    items = _elements(value)
    if items is None:
        if _members(value) is not None:
            yield from _mapping(where, value)
            return
        why = (f'is "{_clip(value)}", which lets the provider pick the models'
               if isinstance(value, str) else "is not a list of models")
        yield _unreadable(where, why, "list each fallback model by name")
        return
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        inner = _members(item)
        if isinstance(item, str):
            yield Reached(at, item)
        elif inner is not None and _get(inner, "model"):  # (with its own options)
            yield from _request(inner, at, depth + 1)
        elif inner is not None:
            yield from _mapping(at, item)
        else:
            yield _unreadable(at, "is not a model name or a fallback object",
                              "send each fallback as a model name")


def _mapping(where: str, value: Any) -> Iterator[Reached]:
    """``{model: fallback model or list}``: every key and value is a model."""
    members = _members(value)
    if members is None:
        yield _unreadable(where, "is not a map of model names",
                          "send it as {model: [fallback models]}")
        return
    for key, fallbacks in members:
        at = f"{where}.{key}"
        yield Reached(at, key)
        yield from _names(at, fallbacks)


def _kind(members: list[tuple[str, Any]]) -> tuple[str, bool]:
    """A tool's ``type`` (a plugin's ``id``), and whether it has a field ``_request``
    reads: one pass, as agents send dozens of function tools with every call."""
    kind, read = "", False
    for key, value in members:
        k = key.lower() if isinstance(key, str) else ""
        if k in ("type", "id") and isinstance(value, str) and not kind:
            kind = value
        read = read or k in _READ
    return kind, read


def _entry(members: list[tuple[str, Any]], kind: str, read: bool, at: str,
           depth: int) -> Iterator[Reached]:
    """A tool or plugin (``kind``): its own fields (an image tool's, an advisor's
    ``model``), an OpenRouter server tool's ``parameters``, and the models a provider
    would pick for it, which cannot be checked."""
    if read:
        yield from _request(members, at, depth)
    params: list[tuple[str, Any]] = []
    if kind.startswith("openrouter:"):
        for key, value in _get(members, "parameters"):
            inner = _members(value)
            if inner is not None:
                params += inner
                yield from _request(inner, f"{at}.{key}", depth + 1)
    if any(v is False for _, v in _get(members, "enabled")):
        return
    named = {k.lower() for k, v in [*members, *params] if isinstance(k, str) and v is not None}
    if kind in _DEFAULT_MODEL_TOOLS and "model" not in named:
        yield _unreadable(at, f"({kind}) runs the provider's default model",
                          'name its model ("model": ...)')
    if kind in _PANELS and not {"model", "analysis_models"} <= named:
        yield _unreadable(at, f"({kind}) runs a panel of models the provider picks",
                          'name them in "analysis_models" and the judge in "model"')


def _not_inference(method: str, path: str) -> str:
    """Advice for a request without a model on a path that is no inference endpoint the
    gateway knows (an agent's telemetry or settings call, say): the fix is a rule for
    that path without models, not a model in a body that has none."""
    if classify(method, path) is not None:
        return ""
    return ("; or, if this is no inference call (an agent's telemetry or settings), allow "
            f"its path ({_clip(path.partition('?')[0])}) in a rule without models, "
            "listed before this one")


_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,99}")


class ModelNames:
    """Model names as Prometheus labels and counter keys, with bounded cardinality.

    A name enters the set if it looks like a model id (letters, digits, ``._:@/+-``,
    at most 100 characters) and fewer than ``limit`` names are known; otherwise it is
    ``other``. No name is ``unknown``. Per process: workers may each admit ``limit``.
    """

    def __init__(self, limit: int = 200) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def __call__(self, model: str | None) -> str:
        if model is None:
            return "unknown"
        if model in self._known:
            return model
        if len(self._known) >= self.limit or not _LABEL.fullmatch(model):
            return "other"
        self._known.add(model)
        return model
