"""The console's first part over Starlette's TestClient, with a real approval service on
the memory store: sign-in and its cookie, CSRF on every form, the approvals inbox
answering a held ask, grants revoked from the page, no token in any page."""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.console import ADMIN, Clock, context, csrf_of, sign_in
from starlette.applications import Starlette
from starlette.testclient import TestClient

from gateway.api.console import routes
from gateway.api.console.session import COOKIE, KIND, LIFETIME, Sessions
from gateway.core.approvals import Asked
from gateway.core.identity import Identity
from gateway.core.policy import Request
from gateway.core.policy.ask_rule import Ask
from gateway.services.approvals import ApprovalService
from gateway.services.state.base import MemoryState, StateUnavailable

World = tuple[TestClient, ApprovalService, Clock, list[dict[str, Any]]]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    clock = Clock()
    lines: list[dict[str, Any]] = []
    state = MemoryState()
    service = ApprovalService(state, audit=lines.append)
    app = Starlette(routes=routes(context(state, clock, tmp_path / "keys", approvals=service)))
    with TestClient(app, base_url="http://127.0.0.1:8090", follow_redirects=False) as client:
        yield client, service, clock, lines


def _identity() -> Identity:
    return Identity(sandbox="sbx-1", policy="agent", jti="j", scope={}, issued_at=0,
                    expires_at=time.time() + 600, lifetime_end=time.time() + 600)


def test_sign_in_exchanges_the_token_for_a_session_cookie(world: Any) -> None:
    client, _, _, _ = world
    assert client.get("/console/approvals").headers["location"] == "/console/login"
    page = client.get("/console/login")
    assert page.status_code == 200 and 'type="password"' in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'none'")
    assert page.headers["x-frame-options"] == "DENY"
    wrong = client.post("/console/login", data={"token": "not-it"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    foreign = client.post("/console/login", data={"token": ADMIN},
                          headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403 and "set-cookie" not in foreign.headers
    cookie = sign_in(client)
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert ADMIN not in cookie
    inbox = client.get("/console/approvals")
    assert inbox.status_code == 200 and "Nothing is waiting" in inbox.text
    assert ADMIN not in inbox.text
    out = client.post("/console/logout", data={"csrf": csrf_of(inbox.text)})
    assert out.status_code == 303 and 'sgw_console=""' in out.headers["set-cookie"]


def test_a_held_ask_is_answered_from_the_inbox(world: Any) -> None:
    client, service, _, lines = world
    held = client.portal.start_task_soon(functools.partial(
        service.ask, _identity(), Asked("host", "new.test", 443),
        'no rule in policy "agent" allows host "new.test"', Ask(hosts=True, timeout=30),
        request=Request(None, "https", "new.test", 443, None)))
    sign_in(client)
    deadline = time.monotonic() + 5
    while "new.test:443 (any request)" not in (page := client.get("/console/approvals")).text:
        assert time.monotonic() < deadline, page.text
        time.sleep(0.02)
    assert "sbx-1" in page.text and "no rule in policy" in page.text
    ident = re.search(r'action="/console/approvals/(ap_[0-9a-f]+)"', page.text)
    assert ident is not None
    refused = client.post(f"/console/approvals/{ident.group(1)}",
                          data={"decision": "approve", "scope": "once"})
    assert refused.status_code == 403 and not held.done()  # (no CSRF token: refused)
    stale = client.post(f"/console/approvals/{ident.group(1)}",
                        data={"decision": "approve", "csrf": "x" * 43})
    assert stale.status_code == 403 and not held.done()
    done = client.post(f"/console/approvals/{ident.group(1)}", data={
        "decision": "approve", "scope": "sandbox", "duration": "2h", "note": "for the demo",
        "csrf": csrf_of(page.text)})
    assert done.status_code == 303 and "approved" in done.headers["location"]
    ended = held.result(5)
    assert (ended.state, ended.scope, ended.by, ended.note) == (
        "approved", "sandbox", "console", "for the demo")
    shown = client.get(done.headers["location"])
    assert "approved" in shown.text and "for the demo" in shown.text
    grants = client.get("/console/grants")
    assert "new.test:443 (any request)" in grants.text and "sandbox sbx-1" in grants.text
    grant = re.search(r'action="/console/grants/(gr_[0-9a-f]+)/revoke"', grants.text)
    assert grant is not None
    revoked = client.post(f"/console/grants/{grant.group(1)}/revoke",
                          data={"csrf": csrf_of(grants.text)})
    assert revoked.status_code == 303 and "revoked" in revoked.headers["location"]
    assert "No grants are in force" in client.get("/console/grants").text
    assert [line["decision"] for line in lines] == ["ask", "approve", "revoke"]


def test_a_denial_from_the_inbox_reaches_the_held_request(world: Any) -> None:
    client, service, _, _ = world
    held = client.portal.start_task_soon(functools.partial(
        service.ask, _identity(), Asked("request", "api.test", 443, "POST", "/v1/x"),
        "method POST is not allowed", Ask(requests=True, timeout=30),
        request=Request("POST", "https", "api.test", 443, "/v1/x")))
    sign_in(client)
    deadline = time.monotonic() + 5
    while "POST api.test:443/v1/x" not in (page := client.get("/console/approvals")).text:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ident = re.search(r'action="/console/approvals/(ap_[0-9a-f]+)"', page.text)
    assert ident is not None
    client.post(f"/console/approvals/{ident.group(1)}", data={
        "decision": "deny", "note": "<script>alert(1)</script>", "csrf": csrf_of(page.text)})
    assert held.result(5).state == "denied"
    answered = client.get("/console/approvals").text
    assert "<script>alert(1)</script>" not in answered  # (escaped)
    assert "&lt;script&gt;" in answered


def test_a_forged_or_expired_session_signs_in_again(world: Any) -> None:
    client, service, clock, _ = world
    sessions = Sessions(ADMIN, service.store, clock)
    # (a session of another admin token, in the same store: another console key)
    forged = client.portal.call(Sessions("another-admin-token-0000000000", service.store,
                                         clock).new)
    client.cookies.set(COOKIE, forged, path="/console")
    assert client.get("/console/grants").headers["location"] == "/console/login"
    client.cookies.clear()
    real = client.portal.call(sessions.new)
    client.cookies.set(COOKIE, real, path="/console")
    assert client.get("/console/grants").status_code == 200
    clock.now += LIFETIME + 1
    assert client.get("/console/grants").headers["location"] == "/console/login"
    session, mac = client.portal.call(sessions.new).split(".")
    for bad in (f"{session}x.{mac}", "junk", f"{session}.{mac}\u00e9", "a.b.c", "." * 300):
        assert client.portal.call(sessions.check, bad) is None


def _cookie(set_cookie: str) -> str:
    value = re.search(r"sgw_console=([^;]+)", set_cookie)
    assert value is not None
    return value.group(1)


def test_sign_out_ends_the_session_in_the_store(world: Any) -> None:
    """The old cookie, replayed after sign-out, is refused (it is not only deleted from
    the browser); another session goes on until "sign out everywhere" ends it too."""
    client, service, _, _ = world
    first = _cookie(sign_in(client))
    page = client.get("/console/approvals")
    client.cookies.clear()
    second = _cookie(sign_in(client))
    client.cookies.clear()
    client.cookies.set(COOKIE, first, path="/console")
    out = client.post("/console/logout", data={"csrf": csrf_of(page.text)})
    assert out.status_code == 303 and 'sgw_console=""' in out.headers["set-cookie"]
    client.cookies.clear()
    client.cookies.set(COOKIE, first, path="/console")  # (replayed)
    assert client.get("/console/approvals").headers["location"] == "/console/login"
    refused = client.post("/console/logout", data={"csrf": csrf_of(page.text)})
    assert refused.headers["location"] == "/console/login"
    client.cookies.clear()
    client.cookies.set(COOKIE, second, path="/console")
    other = client.get("/console/approvals")
    assert other.status_code == 200
    everywhere = client.post("/console/logout", data={"csrf": csrf_of(other.text),
                                                      "everywhere": "1"})
    assert everywhere.status_code == 303
    for cookie in (first, second):
        client.cookies.clear()
        client.cookies.set(COOKIE, cookie, path="/console")
        assert client.get("/console/approvals").headers["location"] == "/console/login"
    # the store keeps no cookie: only a hash of each session's id
    docs = client.portal.call(service.store.record_list, KIND)
    assert all(first.split(".")[0] not in str(d) and second.split(".")[0] not in str(d)
               for d in docs)


def test_a_post_from_another_origin_is_refused(world: Any) -> None:
    client, _, _, _ = world
    sign_in(client)
    page = client.get("/console/grants")
    refused = client.post("/console/logout", data={"csrf": csrf_of(page.text)},
                          headers={"Origin": "https://evil.example"})
    assert refused.status_code == 403
    assert client.get("/console/grants").status_code == 200  # (still signed in)
    own = client.post("/console/logout", data={"csrf": csrf_of(page.text)},
                      headers={"Origin": "http://127.0.0.1:8090"})
    assert own.status_code == 303


class _Down(MemoryState):
    """A store that cannot answer."""

    async def record_get(self, kind: str, key: str) -> Any:
        raise StateUnavailable("the state file cannot be read (test)")

    async def record_put(self, *args: Any) -> bool:
        raise StateUnavailable("the state file cannot be written (test)")


def test_sessions_fail_closed_when_the_store_cannot_answer(tmp_path: Path) -> None:
    state = _Down()
    app = Starlette(routes=routes(context(state, Clock(), tmp_path / "keys")))
    with TestClient(app, base_url="http://127.0.0.1:8090", follow_redirects=False) as client:
        refused = client.post("/console/login", data={"token": ADMIN})
        assert refused.status_code == 503 and "set-cookie" not in refused.headers
        assert "state store" in refused.text
        # a cookie signed with the console key: the store must still say it is live
        valid = client.portal.call(Sessions(ADMIN, MemoryState(), Clock()).new)
        client.cookies.set(COOKIE, valid, path="/console")
        down = client.get("/console/grants")
        assert down.status_code == 503 and "state store" in down.text


def test_a_tools_change_shows_both_texts_escaped_and_is_approved_from_the_inbox(
        world: Any) -> None:
    """An MCP tool's change (pin_descriptions): the inbox shows the pinned and the new
    text, escaped as every value (a server's `<script>` is text); no scope to choose;
    approving pins the new text."""
    from gateway.core.mcp_pins import Server, Shown

    client, service, _, _ = world
    server = Server("mcp.test", 443, "/mcp")
    old = {"name": "search", "description": "Search <b>issues</b>.", "inputSchema": {}}
    new = {**old, "description": "Search.</pre><script>alert(1)</script>",
           "inputSchema": {"type": "object"}}

    async def listings() -> None:
        service.pins.listed(_identity(), server, "search", Shown.of(old))
        await asyncio.sleep(0.05)
        service.pins.listed(_identity(), server, "search", Shown.of(new))
        await asyncio.sleep(0.05)

    client.portal.call(listings)
    sign_in(client)
    page = client.get("/console/approvals")
    assert "tool search changed on mcp.test:443/mcp" in page.text
    assert "<script>alert(1)</script>" not in page.text and "<b>issues" not in page.text
    assert "Search.&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    assert "Search &lt;b&gt;issues&lt;/b&gt;." in page.text
    assert "Input schema" in page.text  # (it changed too)
    card = page.text.split("tool search changed", 1)[1].split("</section>", 1)[0]
    assert 'name="scope"' not in card
    ident = re.search(r'action="/console/approvals/(ap_[0-9a-f]+)"', page.text)
    assert ident is not None and service.pins.quarantined(server, "search")
    done = client.post(f"/console/approvals/{ident.group(1)}", data={
        "decision": "approve", "csrf": csrf_of(page.text)})
    assert done.status_code == 303 and "approved" in done.headers["location"]
    assert not service.pins.quarantined(server, "search")
    assert client.portal.call(lambda: _listed(service, server, new))


async def _listed(service: ApprovalService, server: Any, tool: dict[str, Any]) -> bool:
    from gateway.core.mcp_pins import Shown

    return service.pins.listed(_identity(), server, "search", Shown.of(tool))
