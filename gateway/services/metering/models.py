"""Model allowlists on credential rules, and model names safe to use as labels (pure).

``models:`` globs are matched with ``fnmatch.fnmatchcase``: case-sensitive, ``*`` any
run of characters (``/`` included), ``?`` one character, ``[...]`` a set. Case-sensitive
is the stricter choice: a spelling the operator did not write is refused, never let
through on a provider that happens to treat case differently.

Fail closed: on a rule with ``models``, a request whose model cannot be determined is
refused (body not available, not a JSON object, duplicate keys, no ``model`` string, a
path model that is not a plain name). A model named in the query (``model=``, Azure's
``deployment=``: the Realtime WebSocket APIs) must be allowed too, whatever the method.
Requests without a body that name no model in the path or query (``GET /v1/models``,
``GET /v1/responses/{id}``) are not inference calls and pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from gateway.services.metering.endpoints import (
    Body,
    classify,
    field_of,
    json_body,
    path_model,
    query_models,
    raw_body,
)
from gateway.services.policy.model import Rule

__all__ = ["MODEL_BODY_LIMIT", "ModelNames", "ModelRefusal", "check_model", "model_in_body"]

MODEL_BODY_LIMIT = 32 << 20
"""Request bodies up to this size should be held for a ``models`` rule whose model is
in the body (images make chat requests large); a larger one cannot be checked."""

_BODYLESS = frozenset(("GET", "HEAD", "DELETE", "OPTIONS"))
_SHOWN = 100


@dataclass(frozen=True, slots=True)
class ModelRefusal:
    """``403 model_not_allowed``: ``reason`` names the model, the rule and its list."""

    reason: str
    model: str | None
    rule: str
    status: int = 403
    code: str = "model_not_allowed"
    retry_after: int | None = None


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def model_in_body(rule: Rule, method: str, path: str) -> bool:
    """True if checking ``rule``'s allowlist needs the request body (the model is not
    in the path): the core must then hold the body (up to ``MODEL_BODY_LIMIT``)."""
    return (rule.models is not None and method.upper() not in _BODYLESS
            and path_model(path) is None)


def check_model(rule: Rule, method: str, path: str,
                request_body: Body | None) -> ModelRefusal | None:
    """None if ``rule`` allows the model this request names (or has no ``models``).

    ``request_body`` None means the body was not held (streamed or too large): with the
    model expected there, the request is refused.
    """
    allowed = rule.models
    if allowed is None:
        return None
    listed = ", ".join(allowed)
    where = f"rule {rule.source} (models: {_clip(listed)})"
    for queried in query_models(path):  # a Realtime session names its model here
        if queried.name is None:
            return ModelRefusal(
                f'the model in the query ("{_clip(queried.raw)}") is not a plain model name, '
                f"so {where} cannot allow it; send the model name unencoded", None,
                rule.source)
        if not any(fnmatchcase(queried.name, pattern) for pattern in allowed):
            return ModelRefusal(
                f'model "{_clip(queried.name)}" is not allowed by {where}; use one of these '
                "models or add it to the rule's models", queried.name, rule.source)
    named = path_model(path)
    if named is not None:
        if named.name is None:
            return ModelRefusal(
                f'the model in the path ("{_clip(named.raw)}") is not a plain model name, so '
                f"{where} cannot allow it; send the model name unencoded", None, rule.source)
        model = named.name
    elif method.upper() in _BODYLESS and not raw_body(request_body):
        return None
    elif request_body is None:
        return ModelRefusal(
            f"the request body was not available to check its model against {where} (a "
            f"streamed or over {MODEL_BODY_LIMIT >> 20} MiB body); send a JSON body with "
            "Content-Length", None, rule.source)
    else:
        data = json_body(request_body)
        if data is None:
            return ModelRefusal(
                f"the request body is not a JSON object (or repeats a key), so its model "
                f"cannot be checked against {where}; send a JSON body with one \"model\"",
                None, rule.source)
        value = data.get("model")
        if value is None:  # a Realtime client secret names the model of its session
            value = field_of(data.get("session"), "model")
        if not isinstance(value, str):
            return ModelRefusal(
                f'the request names no "model", which {where} requires; add "model" to '
                f"the JSON body{_not_inference(method, path)}", None, rule.source)
        model = value
    if any(fnmatchcase(model, pattern) for pattern in allowed):
        return None
    return ModelRefusal(
        f'model "{_clip(model)}" is not allowed by {where}; use one of these models or '
        "add it to the rule's models", model, rule.source)


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
