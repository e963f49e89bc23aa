"""What every console page shares: the session check (sessions in the state store,
`session.py`), CSRF and origin checks on every POST (the origin as a trusted proxy says
the browser sees it, `forwarded.py`), the page renderer (Jinja2 templates, strict
security headers) and form parsing."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.api.console.forwarded import DEFAULT_TRUSTED, TrustedProxies
from gateway.api.console.session import COOKIE, Sessions
from gateway.api.context import Handler
from gateway.services.state.base import Records, StateUnavailable

__all__ = ["HEADERS", "TEMPLATES", "Handler", "Page", "Site", "when"]

TEMPLATES = Path(__file__).parent / "templates"
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; img-src 'self'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    # same-origin, not no-referrer: under no-referrer a browser sends `Origin: null` with
    # the sign-in form's POST, which the sign-in's origin check refuses
    "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
}
Page = Callable[[Request, str], Awaitable[Response]]  # a signed-in page: (request, nonce)


@functools.cache
def _env() -> Any:
    """The templates (Jinja2 loaded at the first page: a gateway whose console is never
    opened does not carry it)."""
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(TEMPLATES),
                      autoescape=select_autoescape(["html", "svg"]))
    env.globals["when"] = when
    return env


def when(at: float | None) -> str:
    """A time as people read it in the console (UTC), or "until revoked"."""
    if at is None:
        return "until revoked"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


class Site:
    """The console's sessions and page helpers (one per admin app)."""

    def __init__(self, admin_token: str, records: Records,
                 clock: Callable[[], float] = time.time,
                 trusted_proxies: tuple[str, ...] = DEFAULT_TRUSTED) -> None:
        self.sessions = Sessions(admin_token, records, clock)
        self.proxies = TrustedProxies(trusted_proxies)
        self.clock = clock

    def page(self, request: Request, template: str, nonce: str | None, status: int = 200,
             **values: Any) -> HTMLResponse:
        """`template` rendered for the session `nonce` (None: signed out)."""
        html = _env().get_template(template).render(
            signed_in=nonce is not None,
            csrf=self.sessions.csrf(nonce) if nonce else "",
            message=request.query_params.get("message"), **values)
        return HTMLResponse(html, status_code=status, headers=HEADERS)

    @staticmethod
    def back(path: str, message: str) -> Response:
        """After a form: back to `path`, saying what happened."""
        return RedirectResponse(f"{path}?message={quote(message[:300])}", status_code=303,
                                headers=HEADERS)

    def unavailable(self, request: Request, problem: StateUnavailable) -> HTMLResponse:
        """Sessions live in the state store: while it cannot answer, nobody is let in."""
        return self.page(request, "login.html", None, 503, title="Unavailable",
                         problem=f"Console sessions are kept in the state store, which "
                                 f"cannot answer now ({problem}); try again shortly.")

    def foreign(self, request: Request) -> bool:
        """Does the request carry an `Origin` other than the console's own (as the
        browser sees it, through a trusted proxy)?"""
        origin = request.headers.get("origin")
        return origin is not None and origin != self.proxies.seen(request).origin

    def signed_in(self, handler: Page) -> Handler:
        """`handler` for a signed-in session only (else to the sign-in page); a POST must
        come from the console's own origin and carry the session's CSRF token."""
        async def wrapper(request: Request) -> Response:
            try:
                nonce = await self.sessions.check(request.cookies.get(COOKIE))
            except StateUnavailable as exc:
                return self.unavailable(request, exc)
            if nonce is None:
                return RedirectResponse("/console/login", status_code=303, headers=HEADERS)
            if request.method == "POST" and (
                    self.foreign(request)
                    or not self.sessions.csrf_ok(nonce, (await form(request)).get("csrf"))):
                return self.page(request, "login.html", None, 403, title="Refused",
                                 problem="This form's CSRF token is missing or stale, or it "
                                         "was posted from another origin; reload the page "
                                         "and try again.")
            return await handler(request, nonce)
        return wrapper


async def form(request: Request) -> dict[str, str]:
    """A URL-encoded form (what every console form posts), first value per field; the
    admin listener bounds the body (`admin.max_body`)."""
    if not hasattr(request.state, "form"):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        text = (await request.body()).decode("utf-8", "replace") \
            if kind == "application/x-www-form-urlencoded" else ""
        request.state.form = {k: v[0] for k, v in parse_qs(text, max_num_fields=50).items()}
    found: dict[str, str] = request.state.form
    return found
