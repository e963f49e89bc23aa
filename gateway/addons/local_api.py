"""The sandbox-facing API, served by the gateway itself at `http://sandbox-gateway.internal`.

A sandbox reaches it through its proxy settings like any destination, so the request
is authenticated by the sandbox's own token and decided by its policy: a policy opts
in by allowing the host (e.g. `host: sandbox-gateway.internal, methods: [POST],
paths: [/v1/tokens/refresh]`). Nothing is forwarded anywhere.

`POST /v1/tokens/refresh` exchanges the still-valid token for a fresh one (same
sandbox, policy and scope, never past the lifetime set at mint; revoking any token of
the chain stops refreshing). `?ttl=10m` asks for a shorter lifetime.
"""

from __future__ import annotations

import json

from mitmproxy import http

from gateway import metrics
from gateway.addons.common import DECISION, HOST, IDENTITY, fail_closed, refuse
from gateway.config import ConfigError, parse_duration
from gateway.errors import Refusal
from gateway.tokens import Identity, TokenError, TokenRefused, TokenService

INTERNAL_HOST = "sandbox-gateway.internal"


class LocalApi:
    """Answers requests to INTERNAL_HOST locally (after identify and enforce)."""

    def __init__(self, tokens: TokenService) -> None:
        self.tokens = tokens

    @fail_closed
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.metadata.get(HOST) != INTERNAL_HOST:
            return
        assert DECISION in flow.metadata  # enforce allowed it
        identity: Identity = flow.metadata[IDENTITY]
        req = flow.request
        if req.method != "POST" or req.path.split("?", 1)[0] != "/v1/tokens/refresh":
            refuse(flow, Refusal("policy_denied", f"{INTERNAL_HOST} serves only "
                                 "POST /v1/tokens/refresh"))
            return
        try:
            ttl_text = req.query.get("ttl")
            ttl = parse_duration(ttl_text, "ttl") if ttl_text else None
            minted = self.tokens.refresh(identity, ttl=ttl)
        except TokenRefused as refused:
            refuse(flow, Refusal(refused.code, refused.reason))
            return
        except (TokenError, ConfigError) as exc:
            refuse(flow, Refusal("bad_request", str(exc)))
            return
        metrics.TOKENS_ISSUED.labels(kind="refresh").inc()
        flow.response = http.Response.make(200, json.dumps({
            "token": minted.token, "jti": minted.jti, "expires_at": minted.expires_at,
        }).encode(), {"Content-Type": "application/json", "Cache-Control": "no-store"})
