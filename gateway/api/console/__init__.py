"""The console on the admin listener (`/console`): server-rendered pages for people.

This first part: sign-in (the admin token, exchanged for a session cookie: `session.py`),
the approvals inbox (what ask mode holds, answered with a scope, duration and note) and
the grants in force (revoked from the page). Every form carries the session's CSRF
token and a page never shows a token or a key. Works without JavaScript. Answers go
through the same `ApprovalService` as the admin API and the CLI (by: `console`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from gateway.api.console.session import COOKIE, LIFETIME, Sessions
from gateway.core.approvals import Approval, Grant
from gateway.services.approvals import ApprovalService, NotFound
from gateway.services.state.base import StateUnavailable

__all__ = ["routes"]

_HERE = Path(__file__).parent / "templates"
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
}
Handler = Callable[[Request], Awaitable[Response]]


@functools.cache
def _env() -> Any:
    """The templates (Jinja2 loaded at the first page: a gateway whose console is never
    opened does not carry it)."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    return Environment(loader=FileSystemLoader(_HERE), autoescape=select_autoescape(["html"]))


def _when(at: float | None) -> str:
    if at is None:
        return "until revoked"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


def _approval(a: Approval, now: float) -> dict[str, Any]:
    return {"id": a.id, "what": a.asked.describe(), "sandbox": a.sandbox, "policy": a.policy,
            "reason": a.reason, "state": a.state, "scope": a.scope, "by": a.by,
            "note": a.note, "left": max(0, round(a.expires - now)),
            "when": _when(a.answered or a.created)}


def _grant(g: Grant) -> dict[str, Any]:
    return {"id": g.id, "what": g.asked.describe(), "scope": g.scope, "by": g.by,
            "who": f"sandbox {g.sandbox}" if g.sandbox else f"policy {g.policy}",
            "until": _when(g.expires)}


async def _form(request: Request) -> dict[str, str]:
    """A URL-encoded form (what every console form posts), first value per field; the
    admin listener bounds the body (`admin.max_body`)."""
    if not hasattr(request.state, "form"):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        text = (await request.body()).decode("utf-8", "replace") \
            if kind == "application/x-www-form-urlencoded" else ""
        request.state.form = {k: v[0] for k, v in parse_qs(text, max_num_fields=50).items()}
    form: dict[str, str] = request.state.form
    return form


def routes(admin_token: str, approvals: ApprovalService | None,
           clock: Callable[[], float] = time.time) -> list[Route]:
    """The console's routes (mounted on the admin app)."""
    sessions = Sessions(admin_token, clock)

    def page(request: Request, template: str, nonce: str | None, status: int = 200,
             **values: Any) -> HTMLResponse:
        html = _env().get_template(template).render(
            signed_in=nonce is not None, csrf=sessions.csrf(nonce) if nonce else "",
            message=request.query_params.get("message"), **values)
        return HTMLResponse(html, status_code=status, headers=_HEADERS)

    def signed_in(handler: Callable[[Request, str], Awaitable[Response]]) -> Handler:
        async def wrapper(request: Request) -> Response:
            nonce = sessions.check(request.cookies.get(COOKIE))
            if nonce is None:
                return RedirectResponse("/console/login", status_code=303, headers=_HEADERS)
            if request.method == "POST" and \
                    not sessions.csrf_ok(nonce, (await _form(request)).get("csrf")):
                return page(request, "login.html", None, 403, title="Refused",
                            problem="This form's CSRF token is missing or stale; reload the "
                                    "page and try again.")
            return await handler(request, nonce)
        return wrapper

    async def login_form(request: Request) -> Response:
        return page(request, "login.html", None, title="Sign in")

    async def login(request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return page(request, "login.html", None, 403, title="Sign in",
                        problem="Sign in from the console's own page.")
        token = (await _form(request)).get("token")
        if token is None or not sessions.token_ok(token):
            return page(request, "login.html", None, 401, title="Sign in",
                        problem="That is not the admin token.")
        response = RedirectResponse("/console/approvals", status_code=303, headers=_HEADERS)
        response.set_cookie(COOKIE, sessions.new(), max_age=int(LIFETIME), path="/console",
                            httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    @signed_in
    async def logout(request: Request, nonce: str) -> Response:
        response = RedirectResponse("/console/login", status_code=303, headers=_HEADERS)
        response.delete_cookie(COOKIE, path="/console")
        return response

    async def home(request: Request) -> Response:
        return RedirectResponse("/console/approvals", status_code=303)

    async def css(request: Request) -> Response:
        return Response((_HERE / "console.css").read_bytes(), media_type="text/css",
                        headers={"Cache-Control": "max-age=300"})

    def service() -> ApprovalService:
        if approvals is None:
            raise LookupError("this gateway has no approvals")
        return approvals

    @signed_in
    async def inbox(request: Request, nonce: str) -> Response:
        try:
            found = await service().approvals()
        except (LookupError, StateUnavailable) as exc:
            return page(request, "approvals.html", nonce, 503, title="Approvals",
                        problem=str(exc), pending=[], answered=[], retention="day")
        now = clock()
        pending = [_approval(a, now) for a in found if a.state == "pending"]
        answered = [_approval(a, now) for a in found if a.state != "pending"]
        hours = service().retention / 3600
        return page(request, "approvals.html", nonce, title="Approvals", page="approvals",
                    pending=pending, answered=answered,
                    retention=f"{hours:g} hours" if hours != 24 else "day")

    @signed_in
    async def answer(request: Request, nonce: str) -> Response:
        values = {k: v for k, v in (await _form(request)).items() if v.strip()}
        ident = request.path_params["id"]
        try:
            answered, grant, proposal = await service().answer(
                ident, values.get("decision", ""), scope=values.get("scope"),
                duration=values.get("duration") if values.get("scope") in (
                    "sandbox", "policy") else None, by="console", note=values.get("note"))
        except NotFound:
            message = f"{ident}: no such approval (it expired)"
        except (ValueError, LookupError, StateUnavailable) as exc:
            message = f"{ident}: not answered: {exc}"
        else:
            message = f"{answered.asked.describe()}: {answered.state}" + (
                f", grant {grant.id}" if grant else "") + (
                f", proposed change: {proposal.branch or proposal.patch}" if proposal else "")
        return RedirectResponse(f"/console/approvals?message={quote(message[:300])}",
                                status_code=303, headers=_HEADERS)

    @signed_in
    async def grants(request: Request, nonce: str) -> Response:
        try:
            found = await service().grants()
        except (LookupError, StateUnavailable) as exc:
            return page(request, "grants.html", nonce, 503, title="Grants", problem=str(exc),
                        grants=[])
        return page(request, "grants.html", nonce, title="Grants", page="grants",
                    grants=[_grant(g) for g in found])

    @signed_in
    async def revoke(request: Request, nonce: str) -> Response:
        ident = request.path_params["id"]
        try:
            await service().revoke(ident, "console")
            message = f"grant {ident} revoked: its tunnels close within a second"
        except NotFound:
            message = f"grant {ident}: no such grant (it expired)"
        except (LookupError, StateUnavailable) as exc:
            message = f"grant {ident}: not revoked: {exc}"
        return RedirectResponse(f"/console/grants?message={quote(message[:300])}",
                                status_code=303, headers=_HEADERS)

    return [
        Route("/console", home, methods=["GET"]),
        Route("/console/", home, methods=["GET"]),
        Route("/console/static/console.css", css, methods=["GET"]),
        Route("/console/login", login_form, methods=["GET"]),
        Route("/console/login", login, methods=["POST"]),
        Route("/console/logout", logout, methods=["POST"]),
        Route("/console/approvals", inbox, methods=["GET"]),
        Route("/console/approvals/{id}", answer, methods=["POST"]),
        Route("/console/grants", grants, methods=["GET"]),
        Route("/console/grants/{id}/revoke", revoke, methods=["POST"]),
    ]
