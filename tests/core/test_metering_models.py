"""Every model a call can reach is checked against the rule's `models:` (issue 39 item
3): the body's model, and each field through which the provider, or a router in front of
it (OpenRouter, LiteLLM, Vercel's AI Gateway), sends the call on to another model. A
field that lets the provider pick the model, or holds what is not a model name, is
refused: it cannot be checked. One row per way a model is reached."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core.metering.endpoints import body_json
from gateway.core.metering.models import check_event_models, check_model, model_in_body
from gateway.core.policy.model import Rule

RULE = Rule(host="api.openai.com", source="p.yaml:9", credential="openai",
            models=("gpt-4o-mini", "gpt-4.1-*", "omni-moderation-*", "gpt-image-1",
                    "gpt-realtime*", "whisper-1"))
NOT_ALLOWED = "is not allowed by rule p.yaml:9 (models: gpt-4o-mini, gpt-4.1-*"
CHAT = "/v1/chat/completions"


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "gpt-4o-mini", "messages": [], **fields}).encode()


# path, body, the refusal's reason fragment (None: allowed), the model it names
BODIES: list[tuple[str, str, bytes | None, str | None, str | None]] = [
    # OpenRouter: the models fallback list (the attack: an allowed model, then others)
    ("models list", CHAT, _body(models=["gpt-4o-mini", "forbidden-x"]),
     f'model "forbidden-x" (in "models[1]") {NOT_ALLOWED}', "forbidden-x"),
    ("models list, allowed", CHAT, _body(models=["gpt-4.1-mini"], route="fallback"), None,
     None),
    ("models as one string", CHAT, _body(models="forbidden-x"),
     'model "forbidden-x" (in "models")', "forbidden-x"),
    ("models in another case", CHAT, _body(MODELS=["forbidden-x"]),
     '(in "MODELS[0]")', "forbidden-x"),
    ("a models entry not a string", CHAT, _body(models=["gpt-4o-mini", 5]),
     '"models[1]" is not a model name (a string), so rule p.yaml:9', None),
    ("models an object", CHAT, _body(models={"a": 1}),
     '"models" is not a model name or a list of names', None),
    ("route without models", CHAT, _body(route="fallback"),
     '"route" lets the provider pick a fallback model, so rule p.yaml:9 (models: '
     'gpt-4o-mini, gpt-4.1-*, omni-moderation-*, gpt-image-1, gpt-realtime*, whisper-1) '
     'cannot check the model it reaches; list the fallback models in "models"', None),
    ("route with models null", CHAT, _body(route="fallback", models=None),
     '"route" lets the provider pick', None),
    ("route a custom router", CHAT, _body(models=["gpt-4o-mini"], route={"type": "x"}),
     '"route" lets the provider pick', None),
    ("the body's model is checked first", CHAT,
     json.dumps({"model": "gpt-4o", "models": ["forbidden-x"]}).encode(),
     f'model "gpt-4o" {NOT_ALLOWED}', "gpt-4o"),
    # LiteLLM-style fallback chains
    ("fallbacks names", CHAT, _body(fallbacks=["gpt-4.1-nano", "forbidden-x"]),
     '(in "fallbacks[1]")', "forbidden-x"),
    ("fallbacks objects", CHAT, _body(fallbacks=[{"model": "forbidden-x", "messages": []}]),
     '(in "fallbacks[0].model")', "forbidden-x"),
    ("fallbacks map, its fallback", CHAT, _body(fallbacks=[{"gpt-4o-mini": ["forbidden-x"]}]),
     '(in "fallbacks[0].gpt-4o-mini[0]")', "forbidden-x"),
    ("fallbacks map, its key", CHAT, _body(fallbacks=[{"forbidden-x": ["gpt-4o-mini"]}]),
     '(in "fallbacks[0].forbidden-x")', "forbidden-x"),
    ("fallbacks a map", CHAT, _body(fallbacks={"gpt-4o-mini": "forbidden-x"}),
     '(in "fallbacks.gpt-4o-mini")', "forbidden-x"),
    ("fallbacks object model not a string", CHAT, _body(fallbacks=[{"model": 5}]),
     '"fallbacks[0].model" is not a model name (a string)', None),
    ("fallbacks entry a number", CHAT, _body(fallbacks=[7]),
     '"fallbacks[0]" is not a model name or a fallback object', None),
    ("fallbacks off", CHAT, _body(fallbacks=None), None, None),
    ("fallbacks empty", CHAT, _body(fallbacks=[]), None, None),
    ("fallbacks false", CHAT, _body(fallbacks=False),
     '"fallbacks" is not a list of models', None),
    ("context window fallbacks", CHAT,
     _body(context_window_fallbacks=[{"gpt-4o-mini": ["forbidden-x"]}]),
     '(in "context_window_fallbacks[0].gpt-4o-mini[0]")', "forbidden-x"),
    ("content policy fallbacks", CHAT, _body(content_policy_fallbacks=["forbidden-x"]),
     '(in "content_policy_fallbacks[0]")', "forbidden-x"),
    ("context window fallback dict", CHAT,
     _body(context_window_fallback_dict={"gpt-4o-mini": "forbidden-x"}),
     '(in "context_window_fallback_dict.gpt-4o-mini")', "forbidden-x"),
    ("extra_body models", CHAT, _body(extra_body={"models": ["forbidden-x"]}),
     '(in "extra_body.models[0]")', "forbidden-x"),
    ("extra_body model", CHAT, _body(extra_body={"model": "forbidden-x"}),
     '(in "extra_body.model")', "forbidden-x"),
    ("extra_body allowed", CHAT, _body(extra_body={"fallbacks": ["gpt-4.1-nano"]}), None,
     None),
    ("a repeated key inside extra_body: both copies", CHAT,
     b'{"model": "gpt-4o-mini", "extra_body": {"models": ["gpt-4o-mini"], '
     b'"models": ["forbidden-x"]}}', '(in "extra_body.models[0]")', "forbidden-x"),
    ("nested too deep", CHAT, _body(extra_body={"extra_body": {"extra_body": {"extra_body": {
        "extra_body": {"extra_body": {"extra_body": {"models": ["gpt-4o-mini"]}}}}}}}),
     "nests request options too deep to read", None),
    # Vercel AI Gateway
    ("providerOptions.gateway.models", CHAT,
     _body(providerOptions={"gateway": {"order": ["bedrock"], "models": ["forbidden-x"]}}),
     '(in "providerOptions.gateway.models[0]")', "forbidden-x"),
    ("providerOptions allowed", CHAT,
     _body(providerOptions={"gateway": {"models": ["gpt-4.1-mini"]}, "openai": {"x": 1}}),
     None, None),
    # Tools that run a model of their own
    ("image tool", "/v1/responses", _body(tools=[{"type": "image_generation",
                                                  "model": "gpt-image-2"}]),
     '(in "tools[0].model")', "gpt-image-2"),
    ("image tool, allowed", "/v1/responses", _body(tools=[{"type": "image_generation",
                                                           "model": "gpt-image-1"}]),
     None, None),
    ("image tool, default model", "/v1/responses", _body(tools=[{"type": "image_generation"}]),
     '"tools[0]" (image_generation) runs the provider\'s default model', None),
    ("Anthropic advisor tool", "/v1/messages",
     _body(tools=[{"type": "advisor_20260301", "name": "advisor", "model": "claude-opus-x"}]),
     '(in "tools[0].model")', "claude-opus-x"),
    ("Anthropic server-side fallbacks", "/v1/messages",
     _body(fallbacks=[{"model": "forbidden-x", "max_tokens": 100}]),
     '(in "fallbacks[0].model")', "forbidden-x"),
    ("Anthropic default fallbacks", "/v1/messages", _body(fallbacks="default"),
     '"fallbacks" is "default", which lets the provider pick the models, so rule p.yaml:9',
     None),
    ("a function parameter named model is no model", "/v1/responses",
     _body(tools=[{"type": "function", "name": "car", "parameters": {
         "type": "object", "properties": {"model": {"type": "string"}}, "model": "x"}}]),
     None, None),
    ("a chat function tool", CHAT, _body(tools=[{"type": "function", "function": {
        "name": "car", "parameters": {"properties": {"model": {}}}}}]), None, None),
    ("moderation model", CHAT, _body(moderation={"model": "text-moderation-x"}),
     '(in "moderation.model")', "text-moderation-x"),
    ("moderation model, allowed", "/v1/responses",
     _body(moderation={"model": "omni-moderation-latest"}), None, None),
    # OpenRouter plugins and server tools
    ("fusion plugin panel", CHAT, _body(plugins=[{"id": "fusion", "model": "gpt-4o-mini",
                                                  "analysis_models": ["forbidden-x"]}]),
     '(in "plugins[0].analysis_models[0]")', "forbidden-x"),
    ("fusion plugin judge", CHAT, _body(plugins=[{"id": "fusion", "model": "forbidden-x",
                                                  "analysis_models": ["gpt-4o-mini"]}]),
     '(in "plugins[0].model")', "forbidden-x"),
    ("fusion plugin, default panel", CHAT, _body(plugins=[{"id": "fusion"}]),
     '"plugins[0]" (fusion) runs a panel of models the provider picks', None),
    ("fusion plugin off", CHAT, _body(plugins=[{"id": "fusion", "enabled": False}]), None,
     None),
    ("web plugin", CHAT, _body(plugins=[{"id": "web", "max_results": 3}]), None, None),
    ("fusion server tool", CHAT, _body(tools=[{"type": "openrouter:fusion", "parameters": {
        "analysis_models": ["gpt-4.1-mini", "forbidden-x"], "model": "gpt-4o-mini"}}]),
     '(in "tools[0].parameters.analysis_models[1]")', "forbidden-x"),
    ("fusion server tool, default panel", CHAT, _body(tools=[{"type": "openrouter:fusion"}]),
     "runs a panel of models the provider picks", None),
    # Realtime: a client secret's session, its transcription model
    ("Realtime transcription model", "/v1/realtime/client_secrets",
     json.dumps({"session": {"type": "realtime", "model": "gpt-realtime",
                             "audio": {"input": {"transcription": {"model": "gpt-4o-x"}}}}}
                ).encode(), '(in "session.audio.input.transcription.model")', "gpt-4o-x"),
    ("Realtime transcription model, allowed", "/v1/realtime/client_secrets",
     json.dumps({"session": {"type": "realtime", "model": "gpt-realtime",
                             "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}
                ).encode(), None, None),
    ("Realtime beta transcription", "/v1/realtime/sessions",
     json.dumps({"model": "gpt-realtime", "input_audio_transcription": {"model": "gpt-4o-x"}}
                ).encode(), '(in "input_audio_transcription.model")', "gpt-4o-x"),
    # Models in the path: Bedrock's body is read too (the path model is the one called)
    ("Bedrock additional fields", "/model/gpt-4.1-x/converse",
     json.dumps({"messages": [], "additionalModelRequestFields": {
         "fallbacks": ["forbidden-x"]}}).encode(),
     '(in "additionalModelRequestFields.fallbacks[0]")', "forbidden-x"),
    ("Bedrock: the body's model is not the one called", "/model/gpt-4.1-x/converse",
     json.dumps({"model": "ignored", "messages": []}).encode(), None, None),
    ("Bedrock path model", "/model/forbidden-x/converse", b"{}",
     f'model "forbidden-x" {NOT_ALLOWED}', "forbidden-x"),
    ("Bedrock body not held", "/model/gpt-4.1-x/invoke", None, "body was not available",
     None),
    ("Bedrock body not JSON", "/model/gpt-4.1-x/invoke", b"\x00\x01",
     "is not a JSON object (or repeats a key), so its model cannot be checked against rule "
     "p.yaml:9 (models: gpt-4o-mini, gpt-4.1-*, omni-moderation-*, gpt-image-1, "
     "gpt-realtime*, whisper-1); send one JSON object", None),
    ("Claude on Vertex AI: its body's fallbacks", "/v1/projects/p/locations/l/publishers/"
     "anthropic/models/gpt-4.1-x:rawPredict", _body(fallbacks=[{"model": "forbidden-x"}]),
     '(in "fallbacks[0].model")', "forbidden-x"),
    ("Gemini's body names no other model: not read", "/v1beta/models/gpt-4.1-x:generateContent",
     b'{"fallbacks": ["forbidden-x"]}', None, None),
    ("Azure deployment body: not read", "/openai/deployments/gpt-4.1-x/chat/completions",
     b'{"models": ["forbidden-x"]}', None, None),
]


@pytest.mark.parametrize(("case", "path", "body", "reason", "model"), BODIES,
                         ids=[row[0] for row in BODIES])
def test_every_model_a_call_reaches_is_checked(case: str, path: str, body: bytes | None,
                                               reason: str | None, model: str | None) -> None:
    refused = check_model(RULE, "POST", path, body)
    if reason is None:
        assert refused is None, refused
        return
    assert refused is not None, case
    assert reason in refused.reason, refused.reason
    assert (refused.status, refused.code, refused.rule) == (403, "model_not_allowed",
                                                              "p.yaml:9")
    assert refused.model == model  # (what ask mode offers a person to allow)


def test_a_rule_without_models_reads_nothing() -> None:
    free = Rule(host="api.openai.com", credential="openai")
    assert check_model(free, "POST", CHAT, _body(models=["anything"], fallbacks="default"))\
        is None


@pytest.mark.parametrize(("path", "needed"), [
    (CHAT, True),
    ("/model/anthropic.claude-x/converse", True),  # additionalModelRequestFields
    ("/v1/projects/p/locations/l/publishers/anthropic/models/c:streamRawPredict", True),
    ("/v1beta/models/gemini-2.5-pro:generateContent", False),
    ("/openai/deployments/d/chat/completions", False),
])
def test_which_bodies_are_held(path: str, needed: bool) -> None:
    assert model_in_body(RULE, "POST", path) is needed
    assert not model_in_body(RULE, "GET", path)


# A WebSocket session's messages: (format, event, reason fragment or None)
EVENTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("responses_ws", {"type": "response.create", "model": "gpt-4.1-mini"}, None),
    ("responses_ws", {"type": "response.create"}, 'names no "model"'),
    ("responses_ws", {"type": "response.create", "model": "gpt-4o"},
     f'model "gpt-4o" {NOT_ALLOWED}'),
    ("responses_ws", {"type": "response.create", "model": ["gpt-4o-mini"]},
     '"model" is not a model name (a string)'),
    ("responses_ws", {"type": "response.create", "model": "gpt-4o-mini",
                      "tools": [{"type": "image_generation", "model": "gpt-image-2"}]},
     '(in "tools[0].model")'),
    ("responses_ws", {"type": "response.create", "model": "gpt-4o-mini",
                      "models": ["forbidden-x"]}, '(in "models[0]")'),
    ("realtime", {"type": "session.update", "session": {"model": "gpt-4o"}},
     '(in "session.model")'),
    ("realtime", {"type": "session.update", "session": {"audio": {"input": {
        "transcription": {"model": "gpt-4o-x"}}}}},
     '(in "session.audio.input.transcription.model")'),
    ("realtime", {"type": "response.create", "response": {"model": "forbidden-x"}},
     '(in "response.model")'),
    ("realtime", {"type": "response.create"}, None),  # a Realtime response names none
]


@pytest.mark.parametrize(("fmt", "event", "reason"), EVENTS)
def test_session_messages_reach_models_too(fmt: str, event: dict[str, Any],
                                           reason: str | None) -> None:
    fields = body_json(json.dumps(event).encode())
    assert fields is not None
    refused = check_event_models(RULE, fields, event.get("type"), fmt)
    if reason is None:
        assert refused is None, refused
    else:
        assert refused is not None and reason in refused.reason, refused
        assert refused.code == "model_not_allowed"
