"""Credential presets: the hosts and carrier of common inference providers (pure data).

A policy credential ``{preset: openai, secret: ...}`` takes ``hosts`` and
``injection`` from here; it may override either with ``hosts:`` / ``inject:``.
A rule's host can only narrow where a preset credential is sent (the credential is
injected only where both the rule and the credential hosts match).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.policy.injection import Injection

__all__ = ["PRESETS", "Preset"]


@dataclass(frozen=True, slots=True)
class Preset:
    """Hosts (patterns) a provider's key may go to, and where the key goes."""

    hosts: tuple[str, ...]
    injection: Injection


_BEARER = Injection("bearer")

PRESETS: dict[str, Preset] = {
    "openai": Preset(("api.openai.com",), _BEARER),
    "anthropic": Preset(
        ("api.anthropic.com",),
        Injection("header", "x-api-key", alternatives=(_BEARER,)),
    ),
    "azure-openai": Preset(
        ("*.openai.azure.com", "*.cognitiveservices.azure.com"),
        Injection("header", "api-key"),
    ),
    "gemini": Preset(
        ("generativelanguage.googleapis.com",),
        Injection("header", "x-goog-api-key", alternatives=(Injection("query", "key"),)),
    ),
    "mistral": Preset(("api.mistral.ai",), _BEARER),
    "groq": Preset(("api.groq.com",), _BEARER),
    "openrouter": Preset(("openrouter.ai",), _BEARER),
    "huggingface": Preset(
        ("huggingface.co", "api-inference.huggingface.co", "router.huggingface.co"),
        _BEARER,
    ),
}
