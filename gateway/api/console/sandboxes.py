"""Sandboxes, tokens and policies: the live tokens issued here (`identity/issued.py`)
with Revoke, the sandboxes registered for transparent mode with Unregister, and the
policies in force with the set's revision — through the same state store calls as the
admin API (`POST /v1/tokens/revoke`, `DELETE /v1/sandboxes/{ip}`, `GET /v1/policies`)."""

from __future__ import annotations

import re
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.console.site import Site
from gateway.api.policies import describe_policies
from gateway.core.names import DestinationError, normalize_host
from gateway.core.policy import PolicySet
from gateway.services.identity.issued import IssuedTokens
from gateway.services.identity.tokens import TokenService
from gateway.services.state.base import StateUnavailable

__all__ = ["SHOWN", "routes"]

SHOWN = 500  # tokens listed at most (newest first); the page says how many more
_JTI = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PAGE = "/console/sandboxes"


def routes(site: Site, tokens: TokenService, policies: Callable[[], PolicySet],
           issued: IssuedTokens) -> list[Route]:
    """The sandboxes page and its two forms."""

    @site.signed_in
    async def page(request: Request, nonce: str) -> Response:
        problem = None
        try:
            live = await issued.live()
        except StateUnavailable as exc:
            live, problem = [], f"The live tokens cannot be read: {exc}"
        return site.page(
            request, "sandboxes.html", nonce, 503 if problem else 200,
            title="Sandboxes, tokens and policies", page="sandboxes", problem=problem,
            tokens=[{"token": t, "revoked": issued.revoked(t)} for t in live[:SHOWN]],
            more=max(0, len(live) - SHOWN),
            sandboxes=sorted(tokens.state.sandboxes(), key=lambda s: (s.sandbox, s.ip)),
            policies=describe_policies(policies()))

    @site.signed_in
    async def revoke(request: Request, nonce: str) -> Response:
        jti = request.path_params["jti"]
        if _JTI.fullmatch(jti) is None:
            return site.back(_PAGE, "not revoked: that is not a token id")
        done = await tokens.revoke(jti)  # (as POST /v1/tokens/revoke)
        if not done.everywhere:
            return site.back(_PAGE, done.incomplete())
        pending = "" if done.pending is None else (
            f" (the state store could not be written: {done.pending}; it is written when "
            "the store is back, and other replicas refuse it from then on)")
        return site.back(_PAGE, f"token {jti} revoked: every worker refuses it, and every "
                                "token refreshed from it, from now on, and ends its open "
                                "connections (tunnels, streams, WebSockets) within a second"
                                + pending)

    @site.signed_in
    async def unregister(request: Request, nonce: str) -> Response:
        try:
            address = normalize_host(request.path_params["ip"])
            removed = await tokens.state.unregister_sandbox(address)
        except DestinationError as exc:
            return site.back(_PAGE, f"not unregistered: {exc}")
        except StateUnavailable as exc:
            return site.back(_PAGE, f"{address}: not unregistered: {exc}")
        if not removed:
            return site.back(_PAGE, f"no sandbox is registered at {address}")
        return site.back(_PAGE, f"sandbox at {address} unregistered: its connections are no "
                                "longer identified, and those open end within a second")

    return [
        Route(_PAGE, page, methods=["GET"]),
        Route("/console/tokens/{jti}/revoke", revoke, methods=["POST"]),
        Route("/console/sandboxes/{ip}/unregister", unregister, methods=["POST"]),
    ]
