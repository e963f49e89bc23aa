"""The control plane: health, metrics, tokens, policies, explain, usage, JWKS, and ask
mode's approvals and grants (`api/approvals.py`) (Starlette).

`POST /v1/explain` answers like `policy explain`; with `"resolve": true` it also runs
the proxy's own destination check (resolution, address class, `allow_cidrs`), so an
allowed rule to a forbidden address answers `deny` with `forbidden_destination`.

Everything except `/healthz`, `/readyz`, `/metrics`, the JWKS and the token exchange
(`POST /v1/tokens/exchange`: a pod's projected service-account token is its
credential, identity.kubernetes), the MCP OAuth callback (`api/mcp_oauth.py`: its
single-use `state` is the proof) and the gateway's client ID metadata document needs
`Authorization: Bearer <admin token>`, compared in constant time. Errors use the same
JSON shape as the proxy's refusals: `{"error": code, "reason": text}`.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api import probes
from gateway.api.approvals import routes as approval_routes
from gateway.api.console import routes as console_routes
from gateway.api.context import AdminContext
from gateway.api.errors import error
from gateway.api.mcp_oauth import routes as mcp_oauth_routes
from gateway.api.policies import describe_policies
from gateway.api.times import parse_since
from gateway.config import ConfigError, parse_duration
from gateway.core.names import DestinationError, is_ip, normalize_host
from gateway.net.resolver import DestinationGuard
from gateway.observability import metrics
from gateway.services.identity.claims import TokenError, parse_scope
from gateway.services.metering import static_metering
from gateway.services.state.base import SandboxAddress, StateUnavailable

__all__ = ["AdminContext", "build_admin_app", "parse_since"]

_error = error


Handler = Callable[[Request], Awaitable[Response]]


def build_admin_app(ctx: AdminContext) -> Starlette:
    """The Starlette app for the admin listener."""
    expected = ("Bearer " + ctx.admin_token).encode()
    issued = ctx.issued  # every token issued here is recorded

    def protected(handler: Handler) -> Handler:
        async def wrapper(request: Request) -> Response:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, "admin_auth_required",
                              "send Authorization: Bearer <admin token> (certs/admin-token or "
                              "SANDBOX_GATEWAY_ADMIN_TOKEN)")
            return await handler(request)

        return wrapper

    async def body(request: Request) -> dict[str, Any]:
        try:
            data = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"body is not JSON: {exc.msg}") from None
        if not isinstance(data, dict):
            raise ValueError("body must be a JSON object")
        return data

    async def probe(request: Request) -> Response:  # /healthz, /readyz (api/probes.py)
        found = probes.answer(request.url.path, ctx.readiness)
        assert found is not None
        status, answer = found
        return JSONResponse(answer, status_code=status)

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=metrics.content_type())

    async def jwks(request: Request) -> Response:
        return JSONResponse(ctx.tokens.keys.jwks())

    @protected
    async def mint(request: Request) -> Response:
        try:
            data = await body(request)
            sandbox, policy_name = data.get("sandbox"), data.get("policy")
            if not isinstance(sandbox, str) or not isinstance(policy_name, str):
                raise ValueError("sandbox and policy are required strings")
            raw_scope = data.get("scope")
            scope = None
            if isinstance(raw_scope, str | list):
                scope = parse_scope(raw_scope)
            elif raw_scope is not None:
                raise ValueError("scope must be a space-separated string")
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
            minted = ctx.tokens.mint(sandbox, policy_name, scope, ttl=ttl, lifetime=lifetime,
                                     cidr=cidr, user=user)
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
            data = await body(request)
            sa_token = data.get("token")
            if not isinstance(sa_token, str) or not sa_token:
                raise ValueError("token (the pod's projected service-account token) is "
                                 "required")
            ttl = parse_duration(data["ttl"], "ttl") if data.get("ttl") is not None else None
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

    @protected
    async def register_sandbox(request: Request) -> Response:
        """Transparent mode: connections from `ip` are sandbox `id` under `policy`."""
        try:
            data = await body(request)
            sandbox, ip, policy = data.get("id"), data.get("ip"), data.get("policy")
            if not all(isinstance(x, str) and x for x in (sandbox, ip, policy)):
                raise ValueError("id, ip and policy are required strings")
            address = normalize_host(str(ip))
            if not is_ip(address):
                raise ValueError(f"ip {ip!r} is not an IP address")
            if ctx.policies().get(str(policy)) is None:
                raise ValueError(f"policy {policy!r} does not exist; see GET /v1/policies")
            entry = SandboxAddress(sandbox=str(sandbox), ip=address, policy=str(policy))
            await ctx.tokens.state.register_sandbox(entry)
        except (ValueError, DestinationError) as exc:
            return _error(400, "bad_request", str(exc))
        except StateUnavailable as exc:
            return _error(503, "state_unavailable", str(exc))
        return JSONResponse({"id": entry.sandbox, "ip": entry.ip, "policy": entry.policy})

    @protected
    async def unregister_sandbox(request: Request) -> Response:
        try:
            address = normalize_host(request.path_params["ip"])
            removed = await ctx.tokens.state.unregister_sandbox(address)
        except DestinationError as exc:
            return _error(400, "bad_request", str(exc))
        except StateUnavailable as exc:
            return _error(503, "state_unavailable", str(exc))
        if not removed:
            return _error(404, "not_found", f"no sandbox is registered at {address}")
        return JSONResponse({"removed": address})

    @protected
    async def list_sandboxes(request: Request) -> Response:
        return JSONResponse({"sandboxes": [
            {"id": e.sandbox, "ip": e.ip, "policy": e.policy}
            for e in ctx.tokens.state.sandboxes()]})

    @protected
    async def policies(request: Request) -> Response:
        return JSONResponse(describe_policies(ctx.policies()))

    def current_guard() -> DestinationGuard | None:
        return ctx.guard() if ctx.guard is not None else None

    @protected
    async def usage(request: Request) -> Response:
        """Usage totals by policy, sandbox, credential and model, plus budget status; with
        `by=hour` or `by=day` also the sums over time (`series`)."""
        if ctx.metering is None:
            return _error(503, "metering_unavailable", "metering is not enabled in this "
                          "gateway process")
        params = request.query_params
        unknown = sorted(set(params) - {"sandbox", "policy", "since", "by"})
        if unknown:
            return _error(400, "bad_request", f"unknown parameter {unknown[0]!r}; use "
                          "sandbox, policy, since, by")
        by = params.get("by") or None
        if by not in (None, "hour", "day"):
            return _error(400, "bad_request", f"by {str(by)[:16]!r} is not hour or day")
        now = ctx.clock()
        try:
            since = parse_since(params["since"], now) if params.get("since") else None
        except ValueError as exc:
            return _error(400, "bad_request", str(exc))
        report = await ctx.metering.report(
            ctx.policies(), sandbox=params.get("sandbox") or None,
            policy=params.get("policy") or None, since=since, now=now, by=by)
        return JSONResponse(report)

    @protected
    async def explain_endpoint(request: Request) -> Response:
        """The policy decision; with `"resolve": true` also the destination check."""
        try:
            data = await body(request)
            policy, method, url = data.get("policy"), data.get("method"), data.get("url")
            if not all(isinstance(x, str) for x in (policy, method, url)):
                raise ValueError("policy, method and url are required strings")
            resolve = data.get("resolve", False)
            if not isinstance(resolve, bool):
                raise ValueError("resolve must be true or false")
            from gateway.tools.explain import explain_body, explain_request  # (first use)
            guard = current_guard() if resolve else None
            if resolve and guard is None:
                return _error(503, "resolve_unavailable",
                              "this admin API has no destination guard to resolve with")
            text, model = data.get("body"), data.get("model")
            if not isinstance(text, str | dict | None) or not isinstance(model, str | None):
                raise ValueError("body must be a string or an object, model a string")
            if isinstance(text, dict):
                text = json.dumps(text)
            pricing = ctx.metering.pricing if ctx.metering is not None else None
            answer = await explain_request(ctx.policies(), str(policy), str(method), str(url),
                                           guard, explain_body(text, model),
                                           static_metering(pricing))
        except ValueError as exc:
            return _error(400, "bad_request", str(exc))
        decision = answer.decision
        out: dict[str, Any] = {
            "decision": answer.result, "reason": answer.reason, "error": answer.error,
            "rule": decision.rule.source if decision.rule else None,
            "credential": decision.credential, "inspect": decision.inspect,
            "models": list(decision.rule.models) if decision.rule and decision.rule.models
            else None, "metered": answer.metered,
            "ask": answer.ask.describe() if answer.ask is not None else None,
        }
        if resolve:
            out["policy_decision"] = decision.result
            out["destination"] = (answer.destination.to_dict() if answer.destination else None)
        return JSONResponse(out)

    async def disconnected(request: Request, exc: Exception) -> Response:
        # A malformed or cut body (uvicorn already answered 400): nothing to log.
        return Response(status_code=400)

    return Starlette(exception_handlers={ClientDisconnect: disconnected}, routes=[
        *(Route(path, probe) for path in probes.PATHS),
        Route("/metrics", metrics_endpoint),
        Route("/.well-known/jwks.json", jwks),
        Route("/v1/tokens", mint, methods=["POST"]),
        Route("/v1/tokens", list_tokens, methods=["GET"]),
        Route("/v1/tokens/revoke", revoke, methods=["POST"]),
        Route("/v1/tokens/exchange", exchange, methods=["POST"]),
        Route("/v1/sandboxes", register_sandbox, methods=["POST"]),
        Route("/v1/sandboxes", list_sandboxes, methods=["GET"]),
        Route("/v1/sandboxes/{ip}", unregister_sandbox, methods=["DELETE"]),
        Route("/v1/policies", policies),
        Route("/v1/explain", explain_endpoint, methods=["POST"]),
        Route("/v1/usage", usage, methods=["GET"]),
        *approval_routes(ctx.approvals, protected, body),
        *mcp_oauth_routes(ctx.mcp_oauth, protected, body),
        *console_routes(ctx),
    ])
