"""Transparent mode for real: a sandbox network namespace whose TCP is REDIRECTed by
iptables into the gateway, which runs (as a real process) in its own namespace with
the upstream on a local address. Nothing leaves this machine: both namespaces are
private, linked only to each other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers.tls import LocalCA

ROOT = Path(__file__).resolve().parents[2]
NETNS = ROOT / "scripts" / "sandbox-netns.sh"
UPSTREAM_IP, CANARY_IP, SANDBOX_IP = "203.0.113.10", "203.0.113.20", "198.18.0.2"
ADMIN = "sandbox-gateway-test-admin-token"

pytestmark = pytest.mark.netns

POLICY = """
version: v1
name: agent
egress:
  - host: allowed.test           # passthrough
  - host: inspect.test
    inspect: true
  - host: key.test
    credential: key
credentials:
  key: {hosts: [key.test], secret: key-secret, inject: {header: X-Api-Key}}
"""

UPSTREAM = r"""
import json, ssl, sys, http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        body = json.dumps({"path": self.path, "headers": dict(self.headers)}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
srv = http.server.ThreadingHTTPServer((sys.argv[1], 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[2], sys.argv[3])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print("ready", flush=True); srv.serve_forever()
"""

CANARY = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 443)); s.listen(); print("ready", flush=True)
while True:
    c, _ = s.accept()
    with open(sys.argv[2], "a") as f:
        f.write("CONNECTED\n")
    c.close()
"""


def _root_with_netns() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "iptables", "curl"):
        if shutil.which(tool) is None:
            return f"{tool} is missing: run `make tools`"
    return None


@dataclass
class Lab:
    gw_ns: str
    sbx_ns: str
    workdir: Path
    ca: LocalCA
    gateway: subprocess.Popen[str]
    canary: subprocess.Popen[str]

    def sandbox_curl(self, url: str, ip: str, *args: str) -> subprocess.CompletedProcess[str]:
        host = url.split("/")[2]
        return subprocess.run(
            ["ip", "netns", "exec", self.sbx_ns, "curl", "-sS", "--max-time", "8",
             "--resolve", f"{host}:443:{ip}", *args, url],
            capture_output=True, text=True, timeout=20)

    def admin(self, method: str, path: str, body: dict[str, str] | None = None) -> str:
        cmd = ["ip", "netns", "exec", self.gw_ns, "curl", "-sS", "-X", method,
               "-H", f"Authorization: Bearer {ADMIN}", f"http://127.0.0.1:8090{path}"]
        if body is not None:
            cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout

    def mint(self) -> str:
        return str(json.loads(self.admin("POST", "/v1/tokens",
                                         {"sandbox": "sbx-1", "policy": "agent"}))["token"])

    def canary_hits(self) -> int:
        hits = self.workdir / "canary.log"
        return hits.read_text().count("CONNECTED") if hits.exists() else 0


def _wait_line(proc: subprocess.Popen[str], word: str, timeout: float = 15) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if word in line:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"process exited: {proc.returncode}")
    raise TimeoutError(word)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    why = _root_with_netns()
    if why:
        pytest.fail(why)
    tag = uuid.uuid4().hex[:6]
    gw_ns, sbx_ns = f"sgw{tag}", f"sbx{tag}"
    hosts_dir = Path("/etc/netns") / gw_ns
    procs: list[subprocess.Popen[str]] = []
    try:
        out = subprocess.run([str(NETNS), "up", sbx_ns, gw_ns, "8081"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode != 0:
            pytest.skip(f"the kernel refused the namespace setup: {out.stderr.strip()}")
        for ip in (UPSTREAM_IP, CANARY_IP):
            subprocess.run(["ip", "-n", gw_ns, "addr", "add", f"{ip}/32", "dev", "lo"],
                           check=True)
        # Name resolution inside the gateway namespace (ip netns exec bind-mounts it).
        hosts_dir.mkdir(parents=True, exist_ok=True)
        (hosts_dir / "hosts").write_text(
            "127.0.0.1 localhost\n"
            f"{UPSTREAM_IP} allowed.test inspect.test key.test evil.test\n")
        ca = LocalCA.create(tmp_path / "ca")
        cert, key = ca.issue(tmp_path, ["allowed.test", "inspect.test", "key.test",
                                        "evil.test"])
        up = subprocess.Popen(["ip", "netns", "exec", gw_ns, sys.executable, "-c", UPSTREAM,
                               UPSTREAM_IP, str(cert), str(key)], stdout=subprocess.PIPE,
                              text=True)
        procs.append(up)
        _wait_line(up, "ready")
        canary = subprocess.Popen(["ip", "netns", "exec", gw_ns, sys.executable, "-c",
                                   CANARY, CANARY_IP, str(tmp_path / "canary.log")],
                                  stdout=subprocess.PIPE, text=True)
        procs.append(canary)
        _wait_line(canary, "ready")
        (tmp_path / "policies").mkdir()
        (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
        secrets = tmp_path / "secrets.yaml"
        secrets.write_text("key-secret: real-key-for-key-test-0123456789\n")
        secrets.chmod(0o600)
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
            "listen": {"proxy": "127.0.0.1:8080", "admin": "127.0.0.1:8090",
                       "transparent": "0.0.0.0:8081"},
            "admin_token": ADMIN, "policies": "policies", "certs": "certs", "workers": 1,
            "secrets": {"store": "file", "path": str(secrets)},
            "network": {"allow_cidrs": ["203.0.113.0/24"], "upstream_ca": str(ca.cert_path)},
        }))
        gw = subprocess.Popen(
            ["ip", "netns", "exec", gw_ns, sys.executable, "-m", "gateway", "run",
             "--config", str(tmp_path / "gateway.yaml")],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(gw)
        deadline = time.monotonic() + 20
        lab = Lab(gw_ns, sbx_ns, tmp_path, ca, gw, canary)
        while time.monotonic() < deadline:
            if '"ready": true' in lab.admin("GET", "/readyz").replace('"ready":true',
                                                                      '"ready": true'):
                break
            if gw.poll() is not None:
                raise RuntimeError(gw.stderr.read() if gw.stderr else "gateway exited")
            time.sleep(0.2)
        else:
            raise TimeoutError("gateway not ready")
        yield lab
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        subprocess.run([str(NETNS), "down", sbx_ns, gw_ns], capture_output=True, timeout=30)
        shutil.rmtree(hosts_dir, ignore_errors=True)


def test_transparent_mode_end_to_end(lab: Lab) -> None:
    # Unregistered source, no token: refused (a passthrough host cannot be identified).
    r = lab.sandbox_curl("https://allowed.test/x", UPSTREAM_IP, "--cacert", str(lab.ca.cert_path))
    assert r.returncode != 0

    assert "198.18.0.2" in lab.admin("POST", "/v1/sandboxes",
                                     {"id": "sbx-1", "ip": SANDBOX_IP, "policy": "agent"})
    # Passthrough: the sandbox sees the upstream's own certificate (no gateway CA).
    r = lab.sandbox_curl("https://allowed.test/hello", UPSTREAM_IP,
                         "--cacert", str(lab.ca.cert_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == "/hello"
    # Intercepted: the sandbox trusts the gateway CA; the request is decided.
    gw_ca = str(lab.workdir / "certs" / "ca.crt")
    r = lab.sandbox_curl("https://inspect.test/in", UPSTREAM_IP, "--cacert", gw_ca)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == "/in"
    # A name the policy does not allow: refused.
    r = lab.sandbox_curl("https://evil.test/", UPSTREAM_IP, "--cacert", str(lab.ca.cert_path))
    assert r.returncode != 0
    # An allowed name paired with another address (spoofed): refused, never dialled.
    r = lab.sandbox_curl("https://allowed.test/", CANARY_IP, "--cacert", str(lab.ca.cert_path))
    assert r.returncode != 0
    assert lab.canary_hits() == 0

    # Unregistered again: identity from a gateway token in the credential carrier.
    assert "removed" in lab.admin("DELETE", f"/v1/sandboxes/{SANDBOX_IP}")
    token = lab.mint()
    r = lab.sandbox_curl("https://key.test/k", UPSTREAM_IP, "--cacert", gw_ca,
                         "-H", f"X-Api-Key: {token}")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)["headers"]
    # The upstream echoes the headers it got: the real key arrived (and the gateway
    # redacted its echo on the way back); the token did not.
    assert seen.get("X-Api-Key") == "[REDACTED]"
    assert token not in r.stdout
    r = lab.sandbox_curl("https://inspect.test/no-token", UPSTREAM_IP, "--cacert", gw_ca)
    assert '"unknown_sandbox"' in r.stdout
    assert lab.canary_hits() == 0


def test_netns_script_is_usable_by_hand() -> None:
    """The trial script documents its usage (and refuses unknown commands)."""
    out = subprocess.run([str(NETNS), "sideways"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr

