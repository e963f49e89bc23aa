"""Transparent mode's sandbox registrations on the admin listener: which sandbox and
policy a source address is (`identity`'s answer for a connection without a token).

    POST   /v1/sandboxes           {"id", "ip", "policy"}
    GET    /v1/sandboxes
    DELETE /v1/sandboxes/{ip}

Kept in the state store: every worker and replica sees a registration before the answer.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.context import AdminContext, Body, Handler
from gateway.api.errors import error as _error
from gateway.core.names import DestinationError, is_ip, normalize_host
from gateway.services.state.base import SandboxAddress, StateUnavailable

__all__ = ["routes"]



def routes(ctx: AdminContext, protected: Callable[[Handler], Handler], body: Body
           ) -> list[Route]:
    """The routes above."""

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

    return [
        Route("/v1/sandboxes", register_sandbox, methods=["POST"]),
        Route("/v1/sandboxes", list_sandboxes, methods=["GET"]),
        Route("/v1/sandboxes/{ip}", unregister_sandbox, methods=["DELETE"]),
    ]
