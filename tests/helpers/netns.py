"""A transparent-mode lab: a sandbox network namespace whose TCP is REDIRECTed by
iptables into a gateway process running in its own namespace, with a TLS upstream and a
canary on local addresses there. Nothing leaves this machine: both namespaces are
private, linked only to each other (scripts/sandbox-netns.sh)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from helpers.tls import LocalCA

ROOT = Path(__file__).resolve().parents[2]
NETNS = ROOT / "scripts" / "sandbox-netns.sh"
HELPERS = Path(__file__).resolve().parent
UPSTREAM_IP, CANARY_IP, SANDBOX_IP = "203.0.113.10", "203.0.113.20", "198.18.0.2"
ADMIN = "sandbox-gateway-test-admin-token"

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


def unavailable() -> str | None:
    """Why the lab cannot run here, or None."""
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
    _procs: list[subprocess.Popen[str]] = field(default_factory=list)  # (ended with the lab)
    _client: subprocess.Popen[str] | None = None  # (`sandbox_client`'s)

    @property
    def gateway_ca(self) -> Path:
        return self.workdir / "certs" / "ca.crt"

    def sandbox_curl(self, url: str, ip: str, *args: str) -> subprocess.CompletedProcess[str]:
        host = url.split("/")[2]
        return subprocess.run(
            ["ip", "netns", "exec", self.sbx_ns, "curl", "-sS", "--max-time", "8",
             "--resolve", f"{host}:443:{ip}", *args, url],
            capture_output=True, text=True, timeout=20)

    def sandbox_client(self, spec: dict[str, Any] | list[dict[str, Any]]) -> Any:
        """Run helpers/parity.py's client inside the sandbox namespace; its JSON result (a
        list of them for a list of specs, one after the other). One client process
        (`parity.py --serve`) answers every call of the lab, a spec a line on its stdin
        (a Python start for each was most of a parity case's time); up to 120 s each."""
        client = self._client
        if client is None or client.poll() is not None:
            with (self.workdir / "client.log").open("a") as log:
                client = self._client = subprocess.Popen(
                    ["ip", "netns", "exec", self.sbx_ns, sys.executable,
                     str(HELPERS / "parity.py"), "--serve"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log, text=True)
            self._procs.append(client)
        assert client.stdin is not None and client.stdout is not None
        client.stdin.write(json.dumps(spec) + "\n")
        client.stdin.flush()
        ready, _, _ = select.select([client.stdout], [], [], 120)
        line = client.stdout.readline() if ready else ""
        log = self.workdir / "client.log"
        assert line, f"no answer from the sandbox client: {log.read_text()[-3000:]}"
        return json.loads(line)

    @property
    def gateway_log(self) -> str:
        """The gateway process's stderr so far."""
        return (self.workdir / "gateway.log").read_text(errors="replace")

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> str:
        cmd = ["ip", "netns", "exec", self.gw_ns, "curl", "-sS", "-X", method,
               "-H", f"Authorization: Bearer {ADMIN}", f"http://127.0.0.1:8090{path}"]
        if body is not None:
            cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout

    def mint(self, sandbox: str = "sbx-1", policy: str = "agent", **extra: Any) -> str:
        return str(json.loads(self.admin("POST", "/v1/tokens", {
            "sandbox": sandbox, "policy": policy, **extra}))["token"])

    def register(self, sandbox: str = "sbx-1", policy: str = "agent") -> None:
        assert SANDBOX_IP in self.admin("POST", "/v1/sandboxes",
                                        {"id": sandbox, "ip": SANDBOX_IP, "policy": policy})

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until the gateway process has no client connection open (every engine
        writes a connection's last line, a tunnel's, before it uncounts it) and the
        lines their ends wrote are in the audit file: its /metrics says none open, then
        once more (the sink writes a tick's lines at the end of the tick, before the
        loop reads the next request). AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while (count := self._open_connections()) != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"{count} connections still open in the gateway after "
                                     f"{timeout:g} s")
            time.sleep(0.002)
        self._open_connections()

    def _open_connections(self) -> float:
        """The gateway's `sandbox_gateway_open_connections`, read over a socket of its
        namespace (no process started: a `curl` through `ip netns exec` took 20 ms)."""
        with _socket_in(self.gw_ns) as sock:
            sock.settimeout(10)
            sock.connect(("127.0.0.1", 8090))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Connection: close\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        for line in data.decode("latin-1").splitlines():
            if line.startswith("sandbox_gateway_open_connections "):
                return float(line.split()[1])
        raise AssertionError(f"no open_connections gauge in /metrics: {data[:300]!r}")

    def audit(self) -> list[dict[str, Any]]:
        path = self.workdir / "audit.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def audit_until(self, wanted: Callable[[dict[str, Any]], bool],
                    timeout: float = 10.0) -> list[dict[str, Any]]:
        """The audit lines once one is `wanted`: an exchange's line is written once its
        answer has gone out, so it may follow the client's exit by a moment (empty
        after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.audit()
            if any(wanted(line) for line in lines) or time.monotonic() > deadline:
                return [line for line in lines if wanted(line)]
            time.sleep(0.05)

    def upstream_seen(self) -> list[dict[str, Any]]:
        path = self.workdir / "upstream.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def canary_hits(self) -> int:
        hits = self.workdir / "canary.log"
        return hits.read_text().count("CONNECTED") if hits.exists() else 0


def _socket_in(namespace: str) -> socket.socket:
    """A TCP socket of network namespace `namespace`: made on a thread of its own that
    entered it (a namespace is per thread; a socket keeps the one it was made in, and
    the thread ends with the change)."""
    made: list[socket.socket | BaseException] = []

    def make() -> None:
        try:
            with open(f"/run/netns/{namespace}") as ns:
                os.setns(ns.fileno(), os.CLONE_NEWNET)
            made.append(socket.socket())
        except BaseException as exc:  # (raised on the caller's thread)
            made.append(exc)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


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


@contextlib.contextmanager
def transparent_lab(workdir: Path, *, policy: str, names: list[str],
                    secrets: dict[str, str], resolve: dict[str, str] | None = None,
                    log_level: str = "info", intercept: str = "fast",
                    extra: Callable[[str], dict[str, Any]] | None = None) -> Iterator[Lab]:
    """Start the lab (the caller skips or fails when `unavailable()` says why); the
    gateway's stderr goes to `workdir/gateway.log` (`Lab.gateway_log`). `extra`: called
    with the gateway's namespace once it is up, returns more gateway configuration
    (e.g. `identity` for an API server started in that namespace)."""
    tag = uuid.uuid4().hex[:6]
    gw_ns, sbx_ns = f"sgw{tag}", f"sbx{tag}"
    hosts_dir = Path("/etc/netns") / gw_ns
    procs: list[subprocess.Popen[str]] = []
    try:
        out = subprocess.run([str(NETNS), "up", sbx_ns, gw_ns, "8081"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"the kernel refused the namespace setup: {out.stderr.strip()}")
        for ip in (UPSTREAM_IP, CANARY_IP):
            subprocess.run(["ip", "-n", gw_ns, "addr", "add", f"{ip}/32", "dev", "lo"],
                           check=True)
        # Name resolution inside the gateway namespace (ip netns exec bind-mounts it).
        hosts_dir.mkdir(parents=True, exist_ok=True)
        (hosts_dir / "hosts").write_text(
            "127.0.0.1 localhost\n" + f"{UPSTREAM_IP} {' '.join(names)} evil.test\n")
        ca = LocalCA.create(workdir / "ca")
        cert, key = ca.issue(workdir, [*names, "evil.test"])
        up = subprocess.Popen(
            ["ip", "netns", "exec", gw_ns, sys.executable, str(HELPERS / "upstream.py"),
             UPSTREAM_IP, "443", str(cert), str(key), str(workdir / "upstream.jsonl")],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"})
        procs.append(up)
        _wait_line(up, "ready")
        plain = subprocess.Popen(
            ["ip", "netns", "exec", gw_ns, sys.executable, str(HELPERS / "upstream.py"),
             UPSTREAM_IP, "80", "-", "-", str(workdir / "upstream.jsonl")],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT}"})
        procs.append(plain)
        _wait_line(plain, "ready")
        canary = subprocess.Popen(["ip", "netns", "exec", gw_ns, sys.executable, "-c",
                                   CANARY, CANARY_IP, str(workdir / "canary.log")],
                                  stdout=subprocess.PIPE, text=True)
        procs.append(canary)
        _wait_line(canary, "ready")
        (workdir / "policies").mkdir()
        (workdir / "policies" / "agent.yaml").write_text(policy)
        secrets_file = workdir / "secrets.yaml"
        secrets_file.write_text("".join(f"{k}: {v}\n" for k, v in secrets.items()))
        secrets_file.chmod(0o600)
        network: dict[str, Any] = {"allow_cidrs": ["203.0.113.0/24"],
                                   "upstream_ca": str(ca.cert_path), "intercept": intercept}
        if resolve:
            network["resolve"] = resolve
        (workdir / "gateway.yaml").write_text(yaml.safe_dump({
            "listen": {"proxy": "127.0.0.1:8080", "admin": "127.0.0.1:8090",
                       "transparent": "0.0.0.0:8081"},
            "admin_token": ADMIN, "policies": "policies", "certs": "certs", "workers": 1,
            "secrets": {"store": "file", "path": str(secrets_file)},
            "audit": {"path": str(workdir / "audit.jsonl")},
            "network": network, "log_level": log_level,
            **(extra(gw_ns) if extra is not None else {}),
        }))
        with (workdir / "gateway.log").open("w") as log:
            gw = subprocess.Popen(
                ["ip", "netns", "exec", gw_ns, sys.executable, "-m", "gateway", "run",
                 "--config", str(workdir / "gateway.yaml")],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
        procs.append(gw)
        lab = Lab(gw_ns, sbx_ns, workdir, ca, procs)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if '"ready":true' in lab.admin("GET", "/readyz").replace(" ", ""):
                break
            if gw.poll() is not None:
                raise RuntimeError(lab.gateway_log or "gateway exited")
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
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        subprocess.run([str(NETNS), "down", sbx_ns, gw_ns], capture_output=True, timeout=30)
        shutil.rmtree(hosts_dir, ignore_errors=True)
