"""`mcp.oauth` (issue 44) end to end with real pieces: the official MCP SDK's FastMCP
server requiring OAuth and the SDK's authorization-server routes over an in-memory
provider (helpers/mcp_oauth_server.py: dynamic registration, PKCE, resource indicators,
rotated refresh tokens, revocation), over TLS; the SDK's MCP client in its own virtualenv
holding no token, configured only by the environment a sandbox gets; the gateway's
approvals API read, and the consent completed as a browser would (the authorization URL
opened, its redirect followed to the gateway's callback). Both intercepting engines."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from helpers.approvals import Workers, admin_api
from helpers.gateway import GatewayThread
from helpers.mcp_sdk import SdkClients
from helpers.process import GatewayProcess, start_gateway
from helpers.python_clients import mcp_python
from helpers.tls import LocalCA
from selenium.webdriver.common.by import By

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
TTL = 3  # seconds an access token lives (refresh is tested on it)
POLICY = """
version: v1
name: agent
egress:
  - host: mcp.test
    mcp:
      tools: {allow: ["*"]}
      oauth: {}
  - host: other.test
    mcp:
      tools: {allow: ["*"]}
      oauth: {}
  - host: elsewhere.test
    inspect: true
"""
NARROW = """
version: v1
name: narrow
egress:
  - host: mcp.test
    mcp:
      tools: {allow: ["*"]}
      oauth: {scopes: [profile], consent: policy}
"""

SHARED = """
version: v1
name: shared
egress:
  - host: mcp.test
    mcp:
      tools: {allow: ["*"]}
      oauth: {consent: policy}
"""
HURRIED = """
version: v1
name: hurried
ask: {hosts: true, timeout: 2s, notify: [hook, slack]}
egress:
  - host: mcp.test
    mcp:
      tools: {allow: ["*"]}
      oauth: {consent: policy}
"""
PEOPLE = """
version: v1
name: people
egress:
  - host: mcp.test
    mcp:
      tools: {allow: ["*"]}
      oauth: {consent: user}
"""


class Hook:
    """A local HTTPS webhook receiver (the gateway's notifiers post to it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.got: list[tuple[str, dict[str, Any]]] = []  # (path, body)


@pytest.fixture(scope="module")
def hook(test_ca: LocalCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hook]:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    work = tmp_path_factory.mktemp("mcp-oauth-hook")
    found = Hook("")

    class Receiver(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return None

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            found.got.append((self.path, json.loads(body)))
            self.send_response(204)
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    server.socket = test_ca.server_context(work, ["localhost"]).wrap_socket(
        server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    found.url = f"https://localhost:{server.server_address[1]}"
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


class Server:
    def __init__(self, proc: subprocess.Popen[str], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        found = [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()]
        return [e for e in found if kind is None or e["event"] == kind]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(test_ca: LocalCA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("mcp-oauth-server")
    cert, key = test_ca.issue(work, ["mcp.test", "auth.test", "other.test",
                                     "elsewhere.test", "localhost"])
    port = _free_port()
    proc = subprocess.Popen([str(mcp_python()), str(HELPERS / "mcp_oauth_server.py"),
                             "127.0.0.1", str(port), str(cert), str(key),
                             str(work / "events.jsonl"), str(TTL)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "ready" in line, (proc.stderr.read() if proc.stderr else "")
    try:
        yield Server(proc, port, work / "events.jsonl")
    finally:
        proc.terminate()
        proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture(scope="module", params=["fast", "mitmproxy"])
def gateway(request: pytest.FixtureRequest, server: Server, test_ca: LocalCA, hook: Hook,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayThread]:
    work = tmp_path_factory.mktemp(f"mcp-oauth-gw-{request.param}")
    (work / "policies").mkdir()
    for name, text in (("agent", POLICY), ("narrow", NARROW), ("shared", SHARED),
                       ("hurried", HURRIED), ("people", PEOPLE)):
        (work / "policies" / f"{name}.yaml").write_text(text)
    names = ("mcp.test", "auth.test", "other.test", "elsewhere.test")
    gw = GatewayThread(work, {
        "network": {"upstream_ca": str(test_ca.cert_path), "intercept": request.param,
                    "resolve": {n: f"127.0.0.1:{server.port}" for n in names}},
        "secrets": {"store": "env"},
        "mcp_oauth": {"client_metadata_url": "https://gateway.test/oauth/client.json"},
        "approvals": {"notify": {"hook": {"url": f"{hook.url}/json"},
                                 "slack": {"url": f"{hook.url}/slack", "format": "slack"}}},
    })
    try:
        yield gw
    finally:
        gw.stop()


_SDK = SdkClients()  # (the module's one process, started by its first client)


@pytest.fixture(scope="module", autouse=True)
def _sdk() -> Iterator[None]:
    yield
    _SDK.close()


class Client:
    """The SDK's MCP client through the gateway (a session of the module's `SdkClients`),
    run while the test consents."""

    def __init__(self, gw: GatewayThread, steps: list[dict[str, Any]], sandbox: str,
                 policy: str = "agent", host: str = "mcp.test") -> None:
        token = gw.mint(policy, sandbox)
        self.env = {"HTTPS_PROXY": gw.proxy_url(token, sandbox), "SSL_CERT_FILE": str(gw.ca_cert)}
        self.url, self.steps = f"https://{host}/mcp", steps
        self.ident: int | None = None

    def start(self) -> None:
        self.ident = _SDK.ask(self.url, self.steps, self.env)

    def outcome(self, timeout: float = 90) -> dict[str, Any]:
        """The session's answer: its `results`, or the `error` that ended it."""
        assert self.ident is not None
        return _SDK.answer(self.ident, timeout)

    def result(self) -> list[dict[str, Any]]:
        answer = self.outcome()
        assert "results" in answer, answer.get("error")
        results: list[dict[str, Any]] = answer["results"]
        return results


def _consents(gw: GatewayThread | Workers, timeout: float = 20) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [a for a in admin_api(gw, "GET", "/v1/approvals")["approvals"]
                 if a["state"] == "pending" and a["asked"]["kind"] == "oauth"]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("no OAuth consent asked")


def _browse(server: Server, test_ca: LocalCA, url: str) -> httpx.Response:
    """What a person's browser does with a consent URL: open it at the authorization
    server (auth.test is this test's server), follow its redirect to the callback."""
    parts = urlsplit(url)
    assert parts.hostname == "auth.test", url
    local = urlunsplit(parts._replace(netloc=f"localhost:{server.port}"))
    verify = ssl.create_default_context(cafile=str(test_ca.cert_path))
    signed_in = httpx.get(local, verify=verify, timeout=10)
    assert signed_in.status_code in (302, 307), signed_in.text
    return httpx.get(signed_in.headers["location"], timeout=20)


def _consent(gw: GatewayThread, server: Server, test_ca: LocalCA) -> dict[str, Any]:
    """Consent to the one pending OAuth approval; the approval as it was. The callback's
    link works once: opened again (a reload, a replay) it is refused."""
    approval = _consents(gw)[0]
    done = _browse(server, test_ca, approval["consent"]["url"])
    assert done.status_code == 200 and "Consent completed" in done.text, done.text
    again = httpx.get(done.request.url, timeout=10)
    assert again.status_code == 400 and "already used" in again.text
    return approval


def test_an_agent_lists_and_calls_tools_after_one_consent(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    sandbox = f"oauth-{gateway.config.network.intercept}"
    client = Client(gateway, [{"list_tools": True},
                              {"call": "search_issues", "arguments": {"query": "flaky"}},
                              {"call": "whoami"}], sandbox)
    client.start()
    approval = _consent(gateway, server, test_ca)
    results = client.result()
    assert results[0] == {"tools": ["search_issues", "whoami"]}
    assert results[1] == {"is_error": False, "text": "found 2 issues for flaky"}
    assert results[2]["text"].startswith("client ")
    # What was asked: PKCE S256, the resource indicator, the scopes the server names.
    consent = approval["consent"]
    assert approval["sandbox"] == sandbox and consent["owner"] == f"sandbox:{sandbox}"
    assert consent["resource"] == "https://mcp.test/mcp" and consent["scopes"] == ["mcp"]
    query = dict(x.split("=", 1) for x in urlsplit(consent["url"]).query.split("&"))
    assert query["code_challenge_method"] == "S256" and query["resource"] == \
        "https%3A%2F%2Fmcp.test%2Fmcp"
    # The server saw one token, issued for its resource; the client never held it.
    issued = [e for e in server.events("token") if e["resource"] == "https://mcp.test/mcp"]
    used = {e["access"] for e in server.events("call") if e.get("access")}
    assert used and used <= {e["access"] for e in server.events("token")} | \
        {e["access"] for e in server.events("refresh")}
    assert issued
    # The grant is listed (no token), the audit lines name it (never the token).
    grants = admin_api(gateway, "GET", "/v1/mcp/oauth/grants")["grants"]
    mine = [g for g in grants if g["owner"] == f"sandbox:{sandbox}"]
    assert len(mine) == 1 and mine[0]["scopes"] == ["mcp"]
    assert "access" not in json.dumps(grants) and not any(t in json.dumps(grants)
                                                         for t in used)
    lines = gateway.audit.records()
    assert any(r["credential"] == f"mcp-oauth:{mine[0]['id']} (sandbox:{sandbox})"
               and r["host"] == "mcp.test" and r["decision"] == "allow" for r in lines)
    assert any(r["decision"] == "grant" and mine[0]["id"] in r["reason"] for r in lines)
    assert not any(t in json.dumps(lines) for t in used)
    # The SDK's authorization server advertises no client ID metadata documents: the
    # gateway registered itself (RFC 7591), its redirect URI the callback; the document
    # it would use is served, public.
    callback = f"{gateway.admin}/v1/mcp/oauth/callback"
    assert any(e["redirect_uris"] == [callback] for e in server.events("register"))
    document = httpx.get(f"{gateway.admin}/v1/mcp/oauth/client-metadata", timeout=10).json()
    assert document["client_id"] == "https://gateway.test/oauth/client.json"
    assert document["redirect_uris"] == [callback]
    assert document["token_endpoint_auth_method"] == "none"
    forged = httpx.get(f"{gateway.admin}/v1/mcp/oauth/callback?state=made-up&code=x",
                       timeout=10)
    assert forged.status_code == 400 and "unknown" in forged.text


INITIALIZE = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {},
    "clientInfo": {"name": "raw", "version": "1"}}})


def _post(gw: GatewayThread, sandbox: str, url: str = "https://mcp.test/mcp",
          headers: dict[str, str] | None = None, body: str = INITIALIZE,
          policy: str = "agent", user: str | None = None) -> httpx.Response:
    """A raw MCP POST through the gateway (no SDK), as `sandbox` (its token naming
    `user`, if given)."""
    token = gw.mint(policy, sandbox, **({"user": user} if user else {}))
    verify = ssl.create_default_context(cafile=str(gw.ca_cert))
    with httpx.Client(proxy=gw.proxy_url(token, sandbox), verify=verify, timeout=60) as c:
        return c.post(url, content=body, headers={
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream", **(headers or {})})


def _granted(gw: GatewayThread, server: Server, test_ca: LocalCA, sandbox: str) -> str:
    """`sandbox` gets a grant (one consent) and uses it; its access token, as the
    server saw it."""
    client = Client(gw, [{"call": "whoami"}], sandbox)
    client.start()
    _consent(gw, server, test_ca)
    assert client.result()[0]["text"].startswith("client ")
    return str(server.events("call")[-1]["access"])


def _grant_of(gw: GatewayThread, owner: str) -> dict[str, Any]:
    found = [g for g in admin_api(gw, "GET", "/v1/mcp/oauth/grants")["grants"]
             if g["owner"] == owner]
    assert len(found) == 1, found
    return found[0]


def test_the_token_is_refreshed_before_it_expires(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    sandbox = f"refresh-{gateway.config.network.intercept}"
    first = _granted(gateway, server, test_ca, sandbox)
    refreshed = len(server.events("refresh"))
    time.sleep(TTL + 0.5)  # (the access token has expired at the server)
    again = Client(gateway, [{"call": "whoami"}], sandbox)
    again.start()
    assert again.result()[0]["text"].startswith("client ")  # (no consent asked)
    second = str(server.events("call")[-1]["access"])
    assert second != first and len(server.events("refresh")) == refreshed + 1
    assert _grant_of(gateway, f"sandbox:{sandbox}")["expires_at"] > time.time()


def test_a_token_the_server_refuses_is_refreshed_on_the_retry(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    """The server answers the gateway's token 401 (its authorization server forgot it):
    the agent is answered mcp_consent_required, not the 401; its retry refreshes the
    grant and goes through, no person asked."""
    sandbox = f"refused-{gateway.config.network.intercept}"
    before = _granted(gateway, server, test_ca, sandbox)
    verify = ssl.create_default_context(cafile=str(test_ca.cert_path))
    for _ in range(3):
        refreshes = len(server.events("refresh"))
        assert httpx.post(f"https://localhost:{server.port}/test/forget-access",
                          verify=verify, timeout=10).status_code == 204
        # (on either engine: refused at the answer's head, the refusal goes in its place,
        # through mitmproxy's own TLS on the mitmproxy engine)
        refused = _post(gateway, sandbox)
        if refused.status_code != 200 or len(server.events("refresh")) == refreshes:
            break
        # (the server's tokens live 3 s: on a loaded machine the grant came due and was
        # refreshed before the request was sent, so no refused token reached the server)
    assert refused.status_code == 403, refused.text
    assert refused.headers["x-sandbox-gateway-error"] == "mcp_consent_required"
    assert "refused the token of MCP OAuth grant og_" in refused.json()["reason"]
    assert before not in refused.text
    assert gateway.audit.wait_for(lambda r: r["sandbox"] == sandbox and
                                  r["error"] == "mcp_consent_required")
    refreshed = len(server.events("refresh"))
    again = Client(gateway, [{"call": "whoami"}], sandbox)
    again.start()
    assert again.result()[0]["text"].startswith("client ")
    assert len(server.events("refresh")) == refreshed + 1
    assert not [a for a in admin_api(gateway, "GET", "/v1/approvals")["approvals"]
                if a["state"] == "pending"]


def test_a_token_the_sandbox_presents_is_refused(gateway: GatewayThread,
                                                 server: Server) -> None:
    before = len(server.events())
    answer = _post(gateway, "smuggler", headers={"Authorization": "Bearer mine-own-token"})
    assert answer.status_code == 403
    assert answer.headers["x-sandbox-gateway-error"] == "mcp_token_refused"
    assert "Authorization" in answer.json()["reason"]
    assert len(server.events()) == before  # (nothing reached the server)


def test_a_token_goes_only_to_the_resource_it_was_issued_for(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    """other.test reaches the same server, whose metadata names mcp.test as its
    resource: no token is asked for it (nor the mcp.test token sent there)."""
    sandbox = f"audience-{gateway.config.network.intercept}"
    _granted(gateway, server, test_ca, sandbox)
    answer = _post(gateway, sandbox, url="https://other.test/mcp")
    assert answer.status_code == 502, answer.text
    assert answer.headers["x-sandbox-gateway-error"] == "mcp_oauth_failed"
    assert "names resource 'https://mcp.test/mcp', not this server" in answer.json()["reason"]
    assert not [a for a in admin_api(gateway, "GET", "/v1/approvals")["approvals"]
                if a["state"] == "pending"]


def test_the_token_is_a_leak_marker_everywhere_else(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    sandbox = f"leak-{gateway.config.network.intercept}"
    token = _granted(gateway, server, test_ca, sandbox)
    answer = _post(gateway, sandbox, url="https://elsewhere.test/upload",
                   body=json.dumps({"stolen": token}))
    assert answer.status_code == 403
    assert answer.headers["x-sandbox-gateway-error"] == "exfiltration_blocked"


def test_a_revoked_grant_asks_again(gateway: GatewayThread, server: Server,
                                    test_ca: LocalCA) -> None:
    sandbox = f"revoke-{gateway.config.network.intercept}"
    _granted(gateway, server, test_ca, sandbox)
    grant = _grant_of(gateway, f"sandbox:{sandbox}")
    revoked = len(server.events("revoke"))
    gone = admin_api(gateway, "DELETE", f"/v1/mcp/oauth/grants/{grant['id']}", {"by": "ops"})
    assert gone == {"revoked": grant["id"]}
    assert len(server.events("revoke")) == revoked + 2  # (refresh and access tokens)
    assert any(r["decision"] == "revoke" and grant["id"] in r["reason"] and "by ops" in
               r["reason"] for r in gateway.audit.records())
    _granted(gateway, server, test_ca, sandbox)  # (asked again, and granted)
    assert _grant_of(gateway, f"sandbox:{sandbox}")["id"] != grant["id"]


def _hold(gw: GatewayThread | Workers, who: list[tuple[str, str]]
          ) -> tuple[list[threading.Thread], dict[int, httpx.Response]]:
    """One raw MCP request per (sandbox, policy) in `who`, each in its own thread (held
    for a consent); their answers by index once they end."""
    answers: dict[int, httpx.Response] = {}

    def run(i: int, sandbox: str, policy: str) -> None:
        answers[i] = _post(gw, sandbox, policy=policy)  # type: ignore[arg-type]

    threads = [threading.Thread(target=run, args=(i, s, p), daemon=True)
               for i, (s, p) in enumerate(who)]
    for thread in threads:
        thread.start()
    return threads, answers


def _pending_of(gw: GatewayThread | Workers, owner: str) -> list[dict[str, Any]]:
    """The pending consents for `owner`, once every request held meanwhile had time to
    open its own (the bug these tests guard against) or join the first."""
    _consents(gw)
    time.sleep(1.5)
    return [a for a in admin_api(gw, "GET", "/v1/approvals")["approvals"]
            if a["state"] == "pending" and a["asked"]["kind"] == "oauth"
            and a["consent"]["owner"] == owner]


def test_requests_held_at_once_share_one_consent(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    """Two sandboxes of a `consent: policy` rule, and two requests of one sandbox of a
    `consent: sandbox` rule, held at once: one approval per grant, and every held
    request goes on when it is completed (none left pending)."""
    engine = gateway.config.network.intercept
    twice = f"twice-{engine}"
    threads, answers = _hold(gateway, [(f"shared-a-{engine}", "shared"),
                                       (f"shared-b-{engine}", "shared"),
                                       (twice, "agent"), (twice, "agent")])
    [policy_wide] = _pending_of(gateway, "policy:shared")
    [own] = _pending_of(gateway, f"sandbox:{twice}")
    for approval in (policy_wide, own):
        assert _browse(server, test_ca, approval["consent"]["url"]).status_code == 200
    for thread in threads:
        thread.join(60)
    assert sorted(a.status_code for a in answers.values()) == [200] * 4, \
        [a.text for a in answers.values()]
    left = [a for a in admin_api(gateway, "GET", "/v1/approvals")["approvals"]
            if a["state"] == "pending" and a["asked"]["kind"] == "oauth"]
    assert not [a for a in left if a["consent"]["owner"] in ("policy:shared",
                                                              f"sandbox:{twice}")]
    assert _grant_of(gateway, "policy:shared")["owner"] == "policy:shared"


def test_a_consent_no_one_completes_times_out_with_the_policys_ask_timeout(
        gateway: GatewayThread, server: Server, test_ca: LocalCA, hook: Hook) -> None:
    """The policy's `ask: {timeout: 2s, notify: [...]}`: the one consent two sandboxes
    wait on is told to the notifiers (its URL to open, never a token, code or client
    secret) and expires after 2 s; both held requests answer approval_timeout naming
    it; its link, opened later, grants nothing."""
    engine = gateway.config.network.intercept
    started = time.monotonic()
    threads, answers = _hold(gateway, [(f"late-a-{engine}", "hurried"),
                                       (f"late-b-{engine}", "hurried")])
    for thread in threads:
        thread.join(60)
    waited = time.monotonic() - started
    assert 2 <= waited < 30, waited
    [first, second] = answers.values()
    assert first.status_code == second.status_code == 403, first.text
    assert first.headers["x-sandbox-gateway-error"] == "approval_timeout"
    assert first.json()["reason"] == second.json()["reason"]
    assert "within 2s" in first.json()["reason"]
    ident = first.json()["reason"].split("approval ")[1].split()[0]
    expired = next(a for a in admin_api(gateway, "GET", "/v1/approvals")["approvals"]
                   if a["id"] == ident)
    assert expired["state"] == "timeout" and expired["consent"]["owner"] == "policy:hurried"
    assert len([r for r in gateway.audit.records() if r["decision"] == "timeout"
                and ident in r["reason"]]) == 1
    # The notifiers: one notification each, for the one approval, carrying its URL.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(_told(hook, ident)) < 2:
        time.sleep(0.05)
    told = _told(hook, ident)
    assert sorted(path for path, _ in told) == ["/json", "/slack"], told
    url = expired["consent"]["url"]
    doc = next(body for path, body in told if path == "/json")
    assert doc["answer"]["open"] == url and doc["approval"]["consent"]["url"] == url
    slack = next(body for path, body in told if path == "/slack")["text"]
    assert f"<{url.replace('&', '&amp;')}|open this link and sign in>" in slack
    # Opened after it expired: the authorization server signs in, the callback refuses.
    late = _browse(server, test_ca, url)
    assert late.status_code == 400 and "expired" in late.text
    assert not [g for g in admin_api(gateway, "GET", "/v1/mcp/oauth/grants")["grants"]
                if g["owner"] == "policy:hurried"]
    _no_secrets_told(hook, server)


def _told(hook: Hook, ident: str) -> list[tuple[str, dict[str, Any]]]:
    return [(path, body) for path, body in list(hook.got) if ident in json.dumps(body)]


def _no_secrets_told(hook: Hook, server: Server) -> None:
    """No token, code or client secret the servers issued is in any notification."""
    told = json.dumps(hook.got)
    issued = [str(e[k]) for e in server.events() for k in ("access", "refresh", "code",
                                                          "secret") if e.get(k)]
    assert issued and not [t for t in issued if t in told]


def test_a_declined_consent_refuses_the_request(gateway: GatewayThread) -> None:
    """Declined: every request held on the consent (two of one sandbox) is refused
    with the same answer."""
    sandbox = f"declined-{gateway.config.network.intercept}"
    threads, answers = _hold(gateway, [(sandbox, "agent"), (sandbox, "agent")])
    approval = next(a for a in _consents(gateway) if a["sandbox"] == sandbox)
    refused = httpx.post(f"{gateway.admin}/v1/approvals/{approval['id']}",
                         json={"decision": "approve"}, timeout=10, headers={
                             "Authorization": "Bearer " + (gateway.config.certs /
                                                           "admin-token").read_text().strip()})
    assert refused.status_code == 400 and "authorization URL" in refused.json()["reason"]
    time.sleep(1)  # (the second request joins the approval)
    admin_api(gateway, "POST", f"/v1/approvals/{approval['id']}",
              {"decision": "deny", "by": "alice", "note": "not this one"})
    for thread in threads:
        thread.join(30)
    [first, second] = answers.values()
    assert first.status_code == second.status_code == 403
    assert first.headers["x-sandbox-gateway-error"] == "approval_denied"
    assert first.json()["reason"] == second.json()["reason"]
    assert approval["id"] in first.json()["reason"] and "alice" in first.json()["reason"]


def test_insufficient_scope_goes_back_to_consent(gateway: GatewayThread, server: Server,
                                                 test_ca: LocalCA) -> None:
    """A policy asks for scope profile only (consent per policy); the server needs mcp:
    its 403 insufficient_scope is answered mcp_consent_required, and the retry asks a
    person again for the union of the scopes; then the calls go through."""
    sandbox = f"stepup-{gateway.config.network.intercept}"
    first = Client(gateway, [{"call": "whoami"}], sandbox, policy="narrow")
    first.start()
    asked = _consent(gateway, server, test_ca)
    assert asked["consent"]["scopes"] == ["profile"]
    assert "results" not in first.outcome(60)  # (initialize was refused: the SDK client stops)
    assert any(r["error"] == "mcp_consent_required" and r["policy"] == "narrow"
               for r in gateway.audit.records())
    again = Client(gateway, [{"call": "whoami"}], sandbox, policy="narrow")
    again.start()
    stepped = _consent(gateway, server, test_ca)
    assert stepped["consent"]["scopes"] == ["profile", "mcp"]
    assert again.result()[0]["text"].startswith("client ")
    assert _grant_of(gateway, "policy:narrow")["scopes"] == ["profile", "mcp"]


def test_consent_per_user_serves_every_sandbox_of_that_user(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    """`consent: user`: alice's consent serves another sandbox whose token names alice,
    not bob's (asked for himself); a token naming no user is refused, unsent."""
    engine = gateway.config.network.intercept
    held: list[httpx.Response] = []
    first = threading.Thread(target=lambda: held.append(
        _post(gateway, f"alice-1-{engine}", policy="people", user="alice")))
    first.start()
    [asked] = _pending_of(gateway, "user:alice")
    assert asked["sandbox"] == f"alice-1-{engine}"
    assert _browse(server, test_ca, asked["consent"]["url"]).status_code == 200
    first.join(60)
    assert held[0].status_code == 200, held[0].text
    grant = _grant_of(gateway, "user:alice")
    again = _post(gateway, f"alice-2-{engine}", policy="people", user="alice")
    assert again.status_code == 200, again.text  # (another sandbox: no consent asked)
    assert not _pending_oauth(gateway, "user:alice")
    assert any(r["sandbox"] == f"alice-2-{engine}" and r["credential"] ==
               f"mcp-oauth:{grant['id']} (user:alice)" for r in gateway.audit.records())
    before = len(server.events())
    nobody = _post(gateway, f"nobody-{engine}", policy="people")
    assert nobody.status_code == 403
    assert nobody.headers["x-sandbox-gateway-error"] == "mcp_user_required"
    assert "--user NAME" in nobody.json()["reason"]
    assert len(server.events()) == before  # (nothing reached the servers)
    bob: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: bob.append(
        _post(gateway, f"bob-{engine}", policy="people", user="bob")))
    asking.start()
    [his] = _pending_of(gateway, "user:bob")
    admin_api(gateway, "POST", f"/v1/approvals/{his['id']}", {"decision": "deny",
                                                               "by": "bob"})
    asking.join(30)
    assert bob[0].headers["x-sandbox-gateway-error"] == "approval_denied"


def _pending_oauth(gw: GatewayThread, owner: str) -> list[dict[str, Any]]:
    return [a for a in admin_api(gw, "GET", "/v1/approvals")["approvals"]
            if a["state"] == "pending" and a["asked"]["kind"] == "oauth"
            and a["consent"]["owner"] == owner]


def _cli(gw: GatewayThread, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args, "--admin", gw.admin,
                           "--config", str(gw.config.source)],
                          capture_output=True, text=True, timeout=60)


def test_the_cli_shows_the_consent_url_lists_and_revokes(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    sandbox = f"cli-{gateway.config.network.intercept}"
    client = Client(gateway, [{"call": "whoami"}], sandbox)
    client.start()
    approval = _consents(gateway)[0]
    listed = _cli(gateway, "approvals", "list")
    assert listed.returncode == 0, listed.stderr
    assert f"open and sign in: {approval['consent']['url']}" in listed.stdout
    assert "OAuth consent for the MCP server mcp.test:443/mcp" in listed.stdout
    assert _browse(server, test_ca, approval["consent"]["url"]).status_code == 200
    assert client.result()[0]["text"].startswith("client ")
    grant = _grant_of(gateway, f"sandbox:{sandbox}")
    grants = _cli(gateway, "mcp-oauth", "list")
    assert grants.returncode == 0, grants.stderr
    assert f"{grant['id']}  sandbox:{sandbox}  https://mcp.test/mcp  scopes mcp" in \
        grants.stdout
    assert "issuer https://auth.test" in grants.stdout
    token = str(server.events("call")[-1]["access"])
    assert token not in grants.stdout and token not in _cli(
        gateway, "mcp-oauth", "list", "--json").stdout
    out = _cli(gateway, "mcp-oauth", "revoke", grant["id"], "--by", "erin")
    assert out.returncode == 0 and f"revoked {grant['id']}" in out.stdout
    assert grant["id"] not in _cli(gateway, "mcp-oauth", "list").stdout
    gone = _cli(gateway, "mcp-oauth", "revoke", grant["id"])
    assert gone.returncode == 1 and "no MCP OAuth grant" in gone.stderr


def test_consent_and_revocation_in_the_console_with_chromium(
        gateway: GatewayThread, server: Server, test_ca: LocalCA) -> None:
    """A person signs in to the console, opens the consent's link in Chromium (auth.test
    mapped to the test's authorization server; its certificate is the test CA's, which
    this profile cannot trust, hence --ignore-certificate-errors: the gateway's own TLS
    checks are tested above), is sent back to the gateway's callback, and the agent's
    held call goes on; then the grant is revoked from the MCP OAuth page."""
    from helpers.approvals import admin_token
    from helpers.browser import (
        assert_no_secrets,
        click,
        open_page,
        pages_seen,
        sign_in,
        start_browser,
        stop_browser,
        wait_for_text,
    )

    sandbox = f"console-{gateway.config.network.intercept}"
    client = Client(gateway, [{"call": "whoami"}], sandbox)
    client.start()
    _consents(gateway)
    browser = start_browser([f"--host-resolver-rules=MAP auth.test 127.0.0.1:{server.port}",
                             "--ignore-certificate-errors"])
    try:
        sign_in(browser, gateway.admin, admin_token(gateway))
        open_page(browser, f"{gateway.admin}/console/approvals")
        wait_for_text(browser, "OAuth consent for the MCP server mcp.test:443/mcp")
        link = browser.find_element(By.CLASS_NAME, "consent").get_attribute("href")
        assert link and link.startswith("https://auth.test/authorize?")
        open_page(browser, link)  # (the authorization server sends the browser back)
        wait_for_text(browser, "Consent completed")
        assert browser.current_url.startswith(f"{gateway.admin}/v1/mcp/oauth/callback?")
        assert client.result()[0]["text"].startswith("client ")
        grant = _grant_of(gateway, f"sandbox:{sandbox}")
        open_page(browser, f"{gateway.admin}/console/mcp-oauth")
        wait_for_text(browser, f"sandbox:{sandbox}")
        row = browser.find_element(By.XPATH, f"//tr[td[normalize-space()='sandbox:{sandbox}']]")
        click(browser, "Revoke", within=row)
        wait_for_text(browser, f"MCP OAuth grant {grant['id']} revoked")
        tokens = [str(e["access"]) for e in server.events("token")]
        for url, html in pages_seen(browser):
            assert_no_secrets(html, tokens, url)
    finally:
        stop_browser(browser)
    assert all(g["id"] != grant["id"]
               for g in admin_api(gateway, "GET", "/v1/mcp/oauth/grants")["grants"])


class WorkersClient(Client):
    """The SDK's client through `run --workers N` (a gateway process)."""

    def __init__(self, process: GatewayProcess, steps: list[dict[str, Any]],
                 sandbox: str) -> None:
        token = process.token(sandbox)
        self.env = {"HTTPS_PROXY": f"http://{sandbox}:{token}@127.0.0.1:{process.proxy}",
                    "SSL_CERT_FILE": str(process.workdir / "certs" / "ca.crt")}
        self.url, self.steps = "https://mcp.test/mcp", steps
        self.ident = None


def test_replicas_with_the_key_in_the_secret_store_open_each_others_grants(
        server: Server, test_ca: LocalCA, tmp_path: Path) -> None:
    """`mcp_oauth.key_secret`: two replicas (each its own certs folder and signing key)
    on one state store read the sealing key from the secret store, so a grant one sealed
    serves the other without asking again; a replica with a key file of its own cannot
    open it and asks for consent."""
    names = dict.fromkeys(("mcp.test", "auth.test"), server.port)
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text(f"mcp-oauth-key: {base64.b64encode(os.urandom(32)).decode()}\n")
    secrets_file.chmod(0o600)
    store = {"store": "sqlite", "path": str(tmp_path / "shared" / "gateway.db")}
    shared = {"secrets": {"store": "file", "path": str(secrets_file)}, "state": store,
              "mcp_oauth": {"key_secret": "mcp-oauth-key"}}
    first = start_gateway(tmp_path / "a", names, test_ca, policy=POLICY, extra=shared)
    try:
        client = WorkersClient(first, [{"call": "whoami"}], "replica-sbx")
        client.start()
        approval = _consents(Workers(first, test_ca))[0]
        assert _browse(server, test_ca, approval["consent"]["url"]).status_code == 200
        assert client.result()[0]["text"].startswith("client ")
    finally:
        first.stop()
    exchanged = len(server.events("token"))
    second = start_gateway(tmp_path / "b", names, test_ca, policy=POLICY, extra=shared)
    try:
        again = WorkersClient(second, [{"call": "whoami"}], "replica-sbx")
        again.start()
        assert again.result()[0]["text"].startswith("client ")
        assert len(server.events("token")) == exchanged  # (no consent, no new token)
    finally:
        second.stop()
    own_key = start_gateway(tmp_path / "c", names, test_ca, policy=POLICY,
                            extra={**shared, "mcp_oauth": {}})
    try:
        WorkersClient(own_key, [{"call": "whoami"}], "replica-sbx").start()
        assert _consents(Workers(own_key, test_ca))  # (its key opens no grant: asked again)
    finally:
        own_key.stop()


@pytest.mark.parametrize(("oauth", "secret", "said"), [
    ({"key_secret": "absent"}, None, "mcp_oauth.key_secret: "),
    ({"key_secret": "short"}, "c2hvcnQ=", "does not hold a 32-byte key as base64 or hex"),
    ({"key_secret": "short", "key_file": "k"}, "c2hvcnQ=", "keep one"),
])
def test_a_gateway_without_its_sealing_key_does_not_start(
        tmp_path: Path, test_ca: LocalCA, oauth: dict[str, str], secret: str | None,
        said: str) -> None:
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text("other: x\n" + (f"short: {secret}\n" if secret else ""))
    secrets_file.chmod(0o600)
    process = start_gateway(tmp_path / "gw", {}, test_ca, policy=POLICY, wait=False, extra={
        "secrets": {"store": "file", "path": str(secrets_file)}, "mcp_oauth": oauth})
    try:
        assert process.proc.wait(60) != 0
        assert said in process.stderr()
        assert secret is None or secret not in process.stderr()
    finally:
        process.stop()


def test_two_workers_share_the_grant_and_a_restart_keeps_it(
        server: Server, test_ca: LocalCA, tmp_path: Path) -> None:
    """`run --workers 2` on the SQLite store: one consent serves every worker (the
    callback may land on either); after a restart the grant (sealed in the store, the
    key in certs/) is used again without asking."""
    names = dict.fromkeys(("mcp.test", "auth.test"), server.port)
    process = start_gateway(tmp_path, names, test_ca, workers=2, policy=POLICY)
    gw = Workers(process, test_ca)
    try:
        first = WorkersClient(process, [{"call": "whoami"}], "workers-sbx")
        first.start()
        approval = _consents(gw)[0]
        assert _browse(server, test_ca, approval["consent"]["url"]).status_code == 200
        assert first.result()[0]["text"].startswith("client ")
        exchanged = len(server.events("token"))
        seen: set[int] = set()
        for _ in range(12):  # (new connections: the kernel spreads them over the workers)
            run = WorkersClient(process, [{"call": "whoami"}], "workers-sbx")
            run.start()
            assert run.result()[0]["text"].startswith("client ")
            seen |= {r["worker"] for r in process.audit_lines()
                     if str(r.get("credential", "")).startswith("mcp-oauth:")}
            if seen == {0, 1}:
                break
        assert seen == {0, 1}
        assert len(server.events("token")) == exchanged  # (no second consent)
    finally:
        process.stop()
    restarted = start_gateway(tmp_path, names, test_ca, workers=2, policy=POLICY)
    try:
        again = WorkersClient(restarted, [{"call": "whoami"}], "workers-sbx")
        again.start()
        assert again.result()[0]["text"].startswith("client ")
        assert len(server.events("token")) == exchanged
        assert not [a for a in admin_api(Workers(restarted, test_ca), "GET",
                                          "/v1/approvals")["approvals"]
                    if a["state"] == "pending"]
    finally:
        restarted.stop()


REDIS_POLICY = SHARED.replace("name: shared", "name: agent")


def test_on_redis_two_workers_share_one_consent_refresh_once_and_revoke(
        server: Server, test_ca: LocalCA, tmp_path: Path) -> None:
    """`state.store: redis` under `run --workers 2`: twelve sandboxes of a `consent:
    policy` rule held at once, spread over both workers, make one registration, wait on
    one approval and all go on when it is completed; once the token has expired, six
    requests at once are served by one refresh (the lease, held in redis); a revoked
    grant is used by no worker: every request after it waits on one new consent, whose
    decline answers them all; a consent pending across a restart still completes."""
    from helpers.redis_server import running_redis

    names = dict.fromkeys(("mcp.test", "auth.test"), server.port)
    for redis in running_redis(tmp_path / "redis"):
        process = start_gateway(tmp_path / "gw", names, test_ca, workers=2,
                                policy=REDIS_POLICY, extra={"state": {
                                    "store": "redis", "url": redis.url, "prefix": "oauth"}})
        gw = Workers(process, test_ca)
        try:
            registered = len(server.events("register"))
            held = [(f"redis-{i}", "agent") for i in range(12)]
            threads, answers = _hold(gw, held)
            [approval] = _pending_of(gw, "policy:agent")
            assert _browse(server, test_ca, approval["consent"]["url"]).status_code == 200
            for thread in threads:
                thread.join(60)
            assert [answers[i].status_code for i in range(12)] == [200] * 12
            lines = process.audit_lines_until(
                lambda r: str(r.get("credential", "")).startswith("mcp-oauth:"),
                lambda lines: {r["worker"] for r in lines} == {0, 1})
            assert {r["worker"] for r in lines} == {0, 1}  # (held on both workers)
            # (one registration at the authorization server, not one per held request)
            assert len(server.events("register")) == registered + 1
            grant = admin_api(gw, "GET", "/v1/mcp/oauth/grants")["grants"]
            assert [g["owner"] for g in grant] == ["policy:agent"]
            # Refresh: the token has expired; six requests at once, one refresh.
            refreshed = len(server.events("refresh"))
            time.sleep(TTL + 0.5)
            threads, answers = _hold(gw, [(f"later-{i}", "agent") for i in range(6)])
            for thread in threads:
                thread.join(60)
            assert [answers[i].status_code for i in range(6)] == [200] * 6, \
                [a.text for a in answers.values()]
            assert len(server.events("refresh")) == refreshed + 1
            # Revoke on one worker: no worker sends the grant's tokens again.
            revoked = len(server.events("revoke"))
            assert admin_api(gw, "DELETE", f"/v1/mcp/oauth/grants/{grant[0]['id']}",
                             {"by": "ops"}) == {"revoked": grant[0]["id"]}
            assert len(server.events("revoke")) == revoked + 2
            verified = len(server.events("verify"))
            threads, answers = _hold(gw, [(f"after-{i}", "agent") for i in range(6)])
            [again] = _pending_of(gw, "policy:agent")
            admin_api(gw, "POST", f"/v1/approvals/{again['id']}",
                      {"decision": "deny", "by": "ops"})
            for thread in threads:
                thread.join(60)
            assert {answers[i].headers.get("x-sandbox-gateway-error") for i in range(6)} == \
                {"approval_denied"}
            assert len(server.events("verify")) == verified  # (no token presented)
            # A restart while a consent is pending: the request held before it is cut
            # off; its retry, on the new process, waits on the same approval, whose link
            # (its flow sealed in redis) still completes it.
            cut: list[BaseException | httpx.Response] = []
            before = threading.Thread(target=lambda c, g: c.append(_attempt(g, "restart-1")),
                                      args=(cut, gw))
            before.start()
            [pending] = _pending_of(gw, "policy:agent")
        finally:
            process.stop()
        before.join(30)
        assert cut and not isinstance(cut[0], httpx.Response)
        process = start_gateway(tmp_path / "gw", names, test_ca, workers=2,
                                policy=REDIS_POLICY, admin=process.admin, extra={"state": {
                                    "store": "redis", "url": redis.url, "prefix": "oauth"}})
        # (on the same admin port: the consent's callback URL, mcp_oauth.redirect_url's)
        gw = Workers(process, test_ca)
        try:
            threads, answers = _hold(gw, [("restart-2", "agent")])
            assert [a["id"] for a in _pending_of(gw, "policy:agent")] == [pending["id"]]
            assert _browse(server, test_ca, pending["consent"]["url"]).status_code == 200
            threads[0].join(60)
            assert answers[0].status_code == 200, answers[0].text
        finally:
            process.stop()


def test_a_consent_that_cannot_reach_redis_is_refused_503_state_unavailable(
        server: Server, test_ca: LocalCA, tmp_path: Path) -> None:
    """redis-server stopped (SIGSTOP) under `state.unavailable: serve`: a request that
    needs its grant read is refused `503 state_unavailable` with `Retry-After: 5` once
    the read times out (measured before: `500 gateway_error` and a traceback), without
    Redis's address in the answer; when Redis answers again, the consent is asked."""
    import signal

    from helpers.redis_server import running_redis

    names = dict.fromkeys(("mcp.test", "auth.test"), server.port)
    for redis in running_redis(tmp_path / "redis"):
        log = tmp_path / "gw.log"
        process = start_gateway(tmp_path / "gw", names, test_ca, policy=REDIS_POLICY,
                                log=log, extra={"state": {
                                    "store": "redis", "url": redis.url, "prefix": "oauth"}})
        gw = Workers(process, test_ca)
        try:
            token = gw.mint("agent", "stalled-1")
            verify = ssl.create_default_context(cafile=str(gw.ca_cert))
            with httpx.Client(proxy=gw.proxy_url(token, "stalled-1"), verify=verify,
                              timeout=30) as client:
                assert redis.process is not None
                os.kill(redis.process.pid, signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    answer = client.post("https://mcp.test/mcp", content=INITIALIZE,
                                         headers={"Content-Type": "application/json"})
                    took = time.monotonic() - started
                finally:
                    os.kill(redis.process.pid, signal.SIGCONT)
            assert answer.status_code == 503, answer.text
            assert answer.headers["x-sandbox-gateway-error"] == "state_unavailable"
            assert answer.headers["retry-after"] == "5"
            assert "state store" in answer.text and redis.url not in answer.text
            assert f"127.0.0.1:{redis.port}" not in answer.text
            assert took < 10, took
            lines = process.audit_lines_until(lambda r: r.get("sandbox") == "stalled-1")
            assert [r.get("error") for r in lines] == ["state_unavailable"]
            assert "the gate failed while deciding" not in log.read_text()
            threads, answers = _hold(gw, [("stalled-1", "agent")])
            assert len(_pending_of(gw, "policy:agent")) == 1  # (asked, Redis back)
            for a in _pending_of(gw, "policy:agent"):
                admin_api(gw, "POST", f"/v1/approvals/{a['id']}",
                          {"decision": "deny", "by": "ops"})
            threads[0].join(30)
            assert answers[0].headers.get("x-sandbox-gateway-error") == "approval_denied"
        finally:
            process.stop()


def _attempt(gw: Workers, sandbox: str) -> BaseException | httpx.Response:
    """A raw MCP POST that may be cut off (the gateway stops): its answer or error."""
    try:
        return _post(gw, sandbox)  # type: ignore[arg-type]
    except httpx.HTTPError as exc:
        return exc
