"""Usage and budgets: tokens and cost over time per sandbox and policy (a chart drawn on
the server, `chart.py`, with its numbers in a table), totals, rows per policy, sandbox,
credential and model, and every budget's use against its limit and when it resets —
from the same report as `GET /v1/usage?by=hour` (`Metering.report`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.console.chart import Bar, bar_chart
from gateway.api.console.site import Site
from gateway.config import ConfigError, parse_duration
from gateway.core.policy import PolicySet

if TYPE_CHECKING:
    from gateway.services.metering import Metering

__all__ = ["SPANS", "routes"]

# The spans the filter offers (label, seconds); up to 7 days in hours, beyond in days.
SPANS = (("1h", 3600), ("6h", 6 * 3600), ("24h", 86400), ("7d", 7 * 86400),
         ("30d", 30 * 86400))
_HOURLY_UP_TO = 7 * 86400
_COUNTS = ("requests", "input_tokens", "output_tokens", "cached_input_tokens")


def _int(value: float) -> str:
    return f"{int(value):,}"


def _usd(value: float | None) -> str:
    if value is None:
        return "—"
    return f"${value:,.4f}" if value < 100 else f"${value:,.2f}"


def _start(iso: str) -> dt.datetime:
    return dt.datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def _charts(series: list[dict[str, Any]], by: str, priced: bool) -> dict[str, str]:
    """The tokens chart and (with pricing) the cost chart of `series`."""
    hourly = by == "hour"
    tokens: list[Bar] = []
    cost: list[Bar] = []
    for bucket in series:
        at = _start(bucket["start"])
        label = at.strftime("%H:%M" if hourly and at.hour else "%b %d")
        when = at.strftime("%Y-%m-%d %H:00Z" if hourly else "%Y-%m-%d")
        tokens.append(Bar(label, f"{when}: {_int(bucket['input_tokens'])} input, "
                                 f"{_int(bucket['output_tokens'])} output tokens, "
                                 f"{_int(bucket['requests'])} requests",
                          (bucket["input_tokens"], bucket["output_tokens"])))
        cost.append(Bar(label, f"{when}: {_usd(bucket['cost_usd'])}",
                        (bucket["cost_usd"] or 0.0,)))
    per = "hour" if hourly else "day"
    out = {"tokens": bar_chart(tokens, label=f"Tokens per {per}", series=("input", "output"),
                               fmt=_short)}
    if priced:
        out["cost"] = bar_chart(cost, label=f"Cost per {per} (USD)", series=("cost",),
                                fmt=lambda v: f"${v:,.2f}" if v >= 1 or not v else f"${v:.3g}")
    return out


def _short(value: float) -> str:
    """A y-axis count, short (12k, 1.5M)."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def _budget(status: dict[str, Any]) -> dict[str, Any]:
    """A budget's status as the page shows it: one meter per limited kind."""
    meters = []
    for kind, limit in status["limits"].items():
        used = status["used"][kind]
        held = status["reserved"].get(kind, 0)
        text = _usd if kind == "cost_usd" else _int
        meters.append({"kind": "cost" if kind == "cost_usd" else kind, "used": used,
                       "limit": limit, "text": f"{text(used)} of {text(limit)}",
                       "held": text(held) if held else ""})
    return {**status, "meters": meters}


def _filters(request: Request, policies: PolicySet, retention: float) -> dict[str, Any]:
    """The filter form's values (unknown or empty ones: no filter; the span: 24h)."""
    params = request.query_params
    spans = [s for s in SPANS if s[1] <= max(retention, 3600)]
    since = params.get("since") or "24h"
    try:
        seconds = parse_duration(since, "since")
    except ConfigError:
        since, seconds = "24h", 86400
    policy = params.get("policy") or None
    return {"sandbox": (params.get("sandbox") or "").strip()[:200] or None,
            "policy": policy if policy in policies.policies else None,
            "since": since, "seconds": min(seconds, retention),
            "spans": [s[0] for s in spans] + ([since] if since not in dict(spans) else []),
            "policies": sorted(policies.policies)}


def routes(site: Site, metering: Metering | None,
           policies: Callable[[], PolicySet]) -> list[Route]:
    """The usage page."""

    @site.signed_in
    async def usage(request: Request, nonce: str) -> Response:
        current = policies()
        if metering is None:
            return site.page(request, "usage.html", nonce, 503, title="Usage and budgets",
                             page="usage", problem="Metering is not enabled in this gateway "
                             "process (metering in the gateway config), so there is no "
                             "usage to show.", report=None)
        filters = _filters(request, current, metering.ledger.retention)
        now = site.clock()
        by = "hour" if filters["seconds"] <= _HOURLY_UP_TO else "day"
        report = await metering.report(current, sandbox=filters["sandbox"],
                                       policy=filters["policy"],
                                       since=now - filters["seconds"], now=now, by=by)
        priced = metering.pricing is not None
        return site.page(
            request, "usage.html", nonce, title="Usage and budgets", page="usage",
            filters=filters, report=report, by=by, priced=priced,
            charts=_charts(report["series"], by, priced),
            buckets=[b for b in report["series"] if b["requests"]],
            budgets=[_budget(b) for b in report["budgets"]], counts=_COUNTS,
            count=_int, usd=_usd)

    return [Route("/console/usage", usage, methods=["GET"])]
