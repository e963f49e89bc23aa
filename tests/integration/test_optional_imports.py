"""Optional subsystems are imported only when configured or first needed (issue 22,
memory): the Azure SDK for `secrets.store: azure-keyvault`, aiohttp for minted
credentials, dnspython for `listen.dns`, and mitmproxy's engine (its proxy server and
layers, h2, aioquic, its command parser; with `network.intercept: fast`) at the first
HTTP/2-only client, then with only the addons the gateway runs. Measured before: every
gateway process imported all of them (37 MB of its ~100 MB at start, then ~20 MB of
mitmproxy's engine). The real `sandbox-gateway run`, under `python -X importtime`."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml
from helpers.process import free_port

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("azure", "msal", "aiohttp", "dns")
MINTED = """
credentials:
  internal:
    type: oauth2-client-credentials
    token_url: https://login.example.test/oauth2/token
    client_id: gateway-client
    client_secret: oauth-client-secret
    hosts: [api.internal.test]
"""


def _imported(tmp_path: Path, policy_extra: str = "", dns: bool = False,
              then: Callable[[int], None] | None = None) -> set[str]:
    """The modules a gateway process imported by the time it was ready (and `then(proxy
    port)` had run)."""
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(
        "version: v1\nname: agent\negress:\n  - host: allowed.test\n" + policy_extra)
    admin = free_port()
    proxy = free_port()
    listen = {"proxy": f"127.0.0.1:{proxy}", "admin": f"127.0.0.1:{admin}"}
    if dns:
        listen["dns"] = f"127.0.0.1:{free_port()}"
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": listen, "policies": "policies", "certs": "certs", "workers": 1,
        "secrets": {"store": "env"}, "audit": {"path": str(tmp_path / "audit.log")},
        "network": {"resolve": {"allowed.test": f"127.0.0.1:{free_port()}"}}}))
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "gateway", "run",
                                 "--config", str(tmp_path / "gateway.yaml")],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, log.read_text()[-2000:]
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "not ready in 30 s"
                    time.sleep(0.1)
            if then is not None:
                then(proxy)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
    return {line.rsplit("|", 1)[1].strip()
            for line in log.read_text().splitlines() if line.startswith("import time:")}


def _packages(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


ENGINE = ("mitmproxy.master", "mitmproxy.proxy.server", "mitmproxy.proxy.layers.http",
          "mitmproxy.proxy.layers.quic", "h2.connection", "aioquic", "pyparsing")
# What reading a ClientHello through mitmproxy's TLS layer module brought along (its
# proxy core: options with ruamel.yaml, connection types, the Rust extension; 5 MiB):
# the doors read it with the parser alone (`patches.client_hello`).
PROXY_CORE = ("mitmproxy.proxy.layers.tls", "mitmproxy.options", "mitmproxy.connection",
              "ruamel.yaml", "mitmproxy_rs")


# Imported at their first use (issue 41: 1.8 MiB of an idle worker): Hyperscan at the
# first request whose tokens or keys the leak guard looks for (or the DLP detectors),
# zstandard and backports.zstd at the first zstd body.
FIRST_USE = ("hyperscan", "zstandard", "backports")


def test_a_plain_gateway_imports_no_optional_subsystem(tmp_path: Path) -> None:
    modules = _imported(tmp_path)
    imported = _packages(modules)
    assert "mitmproxy" in imported  # (the check sees what is imported: certs, ClientHello)
    assert not imported & set(OPTIONAL), sorted(imported & set(OPTIONAL))
    assert not imported & set(FIRST_USE), sorted(imported & set(FIRST_USE))
    assert not modules & set(ENGINE), sorted(modules & set(ENGINE))
    assert not modules & set(PROXY_CORE), sorted(modules & set(PROXY_CORE))
    assert not any(m.startswith("mitmproxy.addons.") for m in modules)


def test_a_gateway_with_dlp_builds_its_detectors_without_requests(tmp_path: Path) -> None:
    """A policy with `dlp:` builds the detectors at start (detect-secrets, Hyperscan);
    the plugins' `requests` (for verify calls the gateway never makes: 5 MiB) is not
    imported (services/dlp/detectors.py)."""
    imported = _packages(_imported(tmp_path, "dlp: {action: refuse}\n"))
    assert {"detect_secrets", "hyperscan"} <= imported
    assert not imported & {"requests", "urllib3", "charset_normalizer"}


# A gateway process needs none of the other commands' modules (gateway/cli/__init__.py
# registers `run` alone for `run`), nor uvicorn's command line, prometheus_client's HTTP
# servers and push clients, or PyJWT's JWKS client (`patches.LEAN`): ~3 MB of a worker's
# idle memory (issue 41).
COMMAND_LINES = ("gateway.cli.token", "gateway.cli.policy", "gateway.cli.approvals",
                 "gateway.cli.mcp_oauth", "gateway.cli.usage", "gateway.cli.env",
                 "uvicorn.main", "click", "multiprocessing", "prometheus_client.exposition",
                 "http.server", "wsgiref", "jwt.jwks_client", "urllib.request")


def test_a_gateway_process_holds_no_command_line_but_its_own(tmp_path: Path) -> None:
    modules = _imported(tmp_path)
    assert {"uvicorn.server", "uvicorn.config", "prometheus_client.metrics",
            "jwt.api_jwt"} <= modules
    assert not modules & set(COMMAND_LINES), sorted(modules & set(COMMAND_LINES))


def test_metrics_are_served_after_a_lean_start(tmp_path: Path) -> None:
    """/metrics imports prometheus_client's exposition at its first scrape."""
    def scrape(proxy: int) -> None:
        del proxy
        admin = yaml.safe_load((tmp_path / "gateway.yaml").read_text())["listen"]["admin"]
        with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
            assert r.headers["content-type"].startswith("text/plain; version=")
            assert b"sandbox_gateway_requests_total" in r.read()

    assert "prometheus_client.exposition" in _imported(tmp_path, then=scrape)


LEAN = """
import sys
from gateway.engines.patches import LEAN, lean_dependencies
lean_dependencies()
import uvicorn
from uvicorn.lifespan.off import LifespanOff  # (imports Config from the package)
from uvicorn.protocols.http.h11_impl import H11Protocol
from prometheus_client import multiprocess  # (a submodule: imported as usual)
lean = {p: {n: getattr(sys.modules[p], n) for n in names} for p, names in LEAN.items()}
heavy = ("click", "uvicorn.main", "prometheus_client.exposition", "http.server",
         "jwt.jwks_client", "urllib.request")
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
assert LifespanOff and H11Protocol and multiprocess.MultiProcessCollector
assert callable(uvicorn.run) and uvicorn.__version__  # (the whole package, on demand)
import jwt, prometheus_client
assert callable(jwt.PyJWKClient) and prometheus_client.generate_latest
for package, names in lean.items():  # the same objects as the whole package's
    for name, value in names.items():
        assert getattr(sys.modules[package], name) is value, (package, name)
assert "uvicorn.main" in sys.modules and "jwt.jwks_client" in sys.modules
print("ok")
"""


def test_lean_packages_still_have_every_name() -> None:
    out = subprocess.run([sys.executable, "-c", LEAN], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def _http2_client(proxy: int) -> None:
    """A tunnel whose ClientHello offers only h2: the front door hands it to mitmproxy."""
    with socket.create_connection(("127.0.0.1", proxy), timeout=10) as sock:
        sock.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n"
                     b"Proxy-Authorization: Basic " + _basic_token() + b"\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # (the hand-off, not the certificate, is tested)
        context.set_alpn_protocols(["h2"])
        try:
            with context.wrap_socket(sock, server_hostname="allowed.test") as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                tls.recv(1)
        except (OSError, ssl.SSLError):
            pass  # (allowed.test resolves nowhere: mitmproxy may end the tunnel; loaded)


def _basic_token() -> bytes:
    import base64

    token = subprocess.run(
        [sys.executable, "-m", "gateway", "token", "mint", "--config", str(_CONFIG[0]),
         "--sandbox", "s", "--policy", "agent"], cwd=ROOT, capture_output=True, text=True,
        check=True, timeout=60).stdout.strip()
    return base64.b64encode(f"s:{token}".encode())


_CONFIG: list[Path] = []


def test_mitmproxy_is_loaded_at_the_first_http2_client(tmp_path: Path) -> None:
    """mitmproxy's engine comes with the first connection handed to it, with the four
    addons the gateway runs, not the thirty mitmdump loads (`patches.lean_packages`)."""
    _CONFIG[:] = [tmp_path / "gateway.yaml"]
    modules = _imported(tmp_path, "    methods: [GET]\n", then=_http2_client)  # (inspected)
    assert set(ENGINE[:4]) <= modules, sorted(set(ENGINE) - modules)
    assert set(PROXY_CORE) <= modules  # (mitmproxy's engine does load them)
    addons = {m.split(".")[2] for m in modules if m.startswith("mitmproxy.addons.")}
    assert {"core", "proxyserver", "tlsconfig", "next_layer"} <= addons
    assert "blocklist" not in addons and "proxyauth" not in addons, sorted(addons)
    assert "ldap3" not in _packages(modules)  # (proxyauth's)
    assert "mitmproxy engine started" in (tmp_path / "stderr.txt").read_text()


def test_the_dns_resolver_imports_dnspython(tmp_path: Path) -> None:
    assert "dns" in _packages(_imported(tmp_path, dns=True))


def test_a_minted_credential_imports_aiohttp_at_its_first_mint_only(tmp_path: Path) -> None:
    imported = _packages(_imported(tmp_path, MINTED))
    assert "aiohttp" not in imported and "azure" not in imported
