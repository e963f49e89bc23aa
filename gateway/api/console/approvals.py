"""The approvals inbox (what ask mode holds, answered with a scope, duration and note)
and the grants in force (revoked from the page), through the same `ApprovalService`
as the admin API and the CLI (by: `console`)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.console.site import Site, form, when
from gateway.core.approvals import Approval, Grant
from gateway.services.approvals import ApprovalService, NotFound
from gateway.services.state.base import StateUnavailable

__all__ = ["routes"]


def _approval(a: Approval, now: float) -> dict[str, Any]:
    return {"id": a.id, "what": a.asked.describe(), "sandbox": a.sandbox, "policy": a.policy,
            "reason": a.reason, "state": a.state, "scope": a.scope, "by": a.by,
            "note": a.note, "left": max(0, round(a.expires - now)),
            "when": when(a.answered or a.created), "texts": _texts(a),
            "consent": a.consent.get("url") if a.asked.kind == "oauth" and
            isinstance(a.consent, dict) else None}


def _texts(a: Approval) -> list[dict[str, Any]]:
    """An MCP tool's change: its old and new description (and input schema, where it
    changed), as the page shows them (escaped by the template, as every value)."""
    change = a.change if a.asked.kind == "tool" else None
    if not isinstance(change, dict):
        return []
    old, new = change.get("old") or {}, change.get("new") or {}
    return [{"label": label, "old": old.get(key), "new": new.get(key)}
            for key, label in (("description", "Description"), ("inputSchema", "Input schema"))
            if key == "description" or old.get(key) != new.get(key)]


def _grant(g: Grant) -> dict[str, Any]:
    return {"id": g.id, "what": g.asked.describe(), "scope": g.scope, "by": g.by,
            "who": f"sandbox {g.sandbox}" if g.sandbox else f"policy {g.policy}",
            "until": when(g.expires)}


def routes(site: Site, approvals: ApprovalService | None) -> list[Route]:
    """The inbox and the grants pages."""

    def service() -> ApprovalService:
        if approvals is None:
            raise LookupError("this gateway has no approvals")
        return approvals

    @site.signed_in
    async def inbox(request: Request, nonce: str) -> Response:
        try:
            found = await service().approvals()
        except (LookupError, StateUnavailable) as exc:
            return site.page(request, "approvals.html", nonce, 503, title="Approvals",
                             page="approvals", problem=str(exc), pending=[], answered=[],
                             retention="day")
        now = site.clock()
        pending = [_approval(a, now) for a in found if a.state == "pending"]
        answered = [_approval(a, now) for a in found if a.state != "pending"]
        hours = service().retention / 3600
        return site.page(request, "approvals.html", nonce, title="Approvals",
                         page="approvals", pending=pending, answered=answered,
                         retention=f"{hours:g} hours" if hours != 24 else "day")

    @site.signed_in
    async def answer(request: Request, nonce: str) -> Response:
        values = {k: v for k, v in (await form(request)).items() if v.strip()}
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
        return site.back("/console/approvals", message)

    @site.signed_in
    async def grants(request: Request, nonce: str) -> Response:
        try:
            found = await service().grants()
        except (LookupError, StateUnavailable) as exc:
            return site.page(request, "grants.html", nonce, 503, title="Grants",
                             page="grants", problem=str(exc), grants=[])
        return site.page(request, "grants.html", nonce, title="Grants", page="grants",
                         grants=[_grant(g) for g in found])

    @site.signed_in
    async def revoke(request: Request, nonce: str) -> Response:
        ident = request.path_params["id"]
        try:
            await service().revoke(ident, "console")
            message = f"grant {ident} revoked: its tunnels close within a second"
        except NotFound:
            message = f"grant {ident}: no such grant (it expired)"
        except (LookupError, StateUnavailable) as exc:
            message = f"grant {ident}: not revoked: {exc}"
        return site.back("/console/grants", message)

    return [
        Route("/console/approvals", inbox, methods=["GET"]),
        Route("/console/approvals/{id}", answer, methods=["POST"]),
        Route("/console/grants", grants, methods=["GET"]),
        Route("/console/grants/{id}/revoke", revoke, methods=["POST"]),
    ]
