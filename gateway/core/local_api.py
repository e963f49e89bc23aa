"""The sandbox-facing API at http(s)://sandbox-gateway.internal (a policy opt-in):
`POST /v1/tokens/refresh[?ttl=10m]` exchanges the connection's token for a fresh one."""

from __future__ import annotations

import json

from gateway.core.client import Client
from gateway.core.durations import parse_duration
from gateway.core.identity import TokenRefused
from gateway.core.messages import Headers, RequestHead
from gateway.core.ports import Telemetry, Tokens
from gateway.core.refusal import Answer, Refusal
from gateway.core.target import Target

__all__ = ["INTERNAL_HOST", "serve"]

INTERNAL_HOST = "sandbox-gateway.internal"


def serve(client: Client, head: RequestHead, tgt: Target, tokens: Tokens,
          telemetry: Telemetry) -> Answer:
    """The answer to a request for INTERNAL_HOST (raises Refusal); the caller audits it."""
    path, _, query = tgt.path.partition("?")
    if head.method != "POST" or path != "/v1/tokens/refresh":
        raise Refusal("policy_denied", f"{INTERNAL_HOST} serves only POST /v1/tokens/refresh")
    if client.registered or client.token is None:
        raise Refusal("auth_required", "token refresh needs a gateway token")
    assert client.identity is not None
    ttl_text = dict(p.partition("=")[::2] for p in query.split("&") if p).get("ttl")
    try:
        ttl = parse_duration(ttl_text, "ttl") if ttl_text else None
        minted = tokens.refresh(client.identity, ttl=ttl)
    except TokenRefused as refused:
        raise Refusal(refused.code, refused.reason) from None
    except ValueError as exc:  # a ttl that is no duration, or that the tokens refuse
        raise Refusal("bad_request", str(exc)) from None
    telemetry.count("tokens_issued", "refresh")
    body = json.dumps({"token": minted.token, "jti": minted.jti,
                       "expires_at": minted.expires_at}).encode()
    return Answer(200, "OK", Headers.of(
        ("Content-Type", "application/json"), ("Cache-Control", "no-store"),
        ("Content-Length", str(len(body)))), body)
