"""What `run` prints at start (a real process, both banners): the admin token's file, never
the token; warnings about risky settings, once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("workers", [1, 2])
def test_banner_never_prints_the_admin_token(tmp_path: Path, workers: int) -> None:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(
        "version: v1\nname: agent\negress:\n  - host: allowed.test\n")
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "policies": "policies", "certs": "certs", "secrets": {"store": "env"},
        "network": {"allow_cidrs": ["0.0.0.0/0"]},
    }))
    gw = subprocess.Popen(
        [sys.executable, "-m", "gateway", "run", "--workers", str(workers), "--config",
         str(tmp_path / "gateway.yaml")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    try:
        assert gw.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("admin token:" in s for s in seen):
            line = gw.stderr.readline()
            assert line or gw.poll() is None, "".join(seen)
            seen.append(line)
    finally:
        gw.send_signal(signal.SIGTERM)
        out, err = gw.communicate(timeout=30)
    text = "".join(seen) + err + out
    token = (tmp_path / "certs" / "admin-token").read_text().strip()
    assert len(token) >= 32 and token not in text
    assert f"admin token: generated into {tmp_path / 'certs' / 'admin-token'}" in text
    assert (tmp_path / "certs" / "admin-token").stat().st_mode & 0o077 == 0
    warnings = [ln for ln in text.splitlines() if "0.0.0.0/0 covers all of IPv4" in ln]
    assert len(warnings) == 1 and "WARNING" in warnings[0], text  # once, not per worker
