"""`run --workers 2`: two real gateway processes behind one port pair (SO_REUSEPORT),
sharing revocations (the SQLite state file) and metrics (multiprocess files)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from helpers.clients import raw_connect

from gateway.runtime.allocator import find_jemalloc

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "workers-test-admin-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_workers(tmp_path: Path, stdout: Any = subprocess.DEVNULL, **config: Any
                 ) -> tuple[subprocess.Popen[str], int, int, list[str]]:
    """`run --workers 2` on a one-rule policy, once it says both workers are ready:
    (the supervisor, proxy port, admin port, the workers' pids)."""
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(
        "version: v1\nname: agent\negress:\n  - host: allowed.test\n")
    proxy, admin = _free_port(), _free_port()
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": {"proxy": f"127.0.0.1:{proxy}", "admin": f"127.0.0.1:{admin}"},
        "admin_token": ADMIN, "policies": "policies", "certs": "certs",
        "secrets": {"store": "env"}, "runtime_dir": "runtime",
        "refusals": {"inside_tls": False}, **config,  # (a refusal read at the CONNECT)
    }))
    gw = subprocess.Popen(
        [sys.executable, "-m", "gateway", "run", "--workers", "2", "--config",
         str(tmp_path / "gateway.yaml")],
        cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True)
    assert gw.stderr is not None
    deadline = time.monotonic() + 60
    said: list[str] = []
    while time.monotonic() < deadline:
        said.append(gw.stderr.readline())
        if "ready: 2 workers" in said[-1]:
            break
        if gw.poll() is not None:  # (the pipe closed here, not by a later test's gc)
            with gw.stderr:
                raise AssertionError("".join(said) + gw.stderr.read())
    workers = subprocess.run(["pgrep", "-P", str(gw.pid)], capture_output=True,
                             text=True).stdout.split()
    assert len(workers) == 2
    return gw, proxy, admin, workers


def test_two_workers_share_ports_state_and_metrics(tmp_path: Path) -> None:
    audit = (tmp_path / "audit.log").open("w")
    try:
        gw, proxy, admin, _ = _two_workers(tmp_path, stdout=audit)
    except BaseException:
        audit.close()
        raise
    try:

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


def test_the_supervisor_runs_on_cpythons_allocator_and_the_workers_on_jemalloc(
        tmp_path: Path) -> None:
    """The supervisor (standard library only) is exec'd without the preloaded jemalloc
    (`allocator.without`: 1.9 MiB less); its workers, restarted ones too, get it back."""
    jemalloc = find_jemalloc()
    gw, _, _, workers = _two_workers(tmp_path)
    try:
        def on_jemalloc(pid: str) -> bool:
            return "libjemalloc" in Path(f"/proc/{pid}/maps").read_text()

        assert not on_jemalloc(str(gw.pid))
        assert "PYTHONMALLOC=malloc" not in Path(f"/proc/{gw.pid}/environ").read_text(
            errors="replace").split("\0")
        assert [on_jemalloc(pid) for pid in workers] == [jemalloc is not None] * 2
        if jemalloc is not None:  # a worker the supervisor starts again has it too
            os.kill(int(workers[0]), signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                now = subprocess.run(["pgrep", "-P", str(gw.pid)], capture_output=True,
                                     text=True).stdout.split()
                new = [pid for pid in now if pid not in workers]
                if new and "libjemalloc" in Path(f"/proc/{new[0]}/maps").read_text():
                    break
                time.sleep(0.2)
            else:
                raise AssertionError("no restarted worker on jemalloc within 60 s")
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(30)
        if gw.stderr is not None:
            gw.stderr.close()


def _open_connections(admin: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("sandbox_gateway_open_connections "))


def test_the_open_connections_gauge_is_exact_after_a_worker_is_killed(tmp_path: Path) -> None:
    """SIGKILL of a worker left its connections on the gauge for good (its multiprocess
    file kept its last value); the supervisor now drops a dead worker's live gauges."""
    gw, proxy, admin, workers = _two_workers(tmp_path)
    held: list[socket.socket] = []
    try:
        for _ in range(16):  # accepted and counted; the kernel spreads them over both
            sock = socket.create_connection(("127.0.0.1", proxy), timeout=5)
            sock.sendall(b"CONNECT allowed.test:443 HTTP/1.1\r\n")  # a head under way
            held.append(sock)
        deadline = time.monotonic() + 5
        while _open_connections(admin) != 16:
            assert time.monotonic() < deadline, _open_connections(admin)
            time.sleep(0.1)
        os.kill(int(workers[0]), signal.SIGKILL)
        time.sleep(0.5)
        alive = 0
        for sock in held:  # the killed worker's connections are gone (reset or EOF)
            sock.settimeout(0.2)
            try:
                alive += sock.recv(1) != b""
            except TimeoutError:
                alive += 1
            except OSError:
                pass
        assert alive < 16, "the killed worker held none of the connections"
        deadline = time.monotonic() + 5
        while _open_connections(admin) != alive:
            assert time.monotonic() < deadline, (_open_connections(admin), alive)
            time.sleep(0.1)
    finally:
        for sock in held:
            sock.close()
        gw.send_signal(signal.SIGTERM)
        gw.wait(20)
        if gw.stderr is not None:
            gw.stderr.close()


def test_workers_end_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the supervisor (the OOM killer, `kill -9`) left both workers serving
    on as orphans nobody stops; now each gets SIGTERM from the kernel, drains, exits."""
    gw, proxy, _, workers = _two_workers(tmp_path, shutdown={"drain": "2s"})
    try:
        gw.kill()
        gw.wait(5)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid)
                  for pid in workers):
            assert time.monotonic() < deadline, "a worker outlived its supervisor"
            time.sleep(0.1)
        with socket.socket() as probe:  # nobody serves the port any more
            assert probe.connect_ex(("127.0.0.1", proxy)) != 0
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        if gw.poll() is None:
            gw.kill()
        gw.wait(5)
        assert gw.stderr is not None
        gw.stderr.close()


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (FileNotFoundError, IndexError):
        return "Z"


def test_the_supervisor_holds_only_the_standard_library(tmp_path: Path) -> None:
    """Once the workers run, the supervisor is `runtime/watch.py` in a fresh interpreter
    (exec, same pid): none of the crypto, policy or engine code it prepared with stays
    mapped (it held ~46 MiB; ~14 MiB now). Its reserved ports and the restart of a dead
    worker still work."""
    gw, proxy, _, workers = _two_workers(tmp_path, shutdown={"drain": "2s"})
    try:
        cmdline = Path(f"/proc/{gw.pid}/cmdline").read_bytes().split(b"\0")
        assert b"gateway.runtime.watch" in cmdline, cmdline
        maps = Path(f"/proc/{gw.pid}/maps").read_text()
        for library in ("cryptography", "_cffi_backend", "mitmproxy", "_yaml", "_sqlite3"):
            assert library not in maps, library
        rss = next(int(line.split()[1]) for line in
                   Path(f"/proc/{gw.pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        assert rss < 30 * 1024, rss  # (KiB; a full gateway process holds twice that)
        # proxy and admin, held; the revocation relay's link to each worker
        assert sum(1 for fd in Path(f"/proc/{gw.pid}/fd").iterdir()
                   if os.readlink(fd).startswith("socket:")) == 2 + 2
        os.kill(int(workers[0]), signal.SIGKILL)  # restarted by the lean supervisor
        deadline = time.monotonic() + 15
        while True:
            now = subprocess.run(["pgrep", "-P", str(gw.pid)], capture_output=True,
                                 text=True).stdout.split()
            if len(now) == 2 and workers[0] not in now:
                break
            assert time.monotonic() < deadline, now
            time.sleep(0.2)
    finally:
        gw.send_signal(signal.SIGTERM)
        code = gw.wait(20)
        assert gw.stderr is not None
        gw.stderr.close()
    assert code == 0
    assert subprocess.run(["pgrep", "-P", str(gw.pid)], capture_output=True).stdout == b""
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", proxy)) != 0
