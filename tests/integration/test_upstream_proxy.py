"""Behind a corporate proxy (issue 28): every upstream dial through a real squid (Basic
auth, a denying ACL, its own hosts file) or a real dante (SOCKS5, username/password),
to the address the gateway checked.

Paths: passthrough (splice), intercepted HTTP/1 on the HTTP/1 engine and on mitmproxy,
an HTTP/2 upstream (nginx) through mitmproxy, WebSocket, `protocol: tcp` (a server that
speaks first), a minted credential's token call and a Key Vault fetch (the gateway's own
calls). squid's access log shows the CONNECT named the checked IP; a name squid would
resolve elsewhere (a canary on 127.0.0.2) cannot move the connection; the proxy's
credentials reach neither an upstream nor the sandbox; a proxy that is down, denies or
refuses the credentials is answered 502 `upstream_proxy_failed` naming its status.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes.keyvault import FakeKeyVault, StaticCredential
from helpers.clients import open_tunnel
from helpers.corporate_proxy import (
    PASSWORD,
    SOCKS_PASSWORD,
    SOCKS_USER,
    USER,
    Dante,
    Squid,
    Stunnel,
    free_port,
)
from helpers.gateway import GatewayThread
from helpers.metrics import metric
from helpers.nginx import Nginx
from helpers.parity import Result, Spec, run
from helpers.process import start_gateway
from helpers.tls import LocalCA
from helpers.upstream import MINT_CLIENT, MINT_SECRET, MINTED, Upstream, start_upstream

from gateway.engines import patches
from gateway.net.proxy_settings import ProxySettings
from gateway.net.resolver import StaticResolver
from gateway.net.upstream_proxy import UpstreamProxy
from gateway.services.minting.http import TokenHttp

NAMES = ["pass.test", "api.corp.test", "minted.corp.test", "login.corp.test", "h2.test",
         "moved.test", "denied.test"]
API_KEY = "sk-corp-upstream-key-0123456789abcdef"
POLICY = """
version: v1
name: agent
egress:
  - host: pass.test
  - host: moved.test
    ports: [{port}]
  - host: api.corp.test
    credential: api
  - host: denied.test
    inspect: true
  - host: h2.test
    inspect: true
  - host: minted.corp.test
    credential: minted
  - host: tcp.test
    ports: [{tcp_port}]
    protocol: tcp
credentials:
  api: {{hosts: [api.corp.test], secret: api-key, inject: {{bearer: true}}}}
  minted:
    type: oauth2-client-credentials
    token_url: https://login.corp.test/oauth2/token
    client_id: {client}
    client_secret: mint-secret
    hosts: [minted.corp.test]
"""
H2_SERVER = """
  server {{
    listen 127.0.0.1:{port} ssl http2;
    server_name _;
    location / {{ return 200 "served over $server_protocol\\n"; }}
  }}
"""
WS_HEADERS = [("Upgrade", "websocket"), ("Connection", "Upgrade"),
              ("Sec-WebSocket-Version", "13"), ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")]
SECRET_FORMS = [PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode(),
                SOCKS_PASSWORD]


class Listener:
    """A TCP server on `host`:`port` recording connections; `banner`: sent first, then
    every byte echoed."""

    def __init__(self, host: str, port: int = 0, banner: bytes = b"") -> None:
        self.sock = socket.create_server((host, port))
        self.port = int(self.sock.getsockname()[1])
        self.banner = banner
        self.connections = 0
        self.received = b""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                if self.banner:
                    conn.sendall(self.banner)
                while data := conn.recv(65536):
                    self.received += data
                    conn.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Upstreams, a canary, a fake Key Vault, squid and dante: started once."""
    root = tmp_path_factory.mktemp("corp")
    for sub in ("ca", "leaf", "leaf2", "nginx", "kv"):
        (root / sub).mkdir()
    with contextlib.ExitStack() as stack:
        ca = LocalCA.create(root / "ca")
        upstream = start_upstream(ca.server_context(root / "leaf", NAMES))
        stack.callback(upstream.close)
        token_upstream = start_upstream(ca.server_context(root / "leaf2", NAMES))
        stack.callback(token_upstream.close)
        canary = Listener("127.0.0.2", upstream.port)  # where squid's DNS sends moved.test
        stack.callback(canary.close)
        tcp = Listener("127.0.0.1", banner=b"220 corp banner\r\n")
        stack.callback(tcp.close)
        nginx_port = free_port()
        nginx = Nginx(root / "nginx", ca, NAMES, extra=H2_SERVER.format(port=nginx_port))
        stack.callback(nginx.stop)
        vault = FakeKeyVault(root / "kv").start()
        stack.callback(vault.stop)
        bundle = root / "upstream-ca.pem"
        bundle.write_bytes(ca.cert_path.read_bytes() + b"\n" + vault.ca_path.read_bytes())
        ports = [upstream.port, token_upstream.port, tcp.port, nginx_port, vault.port]
        squid = Squid(root / "squid", ports=ports, denied=["127.0.0.3"],
                      hosts={"moved.test": "127.0.0.2"})
        stack.callback(squid.stop)
        dante = Dante(root / "dante")
        stack.callback(dante.stop)
        yield {"ca": ca, "upstream": upstream, "token_upstream": token_upstream,
               "canary": canary, "tcp": tcp, "nginx_port": nginx_port, "vault": vault,
               "bundle": bundle, "squid": squid, "dante": dante}


def start(tmp_path: Path, env: dict[str, Any], proxy: dict[str, Any] | str | None, *,
          intercept: str = "fast", extra: dict[str, Any] | None = None) -> GatewayThread:
    (tmp_path / "policies").mkdir(parents=True, exist_ok=True)
    (tmp_path / "policies" / "agent.yaml").write_text(POLICY.format(
        tcp_port=env["tcp"].port, client=MINT_CLIENT, port=env["upstream"].port))
    secrets = tmp_path / "secrets.yaml"
    secrets.write_text(yaml.safe_dump({"api-key": API_KEY, "mint-secret": MINT_SECRET,
                                       "corp-proxy": f"{USER}:{PASSWORD}",
                                       "corp-wrong": f"{USER}:not-the-password",
                                       "socks-proxy": f"{SOCKS_USER}:{SOCKS_PASSWORD}"}))
    secrets.chmod(0o600)
    port = env["upstream"].port
    resolve = {n: f"127.0.0.1:{port}" for n in ("pass.test", "api.corp.test",
                                                   "minted.corp.test")}
    resolve.update({"login.corp.test": f"127.0.0.1:{env['token_upstream'].port}",
                    "h2.test": f"127.0.0.1:{env['nginx_port']}",
                    "denied.test": f"127.0.0.3:{port}",
                    "tcp.test": f"127.0.0.1:{env['tcp'].port}"})
    # upstream_idle_timeout 0: no upstream connection is kept, so each tunnel through
    # squid ends (and is logged by it) when its exchange does
    network: dict[str, Any] = {"upstream_ca": str(env["bundle"]), "resolve": resolve,
                               "intercept": intercept, "allow_cidrs": ["127.0.0.1/32"],
                               "upstream_idle_timeout": 0}
    if proxy is not None:
        network["upstream_proxy"] = proxy
    config: dict[str, Any] = {"network": network,
                              "secrets": {"store": "file", "path": str(secrets)}}
    config.update(extra or {})
    return GatewayThread(tmp_path, config,
                         resolver=StaticResolver({"moved.test": ["127.0.0.1"]}))


def squid_proxy(env: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"url": env["squid"].url, "credentials": "corp-proxy", **more}


def spec(gw: GatewayThread, host: str, *, bearer: bool = False, **kw: Any) -> Spec:
    """The request, through the gateway; `bearer`: the token as the API key too."""
    token = gw.mint("agent")
    auth = "Basic " + base64.b64encode(f"sandbox-1:{token}".encode()).decode()
    kw.setdefault("cafile", str(gw.ca_cert))
    if bearer:
        kw["headers"] = [*kw.get("headers", []), ("Authorization", f"Bearer {token}")]
    return Spec(host=host, proxy=gw.gateway.proxy_address, proxy_auth=auth, **kw)


def body(result: Result) -> dict[str, Any]:
    assert (result.stage, result.status) == ("response", 200), result
    parsed: dict[str, Any] = json.loads(result.body)
    parsed["headers"] = {k.lower(): v for k, v in parsed.get("headers", {}).items()}
    return parsed


def assert_no_proxy_secret(*texts: str) -> None:
    for text in texts:
        for form in SECRET_FORMS:
            assert form not in text


def seen_headers(upstream: Upstream, path: str) -> dict[str, str]:
    """The headers the upstream received on `path` (the last such request)."""
    found = [s for s in upstream.requests if s.path == path]
    assert found, path
    return {k.lower(): v for k, v in found[-1].headers.items()}


def seen_text(upstream: Upstream, since: int = 0) -> str:
    return "".join(f"{s.method} {s.path} {s.headers} {s.body!r}"
                   for s in upstream.requests[since:])


# -- every path through squid ---------------------------------------------------------------


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_every_path_through_squid_to_the_checked_address(
        tmp_path: Path, env: dict[str, Any], intercept: str) -> None:
    squid: Squid = env["squid"]
    upstream: Upstream = env["upstream"]
    gw = start(tmp_path, env, squid_proxy(env), intercept=intercept)
    try:
        before = len(upstream.requests)
        ok_before = metric(gw, "sandbox_gateway_upstream_proxy_connects_total", outcome="ok")
        port = upstream.port
        # passthrough (the sandbox's own TLS to the upstream, end to end)
        passed = run(spec(gw, "pass.test", target="/passthrough", cafile=str(env["ca"].cert_path)))
        assert body(passed)["path"] == "/passthrough"
        # intercepted HTTP/1 with a key swap
        swapped = body(run(spec(gw, "api.corp.test", target="/v1/items", bearer=True)))
        assert seen_headers(upstream, "/v1/items")["authorization"] == f"Bearer {API_KEY}"
        assert "proxy-authorization" not in seen_headers(upstream, "/v1/items")
        # WebSocket
        ws = run(spec(gw, "api.corp.test", target="/ws", headers=WS_HEADERS, ws=["hello ws"],
                       bearer=True))
        assert ws.stage == "ws-echo", ws
        # HTTP/2 to an HTTP/2 upstream (nginx), through mitmproxy
        h2 = run(spec(gw, "h2.test", target="/", h2=True))
        assert (h2.stage, h2.status) == ("response", 200), h2
        assert "served over HTTP/2.0" in h2.body
        # a minted credential: the token call is the gateway's own, through squid too
        minted = body(run(spec(gw, "minted.corp.test", target="/v1/minted", bearer=True)))
        assert seen_headers(upstream, "/v1/minted")["authorization"] == f"Bearer {MINTED}"
        # protocol: tcp, a server that speaks first (its banner may come with squid's
        # 200); mitmproxy dials only once the client has sent something (lazily)
        with open_tunnel(gw.gateway.proxy_address, f"tcp.test:{env['tcp'].port}",
                         gw.mint("agent")) as sock:
            sock.settimeout(5)
            want = b"220 corp banner\r\nping"
            if intercept == "mitmproxy":
                sock.sendall(b"ping")
            got = b""
            while len(got) < len(want) - 4:
                got += sock.recv(100)
            if intercept == "fast":
                sock.sendall(b"ping")
            while len(got) < len(want):
                got += sock.recv(100)
            assert got == want

        # squid logs a tunnel when it closes: end the token client's kept-alive one
        http = gw.gateway.credentials.http
        assert http is not None
        gw.call(http.close())
        # squid saw every one as a CONNECT to the checked address, never a name
        for where in (f"127.0.0.1:{port}", f"127.0.0.1:{env['token_upstream'].port}",
                      f"127.0.0.1:{env['nginx_port']}", f"127.0.0.1:{env['tcp'].port}"):
            lines = squid.wait_access(f"CONNECT {where} {USER}")
            assert lines and all("TCP_TUNNEL/200 " in line for line in lines), \
                (where, squid.access_lines())
        assert not [line for line in squid.access_lines() if ".test:" in line]
        # the proxy's credentials reached no upstream and not the client
        assert_no_proxy_secret(seen_text(upstream, before), seen_text(env["token_upstream"]),
                               gw.audit.getvalue(), passed.body, swapped.__repr__(), ws.body,
                               h2.body, minted.__repr__(), str(h2.headers))
        assert metric(gw, "sandbox_gateway_upstream_proxy_connects_total",
                      outcome="ok") >= ok_before + 6
        assert_no_proxy_secret(httpx.get(f"{gw.admin}/metrics").text)
    finally:
        gw.stop()


def test_the_corporate_side_dns_cannot_move_the_connection(tmp_path: Path,
                                                          env: dict[str, Any]) -> None:
    """The gateway's resolver says moved.test is 127.0.0.1; squid's hosts file says
    127.0.0.2 (a canary). With connect_to: address (the default) squid is asked for
    127.0.0.1 and the canary gets nothing; with connect_to: name it would get the
    connection (which is why that setting is an opt-in with a warning)."""
    canary: Listener = env["canary"]
    port = env["upstream"].port
    gw = start(tmp_path, env, squid_proxy(env))
    try:
        result = run(spec(gw, "moved.test", port=port, target="/moved",
                          cafile=str(env["ca"].cert_path)))
        assert body(result)["path"] == "/moved"
        assert canary.connections == 0
        assert env["squid"].wait_access(f"CONNECT 127.0.0.1:{port} {USER}")
    finally:
        gw.stop()
    named = start(tmp_path / "named", env, squid_proxy(env, connect_to="name"))
    try:
        result = run(spec(named, "moved.test", port=port, target="/moved",
                          cafile=str(env["ca"].cert_path)))
        assert result.stage != "response"  # the canary speaks no TLS
        assert canary.connections == 1
        assert env["squid"].wait_access(f"CONNECT moved.test:{port} {USER}")
    finally:
        named.stop()


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_proxy_denial_wrong_credentials_and_proxy_down(tmp_path: Path, env: dict[str, Any],
                                                       intercept: str) -> None:
    gw = start(tmp_path, env, squid_proxy(env), intercept=intercept)
    try:
        denials = metric(gw, "sandbox_gateway_upstream_proxy_connects_total", outcome="denied")
        denied = run(spec(gw, "denied.test", target="/x"))
        assert (denied.status, denied.code) == (502, "upstream_proxy_failed"), denied
        reason = json.loads(denied.body)["reason"]
        assert "answered 403 to CONNECT 127.0.0.3" in reason, reason
        assert "squid" not in denied.body.lower()  # the proxy's own page is never quoted
        line = gw.audit.wait_for(lambda r: r.get("host") == "denied.test")[0]
        assert line["error"] == "upstream_proxy_failed"
        assert metric(gw, "sandbox_gateway_upstream_proxy_connects_total",
                      outcome="denied") >= denials + 1
    finally:
        gw.stop()

    wrong = start(tmp_path / "wrong", env, squid_proxy(env, credentials="corp-wrong"),
                  intercept=intercept)
    try:
        result = run(spec(wrong, "api.corp.test", target="/v1/x", bearer=True))
        assert (result.status, result.code) == (502, "upstream_proxy_failed"), result
        assert "answered 407" in json.loads(result.body)["reason"]
        assert "not-the-password" not in result.body + wrong.audit.getvalue()
    finally:
        wrong.stop()

    down = start(tmp_path / "down", env, {"url": f"http://127.0.0.1:{free_port()}",
                                          "credentials": "corp-proxy"}, intercept=intercept)
    try:
        result = run(spec(down, "api.corp.test", target="/v1/x", bearer=True))
        assert (result.status, result.code) == (502, "upstream_proxy_failed"), result
        assert "could not be reached" in json.loads(result.body)["reason"]
        # a passthrough tunnel is answered 200 before the dial: it is closed, and its
        # audit line says why
        cut = run(spec(down, "pass.test", target="/", cafile=str(env["ca"].cert_path)))
        assert cut.stage in ("tls", "closed"), cut
        assert down.audit.wait_for(lambda r: r.get("host") == "pass.test"
                                   and r.get("error") == "upstream_proxy_failed")
        assert_no_proxy_secret(down.audit.getvalue(), result.body)
    finally:
        down.stop()


def test_readyz_checks_the_proxy_when_asked(tmp_path: Path, env: dict[str, Any]) -> None:
    """`/readyz` 503 while the proxy cannot be reached, 200 once it can; a stop does not
    wait for the probe's next turn (it waited 5 s: the probe's task was awaited, not
    cancelled)."""
    gw = start(tmp_path, env, {"url": f"http://127.0.0.1:{free_port()}", "check_ready": True})
    try:
        for _ in range(50):
            ready = httpx.get(f"{gw.admin}/readyz")
            if ready.status_code == 503:
                break
            threading.Event().wait(0.1)
        assert ready.status_code == 503 and "upstream proxy" in ready.text, ready.text
    finally:
        stopping = time.monotonic()
        gw.stop()
    assert time.monotonic() - stopping < 2.5  # (a stop without the probe: ~0.1 s)
    up = start(tmp_path / "up", env, squid_proxy(env, check_ready=True))
    try:
        threading.Event().wait(0.3)
        assert httpx.get(f"{up.admin}/readyz").status_code == 200
    finally:
        up.stop()


def test_no_proxy_dials_direct(tmp_path: Path, env: dict[str, Any]) -> None:
    """`.corp.test` in no_proxy: api.corp.test is dialled direct, pass.test (not
    listed) through squid: one CONNECT in squid's log for the two requests."""
    squid: Squid = env["squid"]
    gw = start(tmp_path, env, squid_proxy(env, no_proxy=[".corp.test"]))
    try:
        lines = len(squid.access_lines())
        direct = run(spec(gw, "api.corp.test", target="/v1/direct", bearer=True))
        assert body(direct)["path"] == "/v1/direct"
        via = run(spec(gw, "pass.test", target="/via", cafile=str(env["ca"].cert_path)))
        assert body(via)["path"] == "/via"
        assert squid.wait_access(f"CONNECT 127.0.0.1:{env['upstream'].port}")
        threading.Event().wait(0.3)  # (a second line, were there one, would be written)
        connects = [line for line in squid.access_lines()[lines:] if "CONNECT" in line]
        assert len(connects) == 1, connects
    finally:
        gw.stop()


# -- SOCKS5 (dante) -----------------------------------------------------------------------------


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_socks5_through_dante(tmp_path: Path, env: dict[str, Any], intercept: str) -> None:
    dante: Dante = env["dante"]
    upstream: Upstream = env["upstream"]
    gw = start(tmp_path, env, {"url": dante.url, "credentials": "socks-proxy"},
               intercept=intercept)
    try:
        before = len(upstream.requests)
        assert body(run(spec(gw, "pass.test", target="/socks-pass",
                             cafile=str(env["ca"].cert_path))))["path"] == "/socks-pass"
        body(run(spec(gw, "api.corp.test", target="/v1/socks", bearer=True)))
        assert seen_headers(upstream, "/v1/socks")["authorization"] == f"Bearer {API_KEY}"
        h2 = run(spec(gw, "h2.test", target="/", h2=True))
        assert "served over HTTP/2.0" in h2.body, h2
        connects = [line for line in dante.log_lines() if "tcp/connect" in line
                    and f"username%{SOCKS_USER}@" in line]
        assert any(f"127.0.0.1.{upstream.port}" in line for line in connects), connects
        assert any(f"127.0.0.1.{env['nginx_port']}" in line for line in connects), connects
        assert_no_proxy_secret(seen_text(upstream, before), gw.audit.getvalue(), h2.body)
    finally:
        gw.stop()
    wrong = start(tmp_path / "wrong", env, {"url": dante.url, "credentials": "corp-wrong"},
                  intercept=intercept)
    try:
        result = run(spec(wrong, "api.corp.test", target="/v1/x", bearer=True))
        assert (result.status, result.code) == (502, "upstream_proxy_failed"), result
        assert "SOCKS5" in json.loads(result.body)["reason"]
    finally:
        wrong.stop()


# -- an https:// proxy (TLS to the proxy: stunnel in front of squid) ------------------------------


@pytest.mark.parametrize("intercept", ["fast", "mitmproxy"])
def test_an_https_proxy_is_reached_over_verified_tls(tmp_path: Path, env: dict[str, Any],
                                                     intercept: str) -> None:
    """`url: https://…`: the gateway speaks TLS to the proxy (verified against the public
    roots plus network.upstream_ca), then CONNECT inside it, with its credentials never
    in cleartext on the wire; a proxy whose certificate is not trusted is refused."""
    squid: Squid = env["squid"]
    root = tmp_path / "stunnel"
    root.mkdir()
    cert, key = env["ca"].issue(root, ["localhost"])
    tls = Stunnel(root, target=squid.port, cert=cert, key=key)
    try:
        gw = start(tmp_path / "gw", env, {"url": tls.url, "credentials": "corp-proxy"},
                   intercept=intercept)
        try:
            port = env["upstream"].port
            got = body(run(spec(gw, "api.corp.test", target="/v1/over-tls", bearer=True)))
            assert got["path"] == "/v1/over-tls"
            assert seen_headers(env["upstream"], "/v1/over-tls")["authorization"] == \
                f"Bearer {API_KEY}"
            passed = run(spec(gw, "pass.test", target="/tls-pass",
                              cafile=str(env["ca"].cert_path)))
            assert body(passed)["path"] == "/tls-pass"
            assert squid.wait_access(f"CONNECT 127.0.0.1:{port}")
            assert any("accepted connection from 127.0.0.1" in line
                       for line in tls.log_lines()), tls.log_lines()[-5:]
        finally:
            gw.stop()
        untrusted = start(tmp_path / "untrusted", env,
                          {"url": tls.url, "credentials": "corp-proxy"}, intercept=intercept,
                          extra={"network": {"upstream_ca": None, "resolve": {
                              "api.corp.test": f"127.0.0.1:{env['upstream'].port}"},
                              "intercept": intercept, "allow_cidrs": ["127.0.0.1/32"],
                              "upstream_proxy": {"url": tls.url,
                                                 "credentials": "corp-proxy"}}})
        try:
            refused = run(spec(untrusted, "api.corp.test", target="/v1/x", bearer=True))
            assert (refused.status, refused.code) == (502, "upstream_proxy_failed"), refused
            assert "TLS certificate could not be verified" in json.loads(refused.body)["reason"]
        finally:
            untrusted.stop()
    finally:
        tls.stop()


# -- the gateway's own calls: Key Vault through squid ---------------------------------------------


def test_key_vault_fetch_through_squid(env: dict[str, Any]) -> None:
    from gateway.services.secrets.azure import AzureKeyVaultStore

    vault: FakeKeyVault = env["vault"]
    squid: Squid = env["squid"]
    vault.set_secret("corp-api-key", "kv-value-through-the-proxy")
    url = vault.vault_url()
    host = url.removeprefix("https://")

    async def fetch() -> str:
        async def secret(name: str) -> Any:
            from gateway.core.secret_value import SecretValue
            assert name == "corp-proxy"
            return SecretValue(f"{USER}:{PASSWORD}")

        proxy = UpstreamProxy(ProxySettings("http", "127.0.0.1", squid.port,
                                            credentials="corp-proxy"), secret=secret)
        http = TokenHttp(upstream_ca=env["bundle"], overrides={host: ("127.0.0.1", vault.port)},
                         connector=patches.proxied_connector(proxy))
        credential = StaticCredential(vault.issue_static_token())
        store = AzureKeyVaultStore(url, transport=http.azure_transport(),
                                   credential_obj=credential)
        try:
            return (await store.fetch("corp-api-key")).reveal()
        finally:
            await store.close()
            await http.close()

    assert asyncio.run(fetch()) == "kv-value-through-the-proxy"
    assert squid.wait_access(f"CONNECT 127.0.0.1:{vault.port} {USER}"), squid.access_lines()
    assert not [r for r in vault.requests if any(f in repr(r) for f in SECRET_FORMS)]



def test_a_gateway_on_key_vault_fetches_it_through_the_proxy(
        tmp_path: Path, env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`secrets.store: azure-keyvault` in a running gateway, its proxy from its own
    environment (`upstream_proxy: env`, the only way its credentials need not come from
    the vault itself): the workload-identity exchange and the secret fetch go through
    squid to the checked address, and the key reaches only its upstream."""
    squid: Squid = env["squid"]
    vault: FakeKeyVault = env["vault"]
    upstream: Upstream = env["upstream"]
    vault.set_secret("api-key", API_KEY)
    monkeypatch.setenv("HTTPS_PROXY", f"http://{USER}:{PASSWORD}@127.0.0.1:{squid.port}")
    monkeypatch.setenv("AZURE_TENANT_ID", vault.tenant_id)
    monkeypatch.setenv("AZURE_CLIENT_ID", vault.client_id)
    monkeypatch.setenv("AZURE_FEDERATED_TOKEN_FILE", str(vault.token_file))
    monkeypatch.setenv("AZURE_AUTHORITY_HOST", "https://login.microsoftonline.com")
    vault_url = vault.vault_url()  # (a new vault name each call)
    vault_host = vault_url.removeprefix("https://").split("/")[0]
    policy = POLICY.format(tcp_port=env["tcp"].port, client=MINT_CLIENT,
                           port=upstream.port)
    lines = len(squid.access_lines())
    gw = start_gateway(tmp_path, {}, env["ca"], policy=policy, extra={
        "secrets": {"store": "azure-keyvault", "vault_url": vault_url,
                    "credential": "workload"},
        "network": {"upstream_ca": str(env["bundle"]), "upstream_proxy": "env",
                    "allow_cidrs": ["127.0.0.1/32"], "resolve": {
                        vault_host: f"127.0.0.1:{vault.port}",
                        "login.microsoftonline.com": f"127.0.0.1:{vault.port}",
                        "api.corp.test": f"127.0.0.1:{upstream.port}"}}})
    try:
        token = gw.token("sbx-1")
        auth = "Basic " + base64.b64encode(f"sbx-1:{token}".encode()).decode()
        result = run(Spec(host="api.corp.test", target="/v1/from-vault",
                          proxy=("127.0.0.1", gw.proxy), proxy_auth=auth,
                          cafile=str(tmp_path / "certs" / "ca.crt"),
                          headers=[("Authorization", f"Bearer {token}")]))
        assert body(result)["path"] == "/v1/from-vault"
        assert seen_headers(upstream, "/v1/from-vault")["authorization"] == f"Bearer {API_KEY}"
        assert vault.count("api-key", authorized=True) >= 1
        assert_no_proxy_secret(json.dumps(gw.audit_lines()), result.body)
    finally:
        gw.stop()
    # (squid logs a CONNECT when its tunnel closes: the vault's, kept alive, at the stop)
    squid.wait_access(f"CONNECT 127.0.0.1:{vault.port}")
    connects = [line for line in squid.access_lines()[lines:] if "CONNECT" in line]
    assert sum(f"CONNECT 127.0.0.1:{vault.port}" in line for line in connects) >= 1, connects
    assert any(f"CONNECT 127.0.0.1:{upstream.port}" in line for line in connects), connects
    assert not any(".net" in line or "microsoftonline" in line for line in connects)
