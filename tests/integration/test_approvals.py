"""Ask mode with real gateways: a request the policy did not foresee is held while a
person answers through the admin API or the CLI (told by a signed webhook); denied
and timed-out asks refuse with their own codes; grants carry scope and time, survive a
restart, reach every replica through redis, and revoking one closes what it opened;
what is never askable is refused at once; an `always` grant proposes a policy change
that `policy check` accepts and that decides the same once merged."""

from __future__ import annotations

import hashlib
import hmac
import json
import shutil
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from helpers.approvals import Call, Workers, ask_gateway, connect, workers_gateway
from helpers.approvals import admin_api as _admin
from helpers.approvals import pending as _pending
from helpers.gateway import GatewayThread
from helpers.redis_server import running_redis
from helpers.tls import LocalCA
from helpers.upstream import Upstream
from integration.conftest import NAMES

POLICY = """\
version: v1
name: agent
ask: {hosts: true, requests: true, timeout: TIMEOUT, notify: [hook, slack]}
egress:
  - host: allowed.test
    methods: [GET]
    paths: ["/ok"]
  - host: api.openai.com
    credential: openai
  - host: other.test
    action: deny
    reason: never this one
  - host: api.github.com
    methods: [GET]
    ask: {timeout: 5s}
credentials:
  openai: {preset: openai, secret: openai-key}
"""

Factory = Callable[..., GatewayThread]


@pytest.fixture
def start(tmp_path: Path, test_ca: LocalCA, upstream: Upstream) -> Iterator[Factory]:
    """Gateways on one work directory (its policies, certs and SQLite state shared)."""
    started: list[GatewayThread] = []

    def factory(timeout: str = "20s", config: dict[str, Any] | None = None,
                workdir: Path = tmp_path, policy: str = POLICY) -> GatewayThread:
        gw = ask_gateway(workdir, test_ca, upstream, NAMES,
                         policy.replace("TIMEOUT", timeout), config)
        started.append(gw)
        return gw

    yield factory
    for gw in started:
        if not gw.loop.is_closed():
            gw.stop()


def test_a_held_request_is_approved_once_through_the_api(start: Factory) -> None:
    gw = start()
    first, second = Call(gw, "https://unbound.test/a"), Call(gw, "https://unbound.test/b")
    [pending] = _pending(gw)  # (the same host from one sandbox: one approval)
    time.sleep(0.3)
    assert len(_pending(gw)) == 1 and first.answer is None and second.answer is None
    assert pending["what"] == "unbound.test:443 (any request)"
    assert pending["sandbox"] == "sbx-1" and "no rule" in pending["reason"]
    got = _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
                 {"decision": "approve", "by": "alice"})
    assert got["approval"]["state"] == "approved" and got["grant"] is None
    assert first.result().status_code == 200 and second.result().status_code == 200
    lines = gw.audit.wait_for(lambda r: r["host"] == "unbound.test" and r["method"] ==
                              "CONNECT" and r["engine"] != "approvals", timeout=5)
    assert lines and all(r["rule"] == f"grant:{pending['id']}" for r in lines), lines
    kinds = [r["decision"] for r in gw.audit.records() if r["engine"] == "approvals"]
    assert kinds == ["ask", "approve"]
    # once: the next connection asks again
    third = Call(gw, "https://unbound.test/c")
    [again] = _pending(gw)
    assert again["id"] != pending["id"]
    _admin(gw, "POST", f"/v1/approvals/{again['id']}", {"decision": "deny", "by": "bob"})
    third.join(30)
    assert third.answer is None or third.answer.status_code == 403


def test_a_hold_outlasts_the_handshake_deadline(start: Factory) -> None:
    """The engines' deadline for a CONNECT's answer pauses while a person decides (the
    ask's own timeout bounds the wait)."""
    gw = start(config={"network": {"timeouts": {"handshake": "1s"}}})
    held = Call(gw, "https://unbound.test/a")
    [pending] = _pending(gw)
    time.sleep(1.6)
    _admin(gw, "POST", f"/v1/approvals/{pending['id']}", {"decision": "approve"})
    assert held.result().status_code == 200


def test_denied_and_timed_out_asks_refuse_with_their_own_codes(start: Factory) -> None:
    gw = start(timeout="1s")
    held = Call(gw, "https://allowed.test/not-ok")  # a path the host's rule does not allow
    [pending] = _pending(gw)
    assert pending["what"] == "GET allowed.test:443/not-ok"
    _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
           {"decision": "deny", "by": "alice", "note": "not for this task"})
    denied = held.result()
    assert denied.status_code == 403 and denied.json()["error"] == "approval_denied"
    reason = denied.json()["reason"]
    assert "alice" in reason and "not for this task" in reason and "do not retry" in reason
    timed = Call(gw, "https://allowed.test/slow").result()
    assert timed.status_code == 403 and timed.json()["error"] == "approval_timeout"
    assert 0.9 < Call(gw, "https://allowed.test/slow").result().elapsed.total_seconds() < 5
    states = {a["state"] for a in _admin(gw, "GET", "/v1/approvals")["approvals"]}
    assert states == {"denied", "timeout"}
    # A late answer is refused: the timeout won.
    late = next(a for a in _admin(gw, "GET", "/v1/approvals")["approvals"]
                if a["state"] == "timeout")
    token = (gw.config.certs / "admin-token").read_text().strip()
    answer = httpx.post(f"{gw.admin}/v1/approvals/{late['id']}", json={"decision": "approve"},
                        headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 400 and "already answered (timeout)" in answer.text


def test_what_is_never_askable_is_refused_at_once(start: Factory) -> None:
    gw = start()
    token = gw.mint("agent", "sbx-1")
    verify = ssl.create_default_context(cafile=str(gw.ca_cert))
    with httpx.Client(proxy=gw.proxy_url(token, "sbx-1"), verify=verify, timeout=10) as c:
        for url, code in (("https://metadata.test/", "forbidden_destination"),
                          ("https://other.test/", "policy_denied")):  # a deny rule
            with pytest.raises(httpx.ProxyError) as refused:
                c.get(url)
            assert "403" in str(refused.value), (url, refused.value)
            assert any(r["error"] == code for r in gw.audit.records()), code
        # a request carrying the sandbox's own token to a host it is not bound to
        answer = c.get("https://allowed.test/not-ok",
                       headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 403 and \
            answer.json()["error"] == "exfiltration_blocked"
    assert _admin(gw, "GET", "/v1/approvals")["approvals"] == []


def test_a_rule_with_ask_waits_for_a_person_and_a_sandbox_grant_lasts(start: Factory
                                                                      ) -> None:
    gw = start()
    held = Call(gw, "https://api.github.com/repos/x")
    [pending] = _pending(gw)  # (a rule that decides per request asks per request)
    assert pending["what"] == "GET api.github.com:443/repos/x" and \
        "asks before it allows" in pending["reason"]
    got = _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
                 {"decision": "approve", "scope": "sandbox", "duration": "10m", "by": "al"})
    grant = got["grant"]
    assert grant["sandbox"] == "sbx-1" and 590 < grant["expires"] - time.time() < 601
    assert held.result().status_code == 200
    again = Call(gw, "https://api.github.com/repos/x?page=2")  # (any query)
    assert again.result().status_code == 200 and again.took < 2  # (no ask)
    assert not [a for a in _admin(gw, "GET", "/v1/approvals")["approvals"]
                if a["state"] == "pending"]
    lines = [r for r in gw.audit.records() if r.get("path") == "/repos/x"]
    assert lines[-1]["rule"] == f"grant:{grant['id']}"
    assert lines[-1]["reason"].startswith("granted by al (sandbox: sandbox sbx-1, until 20")
    other = Call(gw, "https://api.github.com/repos/x", sandbox="sbx-2")  # another sandbox
    [asked] = _pending(gw)
    assert asked["sandbox"] == "sbx-2"
    _admin(gw, "POST", f"/v1/approvals/{asked['id']}", {"decision": "deny"})
    assert other.result().status_code == 403


def test_revoking_a_grant_closes_the_tunnels_it_opened(start: Factory) -> None:
    gw = start()
    sock = connect(gw, "unbound.test", "sbx-1")
    [pending] = _pending(gw)
    got = _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
                 {"decision": "approve", "scope": "policy", "duration": "1h"})
    assert sock.recv(200).startswith(b"HTTP/1.1 200")
    listed = _admin(gw, "GET", "/v1/grants")["grants"]
    assert [g["id"] for g in listed] == [got["grant"]["id"]] and listed[0]["sandbox"] is None
    revoked_at = time.monotonic()
    _admin(gw, "DELETE", f"/v1/grants/{got['grant']['id']}", {"by": "carol"})
    sock.settimeout(5)
    assert sock.recv(100) == b""  # the tunnel was ended
    assert time.monotonic() - revoked_at < 1.5
    sock.close()
    assert _admin(gw, "GET", "/v1/grants")["grants"] == []
    assert any(r["decision"] == "revoke" and "carol" in r["reason"]
               for r in gw.audit.records())
    line = gw.audit.wait_for(lambda r: r["method"] == "CONNECT" and r["engine"] != "approvals"
                             and r.get("error") == "grant_revoked")
    assert line, [r for r in gw.audit.records() if r["method"] == "CONNECT"]


def test_a_grant_survives_a_restart(start: Factory, tmp_path: Path) -> None:
    gw = start()
    held = Call(gw, "https://unbound.test/a")
    [pending] = _pending(gw)
    _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
           {"decision": "approve", "scope": "sandbox", "duration": "1h"})
    assert held.result().status_code == 200
    gw.stop()
    again = start()
    call = Call(again, "https://unbound.test/b")
    assert call.result().status_code == 200 and call.took < 3
    assert not [a for a in _admin(again, "GET", "/v1/approvals")["approvals"]
                if a["state"] == "pending"]


def test_two_replicas_on_redis_share_asks_and_grants(start: Factory, tmp_path: Path) -> None:
    for server in running_redis(tmp_path / "redis"):
        state = {"state": {"store": "redis", "url": server.url, "prefix": "ask"}}
        one = start(config=state, workdir=tmp_path / "one")
        two = start(config=state, workdir=tmp_path / "two")
        held = Call(one, "https://unbound.test/a")
        [pending] = _pending(two)  # asked on one, seen on two
        _admin(two, "POST", f"/v1/approvals/{pending['id']}",
               {"decision": "approve", "scope": "sandbox", "duration": "1h"})
        assert held.result().status_code == 200 and held.took < 5
        time.sleep(0.7)  # (the sweeper's refresh: the grant reaches both views)
        assert Call(two, "https://unbound.test/b").result().status_code == 200
        assert Call(one, "https://unbound.test/c").result().status_code == 200


WORKERS_POLICY = """\
version: v1
name: agent
ask: {requests: true, timeout: 30s}
egress:
  - host: allowed.test
    methods: [GET]
    paths: ["/ok"]
"""


def test_a_grant_takes_effect_on_every_worker_at_once(
        tmp_path: Path, test_ca: LocalCA, upstream: Upstream) -> None:
    """`run --workers 2`, 20 times over: (a) the request right after a `sandbox` grant,
    on a new connection (either worker), goes at once and is not asked again; (b) a
    request another sandbox holds on either worker, asked separately, is released within
    half a second of a `policy` grant that covers it being written (pushed by the state
    file's change counter, not the held request's poll), its approval closed by it."""
    gw = workers_gateway(tmp_path, test_ca, upstream, NAMES, WORKERS_POLICY)
    after_grant: list[float] = []
    released: list[float] = []
    try:
        for n in range(20):
            first = Call(gw, f"https://allowed.test/a{n}", sandbox="sbx-1")
            [asked] = _pending(gw)
            _admin(gw, "POST", f"/v1/approvals/{asked['id']}",
                   {"decision": "approve", "scope": "sandbox", "duration": "1h"})
            assert first.result().status_code == 200
            again = Call(gw, f"https://allowed.test/a{n}", sandbox="sbx-1")
            assert again.result().status_code == 200
            after_grant.append(again.took)

            one = Call(gw, f"https://allowed.test/b{n}", sandbox="sbx-2")
            other = Call(gw, f"https://allowed.test/b{n}", sandbox="sbx-3")
            two = _pending(gw, 2)
            time.sleep(0.3)  # (held past their own approvals' first polls)
            mine = next(a for a in two if a["sandbox"] == "sbx-2")
            _admin(gw, "POST", f"/v1/approvals/{mine['id']}",
                   {"decision": "approve", "scope": "policy", "duration": "1h"})
            answered = time.monotonic()
            assert other.result().status_code == 200
            released.append(time.monotonic() - answered)
            assert one.result().status_code == 200
            assert not _pending_now(gw)  # (sbx-3's approval closed by the grant)
        approvals = _admin(gw, "GET", "/v1/approvals")["approvals"]
        assert len(approvals) == 60  # (a, and b twice: nothing asked a second time)
        closed = [a for a in approvals if a["sandbox"] == "sbx-3"]
        assert all(a["state"] == "approved" and a["note"].startswith("covered by grant")
                   for a in closed)
        lines = gw.process.audit_lines()
        served = {(line["path"][:2], line["worker"]) for line in lines
                  if line.get("host") == "allowed.test" and line.get("method") == "GET"}
        assert {w for _, w in served} == {0, 1}, served  # (both workers held and released)
    finally:
        gw.process.stop()
    print(f"\nright after a grant: max {max(after_grant):.3f}s, median "
          f"{sorted(after_grant)[10]:.3f}s; held, released after the grant: max "
          f"{max(released):.3f}s, median {sorted(released)[10]:.3f}s")
    assert max(after_grant) < 0.5, after_grant
    assert max(released) < 0.5, released


def _pending_now(gw: Workers) -> list[dict[str, Any]]:
    return [a for a in _admin(gw, "GET", "/v1/approvals")["approvals"]
            if a["state"] == "pending"]


class _Receiver(BaseHTTPRequestHandler):
    got: ClassVar[list[tuple[dict[str, str], bytes]]] = []

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(204)
        self.end_headers()


def test_webhooks_are_signed_and_answering_from_them_works(
        start: Factory, test_ca: LocalCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """A local HTTPS receiver checks the signature; the person answers with the CLI the
    notification names."""
    (tmp_path / "hook").mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.socket = test_ca.server_context(tmp_path / "hook", ["localhost"]
                                           ).wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    _Receiver.got = []
    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_HOOK_KEY", "whsec-0123456789abcdef")
    base = f"https://localhost:{server.server_address[1]}"
    gw = start(config={"approvals": {"notify": {
        "hook": {"url": f"{base}/json", "secret": "hook-key"},
        "slack": {"url": f"{base}/slack", "format": "slack"}}}})
    try:
        held = Call(gw, "https://unbound.test/x")
        [pending] = _pending(gw)
        deadline = time.monotonic() + 10
        while len(_Receiver.got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        by_path = {json.loads(body).get("type", "slack"): (headers, body)
                   for headers, body in _Receiver.got}
        headers, body = by_path["approval.requested"]
        stamp = headers["x-sandbox-gateway-timestamp"]
        want = "v1=" + hmac.new(b"whsec-0123456789abcdef", stamp.encode() + b"." + body,
                                hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["x-sandbox-gateway-signature"], want)
        assert abs(int(stamp) - time.time()) < 30
        doc = json.loads(body)
        assert doc["approval"]["id"] == pending["id"] and "approve" in doc["answer"]["cli"]
        slack = json.loads(by_path["slack"][1])["text"]
        assert pending["id"] in slack and "unbound.test" in slack
        assert "x-sandbox-gateway-signature" not in by_path["slack"][0]
        token = (gw.config.certs / "admin-token").read_text()
        assert token.strip() not in json.dumps(by_path, default=str)
        out = _cli(gw, "approvals", "approve", pending["id"], "--by", "hook-reader")
        assert out.returncode == 0, out.stderr
        assert held.result().status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def _cli(gw: GatewayThread, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args, "--admin", gw.admin,
                           "--config", str(gw.config.source)], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_the_cli_lists_answers_watches_and_revokes(start: Factory) -> None:
    gw = start()
    held = Call(gw, "https://unbound.test/x")
    [pending] = _pending(gw)
    listed = _cli(gw, "approvals", "list")
    assert pending["id"] in listed.stdout and "unbound.test:443" in listed.stdout
    watched = _cli(gw, "approvals", "list", "--watch", "--once", "--by", "dana", stdin="p\n")
    assert watched.returncode == 0, watched.stderr
    assert "approved by dana (policy)" in watched.stdout
    assert held.result().status_code == 200
    grants = _cli(gw, "approvals", "grants")
    grant = grants.stdout.split()[0]
    assert grant.startswith("gr_") and "policy agent" in grants.stdout
    assert _cli(gw, "approvals", "revoke", grant).returncode == 0
    assert "no grants" in _cli(gw, "approvals", "grants").stdout
    denied = Call(gw, "https://unbound.test/y")
    [pending] = _pending(gw)
    out = _cli(gw, "approvals", "deny", pending["id"], "--note", "no")
    assert out.returncode == 0 and "denied" in out.stdout
    assert denied.answer is None or denied.result().status_code == 403
    missing = _cli(gw, "approvals", "approve", "ap_nothing")
    assert missing.returncode == 1 and "HTTP 404" in missing.stderr


def test_an_always_grant_proposes_a_change_that_decides_the_same(start: Factory,
                                                                 tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path / "policies")], check=True)
    gw = start()
    pdir = tmp_path / "policies"
    subprocess.run(["git", "-C", str(pdir), "add", "."], check=True)
    subprocess.run(["git", "-C", str(pdir), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "policies"], check=True)
    before = (pdir / "agent.yaml").read_text()
    held = Call(gw, "https://allowed.test/v2/items")
    [pending] = _pending(gw)
    got = _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
                 {"decision": "approve", "scope": "always", "by": "erin", "note": "CI"})
    assert held.result().status_code == 200
    proposal = got["proposal"]
    assert proposal["branch"] == f"sandbox-gateway/grant-{got['grant']['id']}"
    assert '"/v2/items"' in proposal["snippet"] and "GET" in proposal["snippet"]
    assert (pdir / "agent.yaml").read_text() == before  # live files untouched
    status = subprocess.run(["git", "-C", str(pdir), "status", "--porcelain"],
                            capture_output=True, text=True, check=True).stdout
    assert status == ""
    merged = tmp_path / "merged" / "policies"
    subprocess.run(["git", "clone", "-q", "-b", proposal["branch"], str(pdir), str(merged)],
                   check=True)
    check = subprocess.run([sys.executable, "-m", "gateway", "policy", "check", str(merged)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    patched = tmp_path / "patched"
    shutil.copytree(pdir, patched, ignore=shutil.ignore_patterns(".git"))
    subprocess.run(["patch", "-s", "-p1", "-d", str(patched), "-i", proposal["patch"]],
                   check=True)
    assert (patched / "agent.yaml").read_text() == (merged / "agent.yaml").read_text()
    explain = subprocess.run([sys.executable, "-m", "gateway", "policy", "explain",
                              "--dir", str(merged), "--policy", "agent", "GET",
                              "https://allowed.test/v2/items"],
                             capture_output=True, text=True, timeout=60)
    assert explain.returncode == 0 and "allow" in explain.stdout, explain.stdout + \
        explain.stderr


@pytest.mark.parametrize("intercept", ["mitmproxy"])
def test_the_mitmproxy_engine_holds_and_releases_too(start: Factory, intercept: str) -> None:
    gw = start(config={"network": {"intercept": intercept}})
    held = Call(gw, "https://allowed.test/elsewhere")
    [pending] = _pending(gw)
    _admin(gw, "POST", f"/v1/approvals/{pending['id']}", {"decision": "approve"})
    assert held.result().status_code == 200
    denied = Call(gw, "https://allowed.test/elsewhere")
    [pending] = _pending(gw)
    _admin(gw, "POST", f"/v1/approvals/{pending['id']}", {"decision": "deny"})
    assert denied.result().json()["error"] == "approval_denied"


MODELS = """\
version: v1
name: agent
ask: {models: true, timeout: TIMEOUT}
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini"]
credentials:
  openai: {preset: openai, secret: openai-key}
"""


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_the_openai_sdk_waits_for_a_model_a_person_allows(
        start: Factory, monkeypatch: pytest.MonkeyPatch, intercept: str) -> None:
    """A model outside the rule's allowlist, with ask: {models: true}: the SDK's call is
    held, approved for the sandbox it goes on (the key swapped in) and the next call
    needs no ask; declined, the SDK shows a person said no."""
    import openai

    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_OPENAI_KEY", "sk-real-0123456789abcdef")
    gw = start(policy=MODELS, config={"network": {"intercept": intercept}})
    token = gw.mint("agent", "sbx-1")
    verify = ssl.create_default_context(cafile=str(gw.ca_cert))
    http = httpx.Client(proxy=gw.proxy_url(token, "sbx-1"), verify=verify, timeout=60)
    client = openai.OpenAI(api_key=token, http_client=http, max_retries=0)
    results: list[Any] = []

    def call(model: str) -> None:
        try:
            results.append(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]).model)
        except openai.APIError as exc:
            results.append(exc)

    held = threading.Thread(target=call, args=("gpt-5",))
    held.start()
    [pending] = _pending(gw)
    assert pending["what"] == "model gpt-5 on api.openai.com:443"
    assert "not allowed by rule" in pending["reason"]
    got = _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
                 {"decision": "approve", "scope": "sandbox", "duration": "1h"})
    held.join(30)
    assert results == ["gpt-5"]
    call("gpt-5")  # (the grant: no ask)
    assert results[-1] == "gpt-5"
    line = gw.audit.wait_for(lambda r: r["host"] == "api.openai.com" and r["engine"] !=
                             "approvals" and r["status"] == 200)[-1]
    assert line["rule"] == f"grant:{got['grant']['id']}" and line["credential"] == "openai"
    call("gpt-4o-mini")  # (listed: as ever)
    assert results[-1] == "gpt-4o-mini"
    other = threading.Thread(target=call, args=("o3",))
    other.start()
    [pending] = _pending(gw)
    _admin(gw, "POST", f"/v1/approvals/{pending['id']}",
           {"decision": "deny", "note": "too expensive"})
    other.join(30)
    refused = results[-1]
    assert isinstance(refused, openai.PermissionDeniedError), refused
    assert "approval_denied" in str(refused) and "too expensive" in str(refused)
    http.close()
