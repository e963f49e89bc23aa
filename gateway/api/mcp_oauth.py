"""The gateway as MCP servers' OAuth client, on the admin listener (docs/mcp-oauth.md):

    GET    /v1/mcp/oauth/callback?state=…&code=…   where the authorization server sends
                                                   the person's browser back; completes
                                                   the consent (no admin token: the
                                                   single-use, expiring `state` is the
                                                   proof, as OAuth has it)
    GET    /v1/mcp/oauth/client-metadata           the gateway's client ID metadata
                                                   document (no admin token: it is public;
                                                   404 without mcp_oauth.client_metadata_url)
    GET    /v1/mcp/oauth/grants                    every grant (no token): owner, server,
                                                   issuer, scopes, expiry
    DELETE /v1/mcp/oauth/grants/{id}               {"by": "alice"} (optional): forgotten
                                                   on every process, the server asked to
                                                   revoke its tokens

The callback answers a small HTML page saying what happened (never a token)."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.api.context import Body, Handler
from gateway.api.errors import error
from gateway.services.state.base import StateUnavailable

if TYPE_CHECKING:
    from gateway.services.mcp_oauth import McpOAuthService

__all__ = ["routes"]

_PAGE = ("<!doctype html><html><head><meta charset=utf-8><title>{title}</title></head>"
         "<body><h1>{title}</h1><p>{text}</p></body></html>")


def _page(status: int, title: str, text: str) -> HTMLResponse:
    return HTMLResponse(_PAGE.format(title=html.escape(title), text=html.escape(text)),
                        status_code=status, headers={"Cache-Control": "no-store",
                                                     "Referrer-Policy": "no-referrer"})


def routes(service: McpOAuthService | None, protected: Callable[[Handler], Handler],
           body: Body) -> list[Route]:
    """The routes above (404 `mcp_oauth_off` without the service)."""

    async def callback(request: Request) -> Response:
        from gateway.services.mcp_oauth import ConsentFailed

        if service is None:
            return _page(404, "Not available", "this gateway is no MCP OAuth client")
        query = request.query_params
        try:
            grant = await service.complete(query.get("state", ""), query.get("code"),
                                           query.get("error"))
        except ConsentFailed as exc:
            return _page(400, "Consent not completed", str(exc))
        except StateUnavailable as exc:
            return _page(503, "Consent not completed", f"the state store: {exc}")
        return _page(200, "Consent completed", f"grant {grant['id']} for {grant['owner']} "
                     f"at {grant['server']} (scopes: {' '.join(grant['scopes']) or 'none'})"
                     ". The waiting request goes on; you may close this page.")

    async def client_metadata(request: Request) -> Response:
        document = service.client_metadata() if service is not None else None
        if document is None:
            return error(404, "not_found", "no client ID metadata document is published "
                         "(mcp_oauth.client_metadata_url)")
        return JSONResponse(document, headers={"Cache-Control": "max-age=300"})

    def guarded(handler: Handler) -> Handler:
        async def wrapper(request: Request) -> Response:
            if service is None:
                return error(404, "mcp_oauth_off", "this gateway is no MCP OAuth client")
            try:
                return await handler(request)
            except KeyError as exc:
                return error(404, "not_found", f"no MCP OAuth grant {exc.args[0]!r}")
            except ValueError as exc:
                return error(400, "bad_request", str(exc))
            except StateUnavailable as exc:
                return error(503, "state_unavailable", str(exc))
        return protected(wrapper)

    @guarded
    async def grants(request: Request) -> Response:
        assert service is not None
        return JSONResponse({"grants": await service.list()})

    @guarded
    async def revoke(request: Request) -> Response:
        assert service is not None
        data = await body(request)
        by = data.get("by", "admin")
        if not isinstance(by, str) or not by or len(by) > 200:
            raise ValueError("by must be a string of 1-200 characters")
        gone = await service.revoke(request.path_params["id"], by)
        return JSONResponse({"revoked": gone["id"]})

    return [
        Route("/v1/mcp/oauth/callback", callback, methods=["GET"]),
        Route("/v1/mcp/oauth/client-metadata", client_metadata, methods=["GET"]),
        Route("/v1/mcp/oauth/grants", grants, methods=["GET"]),
        Route("/v1/mcp/oauth/grants/{id}", revoke, methods=["DELETE"]),
    ]
