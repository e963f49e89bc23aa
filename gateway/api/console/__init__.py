"""The console on the admin listener (`/console`): server-rendered pages for people.

Sign-in with the admin token, exchanged for a session kept in the state store and a cookie
naming it (`session.py`: sign-out ends it on every process); every page is a module with
its routes, sharing `site.py` (session check, CSRF and origin on every POST, the renderer
with a strict CSP) and `forwarded.py` (what a trusted reverse proxy says the browser
sees: the cookie's `Secure` flag and the origin checked). Pages work without JavaScript;
a page never shows a token or a key.

- `requests.py`: the request log (every process's audit lines, filtered, refused
  first, a line's decision with today's explain and what to change; live over SSE);
- `approvals.py`: the approvals inbox and the grants in force;
- `mcp_oauth.py`: the MCP OAuth grants the gateway holds (revoked from the page);
- `usage.py`: usage over time (an SVG chart, `chart.py`), totals, rows and budgets.
- `sandboxes.py`: live tokens (revoke), registered sandboxes (unregister), policies.
- `learn.py`: a policy learned from the request log, its replay proof and diffs.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from gateway.api.console import approvals, learn, mcp_oauth, requests, sandboxes, usage
from gateway.api.console.session import COOKIE, LIFETIME
from gateway.api.console.site import HEADERS, TEMPLATES, Site, form
from gateway.api.context import AdminContext
from gateway.services.state.base import StateUnavailable

__all__ = ["routes"]

log = logging.getLogger("sandbox_gateway")

_STATIC = {"console.css": "text/css", "console.js": "text/javascript"}


def routes(ctx: AdminContext) -> list[Route]:
    """The console's routes (mounted on the admin app)."""
    site = Site(ctx.admin_token, ctx.tokens.state, ctx.clock, ctx.trusted_proxies)
    sessions = site.sessions

    async def login_form(request: Request) -> Response:
        return site.page(request, "login.html", None, title="Sign in")

    async def login(request: Request) -> Response:
        seen = site.proxies.seen(request)
        if site.foreign(request):
            log.warning("console: a sign-in from another origin was refused (from %s)",
                        seen.client)
            return site.page(request, "login.html", None, 403, title="Sign in",
                             problem="Sign in from the console's own page.")
        token = (await form(request)).get("token")
        if token is None or not sessions.token_ok(token):
            log.warning("console: a sign-in with a wrong admin token was refused (from %s)",
                        seen.client)
            return site.page(request, "login.html", None, 401, title="Sign in",
                             problem="That is not the admin token.")
        try:
            cookie = await sessions.new()
        except StateUnavailable as exc:
            return site.unavailable(request, exc)
        response = RedirectResponse("/console/approvals", status_code=303, headers=HEADERS)
        response.set_cookie(COOKIE, cookie, max_age=int(LIFETIME), path="/console",
                            httponly=True, samesite="strict", secure=seen.scheme == "https")
        return response

    @site.signed_in
    async def logout(request: Request, nonce: str) -> Response:
        """Sign out: the session ends on every process (`everywhere`: every session)."""
        try:
            if (await form(request)).get("everywhere"):
                await sessions.end_all()
            else:
                await sessions.end(request.cookies.get(COOKIE))
        except StateUnavailable as exc:
            return site.unavailable(request, exc)
        response = RedirectResponse("/console/login", status_code=303, headers=HEADERS)
        response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict",
                               secure=site.proxies.seen(request).scheme == "https")
        return response

    async def home(request: Request) -> Response:
        return RedirectResponse("/console/approvals", status_code=303)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _STATIC:
            return Response(status_code=404)
        return Response((TEMPLATES / name).read_bytes(), media_type=_STATIC[name],
                        headers={"Cache-Control": "max-age=300",
                                 "X-Content-Type-Options": "nosniff"})

    return [
        Route("/console", home, methods=["GET"]),
        Route("/console/", home, methods=["GET"]),
        Route("/console/static/{name}", static, methods=["GET"]),
        Route("/console/login", login_form, methods=["GET"]),
        Route("/console/login", login, methods=["POST"]),
        Route("/console/logout", logout, methods=["POST"]),
        *requests.routes(site, ctx),
        *approvals.routes(site, ctx.approvals),
        *mcp_oauth.routes(site, ctx.mcp_oauth),
        *usage.routes(site, ctx.metering, ctx.policies),
        *sandboxes.routes(site, ctx.tokens, ctx.policies, ctx.issued),
        *learn.routes(site, ctx.request_log, ctx.policies, ctx.policies_dir),
    ]
