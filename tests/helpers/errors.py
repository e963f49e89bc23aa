"""Read the gateway's refusal code from any body shape it answers with: its own
`{"error": code}`, or a provider's (OpenAI, Anthropic, Gemini) on a preset's hosts."""

from __future__ import annotations

from typing import Any


def code_of(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, str):
        return error
    if isinstance(error, dict):
        if isinstance(error.get("code"), str):
            return str(error["code"])
        for detail in error.get("details") or []:
            if isinstance(detail, dict) and "reason" in detail:
                return str(detail["reason"])
    return None


def reason_of(body: Any) -> str:
    """The refusal's reason text, whatever the body shape."""
    if not isinstance(body, dict):
        return ""
    if isinstance(body.get("reason"), str):
        return str(body["reason"])
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message", ""))
    return ""
