"""The console in a real headless Chromium against a real gateway (issue 27): sign in
with the admin token, a request held by ask mode shows in the inbox and is approved or
denied from the page while the sandbox's client waits, a grant is revoked from the grants
page and its tunnel closes, a form without its CSRF token is refused and answers nothing,
the session cookie is HttpOnly and SameSite=Strict, and no key or token is in any page.

The request log shows a refused request live, and a token revoked on the sandboxes page
ends its open tunnel.

One gateway for the module (distinct sandboxes and paths per test); a fresh browser per
test (tests/integration/conftest.py: `browser`, screenshots of failures).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from helpers.approvals import Call, admin_api, admin_token, ask_gateway, connect
from helpers.browser import (
    WebDriver,
    accessibility_violations,
    answer_approval,
    approval_card,
    assert_no_secrets,
    click,
    navigation_status,
    open_page,
    page_html,
    pages_seen,
    sign_in,
    table_row,
    wait_for_approval,
    wait_for_text,
)
from helpers.clients import open_tunnel
from helpers.gateway import GatewayThread
from helpers.tls import LocalCA
from helpers.upstream import Upstream
from integration.conftest import NAMES
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.common.by import By

POLICY = """\
version: v1
name: agent
ask: {hosts: true, requests: true, timeout: 30s}
egress:
  - host: allowed.test
    methods: [GET]
    paths: ["/ok"]
  - host: api.openai.com
    methods: [POST]
    paths: ["/v1/chat/completions"]
    credential: openai
    ask: {timeout: 30s}
  - host: blocked.test
    action: deny
    reason: not for agents
credentials:
  openai: {preset: openai, secret: openai-key}
"""
KEY = "sk-real-console-0123456789abcdef"  # the upstream credential
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, test_ca: LocalCA, upstream: Upstream
       ) -> Iterator[GatewayThread]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SANDBOX_GATEWAY_SECRET_OPENAI_KEY", KEY)
        gateway = ask_gateway(tmp_path_factory.mktemp("console"), test_ca, upstream, NAMES,
                              POLICY)
        try:
            yield gateway
        finally:
            gateway.stop()


@pytest.fixture(scope="module")
def secrets(gw: GatewayThread) -> list[str]:
    """What no page may show: the admin token, the upstream key, and every sandbox token
    the tests mint (appended as they go)."""
    return [admin_token(gw), KEY]


@pytest.fixture(autouse=True)
def no_secret_in_any_page(browser: WebDriver, secrets: list[str]) -> Iterator[None]:
    """Every page a test read is checked for every secret, once the test is done."""
    yield
    for url, html in pages_seen(browser):
        assert_no_secrets(html, secrets, where=url)


def _held(gw: GatewayThread, browser: WebDriver, secrets: list[str], url: str, sandbox: str,
          chat: bool = False) -> tuple[Call, str]:
    """Signed in, a sandbox's request held by ask mode until its card is in the inbox
    (`chat`: an OpenAI chat call with the sandbox's token as its API key): the call and
    what the card says. The sandbox's token joins the secrets."""
    sign_in(browser, gw.admin, admin_token(gw))
    method = "POST" if chat else "GET"
    call = Call(gw, url, sandbox=sandbox, method=method, json=CHAT if chat else None,
                send_token=chat)
    secrets.append(call.token)
    parts = urlsplit(url)
    what = f"{method} {parts.hostname}:443{parts.path}"
    wait_for_approval(browser, what)
    return call, what



def _ended_within(sock: socket.socket, since: float, limit: float) -> None:
    """The gateway ended the tunnel on `sock` within `limit` seconds of `since`."""
    sock.settimeout(5)
    assert sock.recv(100) == b""
    assert time.monotonic() - since < limit

def test_sign_in_with_the_admin_token_and_the_session_cookie(gw: GatewayThread,
                                                             browser: WebDriver) -> None:
    open_page(browser, f"{gw.admin}/console/approvals")
    assert browser.current_url == f"{gw.admin}/console/login"  # signed out: to sign-in
    browser.find_element(By.ID, "token").send_keys("not-the-admin-token")
    click(browser, "Sign in")
    assert navigation_status(browser) == 401
    wait_for_text(browser, "That is not the admin token.")
    page_html(browser)
    assert browser.get_cookies() == []

    sign_in(browser, gw.admin, admin_token(gw))
    assert browser.current_url == f"{gw.admin}/console/approvals"
    assert browser.title == "Approvals · sandbox-gateway"
    wait_for_text(browser, "Nothing is waiting.")
    [cookie] = browser.get_cookies()
    assert cookie["name"] == "sgw_console" and cookie["path"] == "/console"
    assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # not for scripts

    click(browser, "Sign out")
    assert browser.current_url == f"{gw.admin}/console/login"
    assert browser.get_cookies() == []
    open_page(browser, f"{gw.admin}/console/grants")
    assert browser.current_url == f"{gw.admin}/console/login"


def test_a_held_request_approved_in_the_browser_completes(
        gw: GatewayThread, browser: WebDriver, upstream: Upstream, secrets: list[str]
        ) -> None:
    """The OpenAI call of a sandbox (its gateway token as the API key), on a rule that
    asks before it allows, waits in the inbox; approved once, it reaches the upstream with
    the real key swapped in and the client gets the upstream's answer."""
    call, what = _held(gw, browser, secrets, "https://api.openai.com/v1/chat/completions",
                       "sbx-approve", chat=True)
    assert what == "POST api.openai.com:443/v1/chat/completions"
    card = approval_card(browser, what)
    assert "Sandbox sbx-approve, policy agent" in card.text
    page_html(browser)
    assert call.answer is None and call.error is None  # still held
    answer_approval(browser, what, "approve", scope="once", note="fine for the demo")
    wait_for_text(browser, f"{what}: approved")
    answer = call.result()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "Hello"
    seen = [r for r in upstream.requests if r.path == "/v1/chat/completions"]
    assert seen and seen[-1].headers.get("authorization") == f"Bearer {KEY}"
    answered = table_row(browser, what)
    assert "approved (once)" in answered.text and "console" in answered.text
    assert "fine for the demo" in answered.text


def test_a_held_request_denied_in_the_browser_is_refused(
        gw: GatewayThread, browser: WebDriver, secrets: list[str]) -> None:
    call, what = _held(gw, browser, secrets, "https://allowed.test/console-deny", "sbx-deny")
    answer_approval(browser, what, "deny", note="not for this task")
    wait_for_text(browser, f"{what}: denied")
    refused = call.result()
    assert refused.status_code == 403 and refused.json()["error"] == "approval_denied"
    assert "not for this task" in refused.json()["reason"]


def test_a_grant_revoked_in_the_browser_closes_its_tunnel(gw: GatewayThread,
                                                          browser: WebDriver) -> None:
    sign_in(browser, gw.admin, admin_token(gw))
    sock = connect(gw, "unbound.test", "sbx-revoke")
    try:
        what = "unbound.test:443 (any request)"
        wait_for_approval(browser, what)
        answer_approval(browser, what, "approve", scope="policy", duration="1h")
        assert sock.recv(200).startswith(b"HTTP/1.1 200")
        click(browser, "Grants")
        page_html(browser)
        row = table_row(browser, what)
        assert "policy agent" in row.text and "console" in row.text
        revoked_at = time.monotonic()
        click(browser, "Revoke", within=row)
        wait_for_text(browser, "revoked: its tunnels close within a second")
        wait_for_text(browser, "No grants are in force.", reload=True)
        page_html(browser)
        _ended_within(sock, revoked_at, 2)
    finally:
        sock.close()
    assert admin_api(gw, "GET", "/v1/grants")["grants"] == []


def test_a_form_without_its_csrf_token_is_refused_and_answers_nothing(
        gw: GatewayThread, browser: WebDriver, secrets: list[str]) -> None:
    call, what = _held(gw, browser, secrets, "https://allowed.test/console-csrf", "sbx-csrf")
    for tamper in ("arguments[0].querySelector('input[name=csrf]').remove()",
                   "arguments[0].querySelector('input[name=csrf]').value = 'forged'"):
        for attempt in range(3):  # (the live page may re-render the card meanwhile)
            try:
                card = approval_card(browser, what)
                browser.execute_script(tamper, card)
                click(browser, "Approve", within=card)
                break
            except WebDriverException as exc:  # (a card replaced before the click)
                stale = isinstance(exc, StaleElementReferenceException) \
                    or "does not belong to the document" in str(exc)
                if attempt == 2 or not stale:
                    raise
        assert navigation_status(browser) == 403
        assert browser.title == "Refused · sandbox-gateway"
        wait_for_text(browser, "This form's CSRF token is missing or stale")
        page_html(browser)
        [still] = [a for a in admin_api(gw, "GET", "/v1/approvals")["approvals"]
                   if a["sandbox"] == "sbx-csrf"]
        assert still["state"] == "pending"
        assert call.answer is None and call.error is None
        open_page(browser, f"{gw.admin}/console/approvals")
    answer_approval(browser, what, "deny")  # (the page's own form still works)
    assert call.result().status_code == 403


def test_no_key_or_token_in_any_page(gw: GatewayThread, browser: WebDriver,
                                     secrets: list[str]) -> None:
    """Every page, with an ask from a sandbox that sent its token and a grant in force:
    neither the admin token, the sandbox's gateway JWT nor the upstream key is in it."""
    open_page(browser, f"{gw.admin}/console/login")
    call, what = _held(gw, browser, secrets, "https://api.openai.com/v1/chat/completions",
                       "sbx-secrets", chat=True)
    page_html(browser)
    answer_approval(browser, what, "approve", scope="sandbox", duration="10m")
    assert call.result().status_code == 200
    open_page(browser, f"{gw.admin}/console/grants")
    assert "sandbox sbx-secrets" in browser.find_element(By.TAG_NAME, "table").text
    open_page(browser, f"{gw.admin}/console/static/console.css")
    assert what in open_page(browser, f"{gw.admin}/console/approvals")  # (answered)
    click(browser, "Sign out")
    page_html(browser)
    pages = pages_seen(browser)
    assert len(pages) >= 7
    for url, html in pages:
        assert_no_secrets(html, [admin_token(gw), KEY, call.token], where=url)


def test_a_refused_request_appears_live_in_the_request_log(
        gw: GatewayThread, browser: WebDriver) -> None:
    """The request log open (its script following the live stream): a sandbox's refused
    CONNECT shows at the top without a reload; its line opens the decision, today's
    explain and what to change."""
    sign_in(browser, gw.admin, admin_token(gw))
    open_page(browser, f"{gw.admin}/console/requests?view=refused")
    wait_for_text(browser, "Live: new lines appear at the top.")
    sock = connect(gw, "blocked.test", "sbx-live")
    try:
        assert b" 403 " in sock.recv(500)
    finally:
        sock.close()
    wait_for_text(browser, "blocked.test:443")  # (no reload: the stream brought it)
    row = browser.find_element(By.CSS_SELECTOR, "#refused tbody tr.new")
    assert "sbx-live" in row.text and "policy_denied" in row.text
    page_html(browser)
    row.find_element(By.TAG_NAME, "a").click()
    wait_for_text(browser, "What to change")
    wait_for_text(browser, "not for agents")
    text = browser.find_element(By.TAG_NAME, "main").text
    assert ("sandbox-gateway policy explain --policy=agent -- CONNECT "
            "https://blocked.test:443") in text
    page_html(browser)


def test_a_token_revoked_in_the_browser_ends_its_tunnel(
        gw: GatewayThread, browser: WebDriver, secrets: list[str]) -> None:
    """A token issued through the admin API is listed on the sandboxes page; revoked
    there, its open tunnel ends within a second or two and it is refused after."""
    minted = admin_api(gw, "POST", "/v1/tokens", {"sandbox": "sbx-token", "policy": "agent"})
    secrets.append(minted["token"])
    proxy_host, proxy_port = gw.gateway.proxy_address  # type: ignore[misc]
    sock = open_tunnel((proxy_host, proxy_port), "allowed.test:443", minted["token"],
                       "sbx-token", timeout=10)
    try:
        sign_in(browser, gw.admin, admin_token(gw))
        open_page(browser, f"{gw.admin}/console/sandboxes")
        row = table_row(browser, minted["jti"])
        assert "sbx-token" in row.text and "agent" in row.text
        revoked_at = time.monotonic()
        click(browser, "Revoke", within=row)
        wait_for_text(browser, f"token {minted['jti']} revoked")
        page_html(browser)
        _ended_within(sock, revoked_at, 2.5)
    finally:
        sock.close()
    assert "revoked" in table_row(browser, minted["jti"]).text
    with pytest.raises(ConnectionRefusedError, match="407"):
        open_tunnel((proxy_host, proxy_port), "allowed.test:443", minted["token"],
                    "sbx-token", timeout=10)


def test_every_page_meets_wcag_21_aa(gw: GatewayThread, browser: WebDriver,
                                     secrets: list[str]) -> None:
    """axe-core in the browser finds no WCAG 2.1 A/AA violation on any console page: the
    sign-in page (and its error), the request log and a line, the inbox with an ask
    waiting, grants, usage, sandboxes, a learned policy."""
    open_page(browser, f"{gw.admin}/console/login")
    pages = {"sign-in": accessibility_violations(browser)}
    call, what = _held(gw, browser, secrets, "https://allowed.test/console-a11y", "sbx-a11y")
    pages["approvals"] = accessibility_violations(browser)
    for name, path in (("requests", "/console/requests"),
                       ("refused first", "/console/requests?view=refused"),
                       ("grants", "/console/grants"), ("usage", "/console/usage"),
                       ("sandboxes", "/console/sandboxes"),
                       ("learn", "/console/learn?policy=agent")):
        open_page(browser, gw.admin + path)
        pages[name] = accessibility_violations(browser)
    open_page(browser, f"{gw.admin}/console/requests")
    browser.find_element(By.CSS_SELECTOR, "#lines tbody tr a").click()
    wait_for_text(browser, "The policy today")
    pages["a line"] = accessibility_violations(browser)
    browser.execute_script("document.querySelector('main').insertAdjacentHTML('beforeend', "
                           "'<input name=unlabelled>')")  # (the check can fail)
    assert any(v.startswith("label:") for v in accessibility_violations(browser))
    open_page(browser, f"{gw.admin}/console/approvals")
    answer_approval(browser, what, "deny")
    assert call.result().status_code == 403
    assert {name: found for name, found in pages.items() if found} == {}
