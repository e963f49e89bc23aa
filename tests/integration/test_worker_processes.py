"""`run --workers 2`: two real gateway processes behind one port pair (SO_REUSEPORT),
sharing revocations (state journal) and metrics (multiprocess files)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from helpers.clients import raw_connect

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "workers-test-admin-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_workers_share_ports_state_and_metrics(tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(
        "version: v1\nname: agent\negress:\n  - host: allowed.test\n")
    proxy, admin = _free_port(), _free_port()
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": {"proxy": f"127.0.0.1:{proxy}", "admin": f"127.0.0.1:{admin}"},
        "admin_token": ADMIN, "policies": "policies", "certs": "certs",
        "secrets": {"store": "env"}, "runtime_dir": "runtime",
    }))
    audit = (tmp_path / "audit.log").open("w")
    gw = subprocess.Popen(
        [sys.executable, "-m", "gateway", "run", "--workers", "2", "--config",
         str(tmp_path / "gateway.yaml")],
        cwd=ROOT, stdout=audit, stderr=subprocess.PIPE, text=True)
    try:
        assert gw.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = gw.stderr.readline()
            if "ready: 2 workers" in line:
                break
            assert gw.poll() is None, gw.stderr.read()
        children = subprocess.run(["pgrep", "-P", str(gw.pid)], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) == 2

        auth = {"Authorization": f"Bearer {ADMIN}"}
        minted = httpx.post(f"http://127.0.0.1:{admin}/v1/tokens", headers=auth,
                            json={"sandbox": "s", "policy": "agent"}).json()
        for _ in range(30):  # new connections: the kernel spreads them over both workers
            status, _, body = raw_connect(("127.0.0.1", proxy), "refused.test:443",
                                          minted["token"], sandbox="s")
            assert status == 403 and body is not None and body["error"] == "policy_denied"
        # A revocation made on whichever worker answers applies on both.
        assert httpx.post(f"http://127.0.0.1:{admin}/v1/tokens/revoke", headers=auth,
                          json={"jti": minted["jti"]}).status_code == 200
        time.sleep(0.6)
        for _ in range(30):
            status, _, body = raw_connect(("127.0.0.1", proxy), "refused.test:443",
                                          minted["token"], sandbox="s")
            assert status == 407 and body is not None and body["error"] == "token_revoked"
        # Metrics from any worker are the sum over both.
        text = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
        denied = [ln for ln in text.splitlines()
                  if ln.startswith("sandbox_gateway_requests_total{") and 'decision="deny"' in ln]
        assert sum(float(ln.rsplit(" ", 1)[1]) for ln in denied) == 60
    finally:
        gw.send_signal(signal.SIGTERM)
        code = gw.wait(20)
        audit.close()
        if gw.stderr is not None:
            gw.stderr.close()
    assert code == 0
    assert subprocess.run(["pgrep", "-P", str(gw.pid)], capture_output=True).stdout == b""
    workers = {json.loads(line).get("worker")
               for line in (tmp_path / "audit.log").read_text().splitlines() if line}
    assert workers == {0, 1}, workers
