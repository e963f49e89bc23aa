"""What the gateway would do, and what it did, on the admin listener.

    POST /v1/explain   {"policy", "method", "url", "body", "model", "resolve"}: the decision
                       `policy explain` prints; with `"resolve": true` also the proxy's own
                       destination check (resolution, address class, `allow_cidrs`), so an
                       allowed rule to a forbidden address answers `deny` with
                       `forbidden_destination`
    GET  /v1/usage     usage totals by policy, sandbox, credential and model, and budgets
                       (`sandbox`, `policy`, `since`, `by=hour|day`)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.context import AdminContext, Body, Handler
from gateway.api.errors import error as _error
from gateway.api.times import parse_since
from gateway.net.resolver import DestinationGuard
from gateway.services.metering import static_metering

__all__ = ["routes"]



def routes(ctx: AdminContext, protected: Callable[[Handler], Handler], body: Body
           ) -> list[Route]:
    """The routes above."""

    def current_guard() -> DestinationGuard | None:
        return ctx.guard() if ctx.guard is not None else None

    @protected
    async def usage(request: Request) -> Response:
        """Usage totals by policy, sandbox, credential and model, plus budget status; with
        `by=hour` or `by=day` also the sums over time (`series`)."""
        if ctx.metering is None:
            return _error(503, "metering_unavailable", "metering is not enabled in this "
                          "gateway process")
        params = request.query_params
        unknown = sorted(set(params) - {"sandbox", "policy", "since", "by"})
        if unknown:
            return _error(400, "bad_request", f"unknown parameter {unknown[0]!r}; use "
                          "sandbox, policy, since, by")
        by = params.get("by") or None
        if by not in (None, "hour", "day"):
            return _error(400, "bad_request", f"by {str(by)[:16]!r} is not hour or day")
        now = ctx.clock()
        try:
            since = parse_since(params["since"], now) if params.get("since") else None
        except ValueError as exc:
            return _error(400, "bad_request", str(exc))
        report = await ctx.metering.report(
            ctx.policies(), sandbox=params.get("sandbox") or None,
            policy=params.get("policy") or None, since=since, now=now, by=by)
        return JSONResponse(report)

    @protected
    async def explain_endpoint(request: Request) -> Response:
        """The policy decision; with `"resolve": true` also the destination check."""
        try:
            data = await body(request)
            policy, method, url = data.get("policy"), data.get("method"), data.get("url")
            if not all(isinstance(x, str) for x in (policy, method, url)):
                raise ValueError("policy, method and url are required strings")
            resolve = data.get("resolve", False)
            if not isinstance(resolve, bool):
                raise ValueError("resolve must be true or false")
            from gateway.tools.explain import explain_body, explain_request  # (first use)
            guard = current_guard() if resolve else None
            if resolve and guard is None:
                return _error(503, "resolve_unavailable",
                              "this admin API has no destination guard to resolve with")
            text, model = data.get("body"), data.get("model")
            if not isinstance(text, str | dict | None) or not isinstance(model, str | None):
                raise ValueError("body must be a string or an object, model a string")
            if isinstance(text, dict):
                text = json.dumps(text)
            pricing = ctx.metering.pricing if ctx.metering is not None else None
            answer = await explain_request(ctx.policies(), str(policy), str(method), str(url),
                                           guard, explain_body(text, model),
                                           static_metering(pricing))
        except ValueError as exc:
            return _error(400, "bad_request", str(exc))
        decision = answer.decision
        out: dict[str, Any] = {
            "decision": answer.result, "reason": answer.reason, "error": answer.error,
            "rule": decision.rule.source if decision.rule else None,
            "credential": decision.credential, "inspect": decision.inspect,
            "models": list(decision.rule.models) if decision.rule and decision.rule.models
            else None, "metered": answer.metered,
            "ask": answer.ask.describe() if answer.ask is not None else None,
        }
        if resolve:
            out["policy_decision"] = decision.result
            out["destination"] = (answer.destination.to_dict() if answer.destination else None)
        return JSONResponse(out)

    return [
        Route("/v1/explain", explain_endpoint, methods=["POST"]),
        Route("/v1/usage", usage, methods=["GET"]),
    ]
