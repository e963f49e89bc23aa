"""The control plane (Starlette): health, metrics and policies here; tokens and the JWKS
(`api/tokens.py`), transparent mode's sandbox registrations (`api/registrations.py`),
explain and usage (`api/explain.py`), ask mode's approvals and grants
(`api/approvals.py`), MCP OAuth (`api/mcp_oauth.py`) and the console (`api/console/`),
each a module of routes.

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
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api import probes
from gateway.api.approvals import routes as approval_routes
from gateway.api.console import routes as console_routes
from gateway.api.context import AdminContext, Handler
from gateway.api.errors import error
from gateway.api.explain import routes as explain_routes
from gateway.api.mcp_oauth import routes as mcp_oauth_routes
from gateway.api.policies import describe_policies
from gateway.api.registrations import routes as registration_routes
from gateway.api.times import parse_since
from gateway.api.tokens import routes as token_routes
from gateway.observability import metrics

__all__ = ["AdminContext", "build_admin_app", "parse_since"]

_error = error




def build_admin_app(ctx: AdminContext) -> Starlette:
    """The Starlette app for the admin listener."""
    expected = ("Bearer " + ctx.admin_token).encode()

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

    @protected
    async def policies(request: Request) -> Response:
        return JSONResponse(describe_policies(ctx.policies()))

    async def disconnected(request: Request, exc: Exception) -> Response:
        # A malformed or cut body (uvicorn already answered 400): nothing to log.
        return Response(status_code=400)

    return Starlette(exception_handlers={ClientDisconnect: disconnected}, routes=[
        *(Route(path, probe) for path in probes.PATHS),
        Route("/metrics", metrics_endpoint),
        *token_routes(ctx, protected, body),
        *registration_routes(ctx, protected, body),
        Route("/v1/policies", policies),
        *explain_routes(ctx, protected, body),
        *approval_routes(ctx.approvals, protected, body),
        *mcp_oauth_routes(ctx.mcp_oauth, protected, body),
        *console_routes(ctx),
    ])

