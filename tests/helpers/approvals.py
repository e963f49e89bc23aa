"""Ask mode against a real gateway: start one that asks, make a sandbox's request that
is held while the test answers (`Call`, or a raw CONNECT), and read or answer the
approvals through the admin API. Shared by tests/integration/test_approvals.py and the
console's browser tests."""

from __future__ import annotations

import base64
import contextlib
import socket
import ssl
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from helpers.clients import raw_connect
from helpers.gateway import GatewayThread
from helpers.process import ADMIN, GatewayProcess, start_gateway
from helpers.tls import LocalCA
from helpers.upstream import Upstream

__all__ = ["Call", "Workers", "admin_api", "admin_token", "ask_gateway", "connect",
           "pending", "workers_gateway"]


def ask_gateway(workdir: Path, test_ca: LocalCA, upstream: Upstream, names: list[str],
                policy: str, config: dict[str, Any] | None = None) -> GatewayThread:
    """A gateway on `workdir` with `policy` as policies/agent.yaml, every name of `names`
    resolved to the local upstream (and metadata.test to the metadata address)."""
    policies = workdir / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    (policies / "agent.yaml").write_text(policy)
    extra = dict(config or {})
    cfg: dict[str, Any] = {
        "network": {"upstream_ca": str(test_ca.cert_path),
                    "resolve": {**{n: f"127.0.0.1:{upstream.port}" for n in names},
                                "metadata.test": "169.254.169.254:443"},
                    **extra.pop("network", {})},
        "secrets": {"store": "env"}, **extra}
    return GatewayThread(workdir, cfg)


class Workers:
    """`run --workers N` (helpers/process.py) as `Call` and the admin helpers use a
    gateway: the same methods as `GatewayThread` where they apply."""

    def __init__(self, process: GatewayProcess, ca: LocalCA) -> None:
        self.process = process
        self.admin = f"http://127.0.0.1:{process.admin}"
        self.ca_cert = process.workdir / "certs" / "ca.crt"
        self.config = SimpleNamespace(network=SimpleNamespace(upstream_ca=ca.cert_path))

    def mint(self, policy: str, sandbox: str = "sandbox-1") -> str:
        assert policy == "agent"
        return self.process.token(sandbox)

    def proxy_url(self, token: str, sandbox: str = "sandbox-1") -> str:
        return f"http://{sandbox}:{token}@127.0.0.1:{self.process.proxy}"


def workers_gateway(workdir: Path, test_ca: LocalCA, upstream: Upstream, names: list[str],
                    policy: str, workers: int = 2) -> Workers:
    """`run --workers N` on `workdir` with `policy`, once every worker answers."""
    process = start_gateway(workdir, dict.fromkeys(names, upstream.port), test_ca,
                            workers=workers, policy=policy)
    gw = Workers(process, test_ca)
    deadline = time.monotonic() + 30
    while {line.get("worker") for line in process.audit_lines()} != set(range(workers)):
        assert time.monotonic() < deadline, "not every worker answered"
        with contextlib.suppress(OSError):  # (refused, audited by whichever worker)
            raw_connect(("127.0.0.1", process.proxy), "nowhere.invalid:443", None)
        time.sleep(0.05)
    return gw


def admin_token(gw: GatewayThread | Workers) -> str:
    """The gateway's admin token (certs/admin-token, or a process's config)."""
    if isinstance(gw, Workers):
        return ADMIN
    return (gw.config.certs / "admin-token").read_text().strip()


def admin_api(gw: GatewayThread | Workers, method: str, path: str, body: Any = None) -> Any:
    """An admin API call that must succeed; its JSON."""
    answer = httpx.request(method, gw.admin + path, json=body, timeout=10,
                           headers={"Authorization": f"Bearer {admin_token(gw)}"})
    assert answer.status_code < 300, answer.text
    return answer.json()


def pending(gw: GatewayThread | Workers, count: int = 1, timeout: float = 10
            ) -> list[dict[str, Any]]:
    """The pending approvals, once there are at least `count`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [a for a in admin_api(gw, "GET", "/v1/approvals")["approvals"]
                 if a["state"] == "pending"]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no {count} pending approval(s)")


class Call(threading.Thread):
    """A sandbox's request through the gateway, run while the test answers."""

    def __init__(self, gw: GatewayThread | Workers, url: str, sandbox: str = "sbx-1",
                 method: str = "GET", headers: dict[str, str] | None = None,
                 json: Any = None, send_token: bool = False) -> None:
        super().__init__(daemon=True)
        self.token = gw.mint("agent", sandbox)
        self.proxy = gw.proxy_url(self.token, sandbox)
        # (a host grant is passed through: the upstream's own certificate arrives)
        self.verify = ssl.create_default_context(cafile=str(gw.ca_cert))
        self.verify.load_verify_locations(cafile=str(gw.config.network.upstream_ca))
        self.url, self.method, self.json = url, method, json
        # send_token: the sandbox's own token as the API key (as an SDK given it sends it)
        self.headers = {**({"Authorization": f"Bearer {self.token}"} if send_token else {}),
                        **(headers or {})}
        self.answer: httpx.Response | None = None
        self.error: Exception | None = None
        self.took = 0.0
        self.start()

    def run(self) -> None:
        started = time.monotonic()
        try:
            with httpx.Client(proxy=self.proxy, verify=self.verify, timeout=60) as client:
                self.answer = client.request(self.method, self.url, headers=self.headers,
                                             json=self.json)
        except Exception as exc:  # (the test reads it)
            self.error = exc
        self.took = time.monotonic() - started

    def result(self) -> httpx.Response:
        self.join(60)
        assert self.answer is not None, self.error
        return self.answer


def connect(gw: GatewayThread, host: str, sandbox: str) -> socket.socket:
    """A raw CONNECT to `host`:443 as `sandbox` (its answer left to read)."""
    token = gw.mint("agent", sandbox)
    proxy_host, proxy_port = gw.gateway.proxy_address  # type: ignore[misc]
    sock = socket.create_connection((proxy_host, proxy_port), timeout=30)
    auth = base64.b64encode(f"{sandbox}:{token}".encode()).decode()
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n"
                 f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode())
    return sock
