"""Console sessions on real gateways, with httpx: sign-out ends the session in the state
store (the old cookie replayed is refused), on one process and across `run --workers
2`; a new admin token (a new console key) ends every session; behind a real nginx TLS
reverse proxy that reaches the admin listener from 127.0.0.2, sign-in works and the
cookie is `Secure` only when `console.trusted_proxies` names the proxy."""

from __future__ import annotations

import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from helpers.gateway import GatewayThread
from helpers.nginx import Nginx
from helpers.tls import LocalCA

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "console-sessions-admin-token-0123456789"
POLICY = "version: v1\nname: agent\negress: []\n"


def _sign_in(base: str, origin: str | None = None, verify: ssl.SSLContext | bool = True,
             token: str = ADMIN) -> httpx.Response:
    headers = {"Origin": origin} if origin else {}
    with httpx.Client(verify=verify, timeout=10) as client:
        return client.post(f"{base}/console/login", data={"token": token}, headers=headers)


def _cookie(answer: httpx.Response) -> str:
    assert answer.status_code == 303, answer.text
    found = re.search(r"sgw_console=([^;]+)", answer.headers["set-cookie"])
    assert found is not None
    return found.group(1)


def _get(base: str, cookie: str, verify: ssl.SSLContext | bool = True) -> httpx.Response:
    """A page, on a new connection each time (a worker of the kernel's choosing)."""
    with httpx.Client(verify=verify, timeout=10, cookies={"sgw_console": cookie}) as client:
        return client.get(f"{base}/console/grants")


def _sign_out(base: str, cookie: str, everywhere: bool = False,
              verify: ssl.SSLContext | bool = True, origin: str | None = None
              ) -> httpx.Response:
    page = _get(base, cookie, verify)
    assert page.status_code == 200, page.text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf is not None
    with httpx.Client(verify=verify, timeout=10, cookies={"sgw_console": cookie}) as client:
        return client.post(f"{base}/console/logout",
                           data={"csrf": csrf.group(1), **({"everywhere": "1"}
                                                          if everywhere else {})},
                           headers={"Origin": origin} if origin else {})


def _gateway(workdir: Path, admin_token: str = ADMIN, **config: object) -> GatewayThread:
    (workdir / "policies").mkdir(exist_ok=True)
    (workdir / "policies" / "agent.yaml").write_text(POLICY)
    return GatewayThread(workdir, {"admin_token": admin_token, "secrets": {"store": "env"},
                                   **config})


def test_sign_out_ends_the_session_and_a_new_admin_token_ends_them_all(
        tmp_path: Path) -> None:
    gw = _gateway(tmp_path)
    try:
        first = _cookie(_sign_in(gw.admin))
        second = _cookie(_sign_in(gw.admin))
        third = _cookie(_sign_in(gw.admin))
        assert _get(gw.admin, first).status_code == 200
        out = _sign_out(gw.admin, first)
        assert out.status_code == 303 and out.headers["location"] == "/console/login"
        # the old cookie, replayed: refused (the session ended in the store)
        replayed = _get(gw.admin, first)
        assert replayed.status_code == 303 and replayed.headers["location"] == "/console/login"
        assert _get(gw.admin, second).status_code == 200
        assert _sign_out(gw.admin, second, everywhere=True).status_code == 303
        assert _get(gw.admin, second).headers["location"] == "/console/login"
        assert _get(gw.admin, third).headers["location"] == "/console/login"
        fourth = _cookie(_sign_in(gw.admin))
    finally:
        gw.stop()
    # the same state file, the same token: the session outlives a restart...
    gw = _gateway(tmp_path)
    try:
        assert _get(gw.admin, fourth).status_code == 200
    finally:
        gw.stop()
    # ...and a new admin token (a new console key) ends it
    gw = _gateway(tmp_path, admin_token="a-rotated-admin-token-9876543210")
    try:
        assert _get(gw.admin, fourth).headers["location"] == "/console/login"
        assert _cookie(_sign_in(gw.admin, token="a-rotated-admin-token-9876543210"))
    finally:
        gw.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[str]:
    """`run --workers 2`; the admin listener's base URL."""
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
    proxy, admin = _free_port(), _free_port()
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": {"proxy": f"127.0.0.1:{proxy}", "admin": f"127.0.0.1:{admin}"},
        "admin_token": ADMIN, "policies": "policies", "certs": "certs",
        "secrets": {"store": "env"}, "runtime_dir": "runtime"}))
    gw = subprocess.Popen([sys.executable, "-m", "gateway", "run", "--workers", "2",
                           "--config", str(tmp_path / "gateway.yaml")],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    assert gw.stderr is not None
    said: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "ready: 2 workers" not in (said or [""])[-1]:
        said.append(gw.stderr.readline())
        assert gw.poll() is None, "".join(said) + gw.stderr.read()
    try:
        yield f"http://127.0.0.1:{admin}"
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(20)
        gw.stderr.close()


def test_sign_out_on_one_worker_ends_the_session_on_both(two_workers: str) -> None:
    base = two_workers
    cookie = _cookie(_sign_in(base))
    # new connections: the kernel spreads them over both workers, each reads the store
    assert all(_get(base, cookie).status_code == 200 for _ in range(20))
    assert _sign_out(base, cookie).status_code == 303
    replays = [_get(base, cookie) for _ in range(20)]
    assert all(r.status_code == 303 and r.headers["location"] == "/console/login"
               for r in replays)


def _proxied(tmp_path: Path, test_ca: LocalCA, admin: str) -> Nginx:
    """nginx terminating TLS on 127.0.0.1 and reaching the admin listener from 127.0.0.2
    (a proxy that is not on 127.0.0.1, as the gateway sees it)."""
    return Nginx(tmp_path / "nginx", test_ca, ["localhost"], locations=f"""
    location /console {{
      proxy_pass {admin};
      proxy_bind 127.0.0.2;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_set_header X-Forwarded-Host $http_host;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
    }}""")


@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_behind_a_tls_proxy(tmp_path: Path, test_ca: LocalCA, trusted: bool) -> None:
    gw = _gateway(tmp_path, **({"console": {"trusted_proxies": ["127.0.0.2"]}}
                               if trusted else {}))
    nginx = _proxied(tmp_path, test_ca, gw.admin)
    verify = ssl.create_default_context(cafile=str(test_ca.cert_path))
    base = origin = f"https://localhost:{nginx.port}"
    try:
        answer = _sign_in(base, origin, verify)
        if not trusted:
            # the proxy's headers are ignored: the browser's origin is not the one the
            # admin listener sees, and a sign-in without Origin gets no Secure cookie
            assert answer.status_code == 403 and "set-cookie" not in answer.headers
            plain = _sign_in(base, None, verify)
            assert "secure" not in plain.headers["set-cookie"].lower()
            return
        cookie = _cookie(answer)
        assert "secure" in answer.headers["set-cookie"].lower().split("; ")
        assert _get(base, cookie, verify).status_code == 200
        foreign = _sign_out(base, cookie, verify=verify, origin="https://evil.example")
        assert foreign.status_code == 403
        out = _sign_out(base, cookie, verify=verify, origin=origin)
        assert out.status_code == 303
        assert _get(base, cookie, verify).headers["location"] == "/console/login"
        assert any(" 303 " in line for line in nginx.access_lines())
    finally:
        nginx.stop()
        gw.stop()
