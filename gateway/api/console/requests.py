"""The request log: the newest audit lines of every process (the state store's request
log, `services/state/log.py`), filtered; a "refused first" view; a line's full decision
with the `policy explain` of the same request and, for a refusal, what to change; and
the live stream (server-sent events) the page's one script appends from.

Without JavaScript the page is complete (filters, paging to older lines, the detail);
the script only adds lines as they happen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.api.console.advice import advice
from gateway.api.console.commands import explain_command
from gateway.api.console.site import HEADERS, Site
from gateway.api.context import AdminContext
from gateway.api.times import parse_since
from gateway.services.metering import static_metering
from gateway.services.state.base import StateUnavailable
from gateway.services.state.log import LogEntry, LogLines, LogQuery

__all__ = ["POLL", "STREAM_LIFETIME", "routes", "summary"]

PAGE = 200  # lines per page
POLL = 0.5  # seconds between the live stream's reads of the store
HEARTBEAT = 15.0  # seconds between keep-alive comments on a quiet stream
STREAM_LIFETIME = 300.0  # a stream ends then; the browser reconnects where it was
_CURSOR = re.compile(r"[0-9]{1,19}(-[0-9]{1,19})?")
_MAX_ID = 2**63 - 1  # (SQLite's integers, and far past any Redis stream id's parts)
_FILTERS = ("sandbox", "policy", "host", "decision", "code", "engine", "since", "until")
_SHOWN = ("time", "sandbox", "policy", "method", "scheme", "host", "port", "path",
          "decision", "error", "status", "engine", "rule", "reason", "duration_ms")


class BadFilter(ValueError):
    """A filter people typed that cannot be used (said on the page)."""


def cursor_of(value: str | None) -> str | None:
    """A cursor given by the page (`before`, `after`, `Last-Event-ID`, a line's id): a
    store id (digits, or a Redis stream id), each number below 2^63. Raises BadFilter."""
    if value is not None and (not _CURSOR.fullmatch(value) or any(
            int(part) > _MAX_ID for part in value.split("-"))):
        raise BadFilter(f"{value[:40]!r} is not a line id")
    return value


def query_of(params: dict[str, str], now: float) -> LogQuery:
    """The log query of a page's filter fields. Raises BadFilter."""
    try:
        since = parse_since(params["since"], now) if params.get("since") else None
        until = parse_since(params["until"], now) if params.get("until") else None
    except ValueError as exc:
        raise BadFilter(str(exc)) from None
    return LogQuery(**{k: params.get(k, "").strip()[:200] for k in _FILTERS[:6]},
                    since=since, until=until)


def summary(cursor: str, entry: LogEntry) -> dict[str, Any]:
    """What a table row (and a live event) shows of a line."""
    try:
        doc = json.loads(entry.line)
    except ValueError:
        doc = {}
    row = {k: doc.get(k) for k in _SHOWN}
    if not isinstance(row["time"], str) or len(row["time"]) < 19:  # (not the sink's line)
        row["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(entry.at))
    row["id"] = cursor
    row["refused"] = entry.decision == "deny"
    return row


def _url(doc: dict[str, Any]) -> tuple[str, str] | None:
    """The method and URL `policy explain` takes for a logged request (None: not one)."""
    host, port, scheme = doc.get("host"), doc.get("port"), doc.get("scheme")
    if not isinstance(host, str) or not host or not isinstance(port, int):
        return None
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    method, path = doc.get("method"), doc.get("path")
    if not isinstance(method, str) or not isinstance(path, str) or method == "CONNECT":
        return "CONNECT", f"{'tcp' if scheme == 'tcp' else 'https'}://{authority}"
    return method, f"{scheme if scheme in ('http', 'https') else 'https'}://{authority}{path}"


def routes(site: Site, ctx: AdminContext) -> list[Route]:
    """The request log's pages and its live stream."""
    store: LogLines | None = ctx.request_log

    def off(request: Request, nonce: str) -> Response:
        return site.page(request, "requests.html", nonce, 503, title="Requests",
                         page="requests", problem="The request log is off on this gateway "
                         "(console.retain: 0); the audit trail is in audit.path or stdout.",
                         rows=[], refused=[], filters={}, stream="", older="")

    @site.signed_in
    async def listing(request: Request, nonce: str) -> Response:
        if store is None:
            return off(request, nonce)
        params = {k: v for k, v in request.query_params.items()}
        filters = {k: params.get(k, "") for k in _FILTERS}
        view = "refused" if params.get("view") == "refused" else "all"
        values: dict[str, Any] = {"title": "Requests", "page": "requests",
                                  "filters": filters, "view": view, "rows": [],
                                  "refused": [], "stream": "", "older": ""}
        try:
            query = query_of(params, site.clock())
            before = cursor_of(params.get("before") or None)
            if view == "refused":
                refused = dataclasses.replace(query, decision="deny")
                values["refused"] = [summary(c, e) for c, e in
                                     await store.log_read(refused, PAGE, before=before)]
            found = await store.log_read(query, PAGE, before=before)
            newest = found[0][0] if found and before is None else await store.log_last()
        except BadFilter as exc:
            return site.page(request, "requests.html", nonce, 400, problem=str(exc),
                             **values)
        except StateUnavailable as exc:
            return site.page(request, "requests.html", nonce, 503, problem=str(exc),
                             **values)
        values["rows"] = [summary(c, e) for c, e in found if not (
            view == "refused" and e.decision == "deny")]
        kept = {k: v for k, v in filters.items() if v}
        if len(found) == PAGE:
            values["older"] = _link("/console/requests", {**kept, "view": view,
                                                           "before": found[-1][0]})
        if before is None:  # (the newest page follows the live stream)
            values["stream"] = _link("/console/requests/stream", {**kept, "after": newest})
        return site.page(request, "requests.html", nonce, **values)

    @site.signed_in
    async def detail(request: Request, nonce: str) -> Response:
        if store is None:
            return off(request, nonce)
        cursor = request.path_params["id"]
        try:
            entry = await store.log_get(cursor_of(cursor) or "")
        except BadFilter as exc:
            return site.page(request, "request.html", nonce, 404, title="Request",
                             page="requests", problem=str(exc), line=None)
        except StateUnavailable as exc:
            return site.page(request, "request.html", nonce, 503, title="Request",
                             page="requests", problem=str(exc), line=None)
        if entry is None:
            return site.page(request, "request.html", nonce, 404, title="Request",
                             page="requests", problem=f"line {cursor[:40]} is no longer in "
                             "the request log (console.retain)", line=None)
        doc = json.loads(entry.line)
        current = ctx.policies()
        explained, problem = await _explain(ctx, doc)
        return site.page(request, "request.html", nonce, title="Request", page="requests",
                         line=doc, pretty=json.dumps(doc, indent=2), row=summary(cursor,
                                                                                 entry),
                         advice=advice(doc.get("error")) if entry.decision == "deny"
                         else None, explained=explained, explain_problem=problem,
                         revision=current.revision)

    @site.signed_in
    async def stream(request: Request, nonce: str) -> Response:
        if store is None:
            return Response(status_code=404, headers=HEADERS)
        params = dict(request.query_params)
        try:
            query = query_of(params, site.clock())
            after = cursor_of(request.headers.get("last-event-id") or params.get("after")
                              or None)
        except BadFilter as exc:
            return Response(str(exc), status_code=400, headers=HEADERS)
        if request.method == "HEAD":  # (no stream: it would run on, unread, for minutes)
            return Response(status_code=200, media_type="text/event-stream",
                            headers={**HEADERS, "X-Accel-Buffering": "no"})
        if after is None:
            try:
                after = await store.log_last()
            except StateUnavailable:
                after = "0"
        return StreamingResponse(_events(request, store, query, after, ctx.stopping),
                                 media_type="text/event-stream",
                                 headers={**HEADERS, "X-Accel-Buffering": "no"})

    return [
        Route("/console/requests", listing, methods=["GET"]),
        Route("/console/requests/stream", stream, methods=["GET"]),
        Route("/console/requests/{id}", detail, methods=["GET"]),
    ]


def _link(path: str, params: dict[str, str]) -> str:
    return f"{path}?{urlencode(params)}"


async def _explain(ctx: AdminContext, doc: dict[str, Any]) -> tuple[dict[str, Any] | None,
                                                                     str | None]:
    """`policy explain` of the logged request under today's policies."""
    asked = _url(doc)
    policy = doc.get("policy")
    if asked is None or not isinstance(policy, str):
        return None, "This line is not a request to a host (nothing to explain)."
    method, url = asked
    from gateway.tools.explain import explain_request  # (first use: 0.5 MiB a worker)
    pricing = ctx.metering.pricing if ctx.metering is not None else None
    try:
        answer = await explain_request(ctx.policies(), policy, method, url, None,
                                       metering=static_metering(pricing))
    except ValueError as exc:
        return None, str(exc)
    rule = answer.decision.rule
    return {"command": explain_command(policy, method, url),
            "decision": answer.result, "reason": answer.reason, "error": answer.error,
            "rule": f"{rule.source} ({rule.describe()})" if rule else None,
            "credential": answer.decision.credential,
            "ask": answer.ask.describe() if answer.ask is not None else None}, None


async def _events(request: Request, store: LogLines, query: LogQuery, after: str,
                  stopping: Callable[[], bool]) -> AsyncIterator[bytes]:
    """New lines as server-sent events (`id:` the cursor, so a reconnecting browser
    resumes after the last it saw), a comment now and then on a quiet stream; ends after
    `STREAM_LIFETIME`, when the browser leaves, when the store fails, or when the gateway
    stops (within a poll: the drain never waits for a console)."""
    yield b"retry: 2000\n\n"
    started = quiet = time.monotonic()
    while time.monotonic() - started < STREAM_LIFETIME:
        if stopping() or await request.is_disconnected():
            return
        try:
            found = await store.log_read(query, PAGE, after=after)
        except StateUnavailable:
            yield b"event: problem\ndata: the request log cannot be read now\n\n"
            return
        if found:
            after = found[-1][0]
            yield b"".join(
                f"id: {c}\ndata: {json.dumps(summary(c, e), separators=(',', ':'))}\n\n"
                .encode() for c, e in found)
            quiet = time.monotonic()
        elif time.monotonic() - quiet > HEARTBEAT:
            yield b": quiet\n\n"
            quiet = time.monotonic()
        if len(found) < PAGE:
            await asyncio.sleep(POLL)
