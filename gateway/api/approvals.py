"""Ask mode on the admin listener: the approvals people answer and the grants they made.

    GET    /v1/approvals               pending first, then the answered (for `retention`)
    GET    /v1/approvals/{id}
    POST   /v1/approvals/{id}          {"decision": "approve" | "deny", "scope": "once" |
                                        "sandbox" | "policy" | "always", "duration": "1h",
                                        "note": "...", "by": "alice"}
    GET    /v1/grants
    DELETE /v1/grants/{id}             {"by": "alice"} (optional): revoked on every process

Answers and revocations are audit lines naming `by` (default `admin`: whoever holds the
admin token). An `always` grant's answer carries the proposed policy change (`proposal`:
the rule's YAML, the patch file, the git branch). An MCP tool's change (`asked.kind`
``tool``, `pin_descriptions`) carries the pinned and the new text in `change`, as JSON;
its answer takes no scope (approving pins the new text).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.context import Body, Handler
from gateway.api.errors import error
from gateway.core.approvals import Approval, Grant
from gateway.services.approvals import ApprovalService, NotFound
from gateway.services.state.base import StateUnavailable

__all__ = ["approval_doc", "grant_doc", "routes"]



def approval_doc(approval: Approval) -> dict[str, Any]:
    return {**approval.to_doc(), "what": approval.asked.describe()}


def grant_doc(grant: Grant) -> dict[str, Any]:
    return {**grant.to_doc(), "what": grant.asked.describe()}


_error = error


def _text(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string")
    return value


def routes(approvals: ApprovalService | None, protected: Callable[[Handler], Handler],
           body: Body) -> list[Route]:
    """The routes above (answering 404 `approvals_off` when ask mode has no store)."""

    def service() -> ApprovalService:
        if approvals is None:
            raise LookupError
        return approvals

    def guarded(handler: Handler) -> Handler:
        async def wrapper(request: Request) -> Response:
            try:
                return await handler(request)
            except LookupError as exc:
                if isinstance(exc, NotFound):
                    return _error(404, "not_found", f"no approval or grant {exc.args[0]!r} "
                                  "(or it expired)")
                return _error(404, "approvals_off", "this gateway has no approvals")
            except ValueError as exc:
                return _error(400, "bad_request", str(exc))
            except StateUnavailable as exc:
                return _error(503, "state_unavailable", str(exc))
        return protected(wrapper)

    @guarded
    async def list_approvals(request: Request) -> Response:
        return JSONResponse({"approvals": [approval_doc(a)
                                           for a in await service().approvals()]})

    @guarded
    async def get_approval(request: Request) -> Response:
        return JSONResponse(approval_doc(await service().approval(request.path_params["id"])))

    @guarded
    async def answer(request: Request) -> Response:
        data = await body(request)
        decision = _text(data, "decision")
        if decision is None:
            raise ValueError("decision is required: approve or deny")
        answered, grant, proposal = await service().answer(
            request.path_params["id"], decision, scope=_text(data, "scope"),
            duration=data.get("duration"), by=_text(data, "by") or "admin",
            note=_text(data, "note"))
        return JSONResponse({"approval": approval_doc(answered),
                             "grant": grant_doc(grant) if grant else None,
                             "proposal": proposal.to_doc() if proposal else None})

    @guarded
    async def list_grants(request: Request) -> Response:
        return JSONResponse({"grants": [grant_doc(g) for g in await service().grants()]})

    @guarded
    async def revoke(request: Request) -> Response:
        data = await body(request)
        grant = await service().revoke(request.path_params["id"],
                                       _text(data, "by") or "admin")
        return JSONResponse({"revoked": grant.id})

    return [
        Route("/v1/approvals", list_approvals, methods=["GET"]),
        Route("/v1/approvals/{id}", get_approval, methods=["GET"]),
        Route("/v1/approvals/{id}", answer, methods=["POST"]),
        Route("/v1/grants", list_grants, methods=["GET"]),
        Route("/v1/grants/{id}", revoke, methods=["DELETE"]),
    ]
