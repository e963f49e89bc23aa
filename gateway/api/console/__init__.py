"""The console on the admin listener (`/console`): server-rendered pages for people.

Sign-in with the admin token, exchanged for a session cookie (`session.py`); every page
is a module with its routes, sharing `site.py` (session check, CSRF on every POST, the
renderer with a strict CSP). Pages work without JavaScript; a page never shows a token
or a key.

- `requests.py`: the request log (every process's audit lines, filtered, refused
  first, a line's decision with today's explain and what to change; live over SSE);
- `approvals.py`: the approvals inbox and the grants in force;
- `usage.py`: usage over time (an SVG chart, `chart.py`), totals, rows and budgets.
- `sandboxes.py`: live tokens (revoke), registered sandboxes (unregister), policies.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from gateway.api.console import approvals, requests, sandboxes, usage
from gateway.api.console.session import COOKIE, LIFETIME
from gateway.api.console.site import HEADERS, TEMPLATES, Site, form
from gateway.api.context import AdminContext

__all__ = ["routes"]

_STATIC = {"console.css": "text/css", "console.js": "text/javascript"}


def routes(ctx: AdminContext) -> list[Route]:
    """The console's routes (mounted on the admin app)."""
    site = Site(ctx.admin_token, ctx.clock)
    sessions = site.sessions

    async def login_form(request: Request) -> Response:
        return site.page(request, "login.html", None, title="Sign in")

    async def login(request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return site.page(request, "login.html", None, 403, title="Sign in",
                             problem="Sign in from the console's own page.")
        token = (await form(request)).get("token")
        if token is None or not sessions.token_ok(token):
            return site.page(request, "login.html", None, 401, title="Sign in",
                             problem="That is not the admin token.")
        response = RedirectResponse("/console/approvals", status_code=303, headers=HEADERS)
        response.set_cookie(COOKIE, sessions.new(), max_age=int(LIFETIME), path="/console",
                            httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    @site.signed_in
    async def logout(request: Request, nonce: str) -> Response:
        response = RedirectResponse("/console/login", status_code=303, headers=HEADERS)
        response.delete_cookie(COOKIE, path="/console")
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
        *usage.routes(site, ctx.metering, ctx.policies),
        *sandboxes.routes(site, ctx.tokens, ctx.policies),
    ]
