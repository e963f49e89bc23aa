"""The MCP OAuth grants the gateway holds (rules with `mcp.oauth`), revoked from the page,
through the same `McpOAuthService` as the admin API and the CLI (by: `console`). Tokens
are never shown; a consent is asked on the Approvals page (its authorization URL)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.console.site import Site, when
from gateway.services.state.base import StateUnavailable

if TYPE_CHECKING:
    from gateway.services.mcp_oauth import McpOAuthService

__all__ = ["routes"]


def _grant(g: dict[str, Any]) -> dict[str, Any]:
    expires = g.get("expires_at")
    return {"id": g["id"], "server": g["server"], "owner": g["owner"],
            "scopes": " ".join(g.get("scopes") or []) or "-", "issuer": g["issuer"],
            "created": when(g.get("created")),
            "until": when(expires) if expires is not None else "no expiry"}


def routes(site: Site, service: McpOAuthService | None) -> list[Route]:
    """The grants page and its revoke button."""

    @site.signed_in
    async def grants(request: Request, nonce: str) -> Response:
        try:
            if service is None:
                raise LookupError("this gateway is no MCP OAuth client")
            found = await service.list()
        except (LookupError, StateUnavailable) as exc:
            return site.page(request, "mcp_oauth.html", nonce, 503, title="MCP OAuth",
                             page="mcp-oauth", problem=str(exc), grants=[])
        return site.page(request, "mcp_oauth.html", nonce, title="MCP OAuth",
                         page="mcp-oauth", grants=[_grant(g) for g in found])

    @site.signed_in
    async def revoke(request: Request, nonce: str) -> Response:
        ident = request.path_params["id"]
        try:
            if service is None:
                raise LookupError("this gateway is no MCP OAuth client")
            await service.revoke(ident, "console")
            message = f"MCP OAuth grant {ident} revoked: the next request asks again"
        except KeyError:
            message = f"MCP OAuth grant {ident}: no such grant"
        except (LookupError, StateUnavailable) as exc:
            message = f"MCP OAuth grant {ident}: not revoked: {exc}"
        return site.back("/console/mcp-oauth", message)

    return [
        Route("/console/mcp-oauth", grants, methods=["GET"]),
        Route("/console/mcp-oauth/{id}/revoke", revoke, methods=["POST"]),
    ]
