"""Sandbox tokens on the admin listener.

    GET  /.well-known/jwks.json    the public signing keys (no admin token: verifiers use it)
    POST /v1/tokens                {"sandbox", "policy", "scope", "ttl", "lifetime", "cidr",
                                    "user"} -> {"token", "jti", "expires_at"}
    GET  /v1/tokens                the live tokens issued through this listener
    POST /v1/tokens/revoke         {"jti"}: refused on every worker before the answer
    POST /v1/tokens/exchange       {"token": a pod's projected service-account token, "ttl"}
                                   (no admin token: the pod's token is the credential)

Every token issued here is recorded (`identity/issued.py`) and counted
(`sandbox_gateway_tokens_issued_total`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.context import AdminContext, Body, Handler
from gateway.api.errors import error as _error
from gateway.config import ConfigError, parse_duration
from gateway.observability import metrics
from gateway.services.identity.claims import TokenError, parse_scope
from gateway.services.state.base import StateUnavailable

__all__ = ["routes"]


def _mint_args(data: dict[str, Any]) -> tuple[str, str, dict[str, frozenset[str] | None] | None]:
    """`POST /v1/tokens`'s sandbox, policy and scope (ValueError, TokenError)."""
    sandbox, policy_name = data.get("sandbox"), data.get("policy")
    if not isinstance(sandbox, str) or not isinstance(policy_name, str):
        raise ValueError("sandbox and policy are required strings")
    raw_scope = data.get("scope")
    scope = None
    if isinstance(raw_scope, str | list):
        scope = parse_scope(raw_scope)
    elif raw_scope is not None:
        raise ValueError("scope must be a space-separated string")
    return sandbox, policy_name, scope


def _mint_options(data: dict[str, Any]) -> dict[str, Any]:
    """`POST /v1/tokens`'s ttl, lifetime, cidr and user (ValueError, ConfigError)."""
    ttl = parse_duration(data["ttl"], "ttl") if data.get("ttl") is not None else None
    lifetime = (parse_duration(data["lifetime"], "lifetime")
                if data.get("lifetime") is not None else None)
    cidr = data.get("cidr") or []
    if isinstance(cidr, str):
        cidr = [cidr]
    if not isinstance(cidr, list) or not all(isinstance(c, str) for c in cidr):
        raise ValueError("cidr must be a network or a list of networks")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise ValueError("user must be a string (the person the token acts for)")
    return {"ttl": ttl, "lifetime": lifetime, "cidr": cidr, "user": user}


def _exchange_args(data: dict[str, Any]) -> tuple[str, float | None]:
    """`POST /v1/tokens/exchange`'s pod token and ttl (ValueError, ConfigError)."""
    sa_token = data.get("token")
    if not isinstance(sa_token, str) or not sa_token:
        raise ValueError("token (the pod's projected service-account token) is required")
    ttl = parse_duration(data["ttl"], "ttl") if data.get("ttl") is not None else None
    return sa_token, ttl


def routes(ctx: AdminContext, protected: Callable[[Handler], Handler], body: Body
           ) -> list[Route]:
    """The routes above."""
    issued = ctx.issued  # every token issued here is recorded

    async def jwks(request: Request) -> Response:
        return JSONResponse(ctx.tokens.keys.jwks())

    @protected
    async def mint(request: Request) -> Response:
        try:
            data = await body(request)
            minted = ctx.tokens.mint(*_mint_args(data), **_mint_options(data))
        except (ValueError, TokenError, ConfigError) as exc:
            return _error(400, "bad_request", str(exc))
        metrics.TOKENS_ISSUED.labels(kind="mint").inc()
        await issued.record(minted, "mint")
        return JSONResponse({"token": minted.token, "jti": minted.jti,
                             "expires_at": minted.expires_at})

    async def exchange(request: Request) -> Response:
        """A pod's projected service-account token (`{"token": ..., "ttl": "30m"}`) for a
        gateway token bound to that pod (identity.kubernetes.exchange)."""
        from gateway.services.identity.kubernetes import ExchangeRefused

        if ctx.pods is None:
            return _error(404, "exchange_disabled", "token exchange needs "
                          "identity.kubernetes.enabled (and its exchange)")
        try:
            sa_token, ttl = _exchange_args(await body(request))
        except (ValueError, ConfigError) as exc:
            return _error(400, "bad_request", str(exc))
        try:
            got = await ctx.pods.exchange(sa_token, ttl)
        except ExchangeRefused as refused:
            metrics.TOKENS_REFUSED.labels(reason=refused.code).inc()
            return _error(refused.status, refused.code, refused.reason)
        metrics.TOKENS_ISSUED.labels(kind="exchange").inc()
        await issued.record(got.minted, "exchange")
        return JSONResponse({"token": got.minted.token, "jti": got.minted.jti,
                             "expires_at": got.minted.expires_at, "sandbox": got.sandbox,
                             "policy": got.policy})

    @protected
    async def list_tokens(request: Request) -> Response:
        """The live tokens issued through this listener (`identity/issued.py`)."""
        try:
            live = await issued.live()
        except StateUnavailable as exc:
            return _error(503, "state_unavailable", str(exc))
        return JSONResponse({"tokens": [
            {**t.to_doc(), "revoked": issued.revoked(t)} for t in live]})

    @protected
    async def revoke(request: Request) -> Response:
        try:
            data = await body(request)
        except ValueError as exc:
            return _error(400, "bad_request", str(exc))
        jti = data.get("jti")
        if not isinstance(jti, str) or not jti:
            return _error(400, "bad_request", "jti is required")
        done = await ctx.tokens.revoke(jti)  # (never waits for the state store)
        if not done.everywhere:
            return _error(503, "revocation_incomplete", done.incomplete())
        answer: dict[str, Any] = {"revoked": jti, "workers": done.workers,
                                  "stored": done.stored}
        if done.pending is not None:
            answer["pending"] = (f"{done.pending}; every worker process refuses the token "
                                 "meanwhile, other replicas once it is written")
        return JSONResponse(answer)

    return [
        Route("/.well-known/jwks.json", jwks),
        Route("/v1/tokens", mint, methods=["POST"]),
        Route("/v1/tokens", list_tokens, methods=["GET"]),
        Route("/v1/tokens/revoke", revoke, methods=["POST"]),
        Route("/v1/tokens/exchange", exchange, methods=["POST"]),
    ]
