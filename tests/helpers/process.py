"""The gateway as a real `sandbox-gateway run` process (what the fault and soak suites
measure: its file descriptors, memory, signals and stderr)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from helpers.tls import LocalCA

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "process-test-admin-token-0123456789"
POLICY = """
version: v1
name: agent
egress:
  - host: pass.test
  - host: inspect.test
    methods: [GET, HEAD, POST]
"""


def lines_until(read: Callable[[], list[dict[str, Any]]],
                match: Callable[[dict[str, Any]], bool],
                done: Callable[[list[dict[str, Any]]], bool] = bool,
                timeout: float = 5.0) -> list[dict[str, Any]]:
    """The lines of `read()` that `match` selects, read again until `done` holds of them
    or `timeout` seconds have passed: a gateway writes an exchange's audit line at the end
    of the loop tick that relayed its response, a moment after the client saw its last
    byte (later on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in read() if match(r)]
        if done(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[str]
    proxy: int
    admin: int
    workdir: Path
    log: Path | None = None  # stderr goes to this file (a pipe nobody reads fills up)

    def stderr(self) -> str:
        """Waits for the process to end; its whole stderr."""
        self.proc.wait(15)
        if self.log is not None:
            return self.log.read_text(errors="replace")
        assert self.proc.stderr is not None
        return self.proc.stderr.read()

    def token(self, sandbox: str = "sbx-1") -> str:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.admin}/v1/tokens", method="POST",
            data=json.dumps({"sandbox": sandbox, "policy": "agent", "ttl": "2h"}).encode(),
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
        return str(json.loads(urllib.request.urlopen(req, timeout=5).read())["token"])

    def admin_call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One admin API call with the admin token: (status, JSON answer), errors too."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.admin}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, json.loads(exc.read())

    def mint(self, sandbox: str) -> tuple[str, str]:
        """A token for `sandbox` on policy `agent`, minted by the admin API: (token, jti)."""
        status, minted = self.admin_call("POST", "/v1/tokens",
                                         {"sandbox": sandbox, "policy": "agent"})
        assert status == 200, minted
        return minted["token"], minted["jti"]

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def audit_lines(self) -> list[dict[str, Any]]:
        path = self.workdir / "audit.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def audit_lines_until(self, match: Callable[[dict[str, Any]], bool],
                          done: Callable[[list[dict[str, Any]]], bool] = bool,
                          timeout: float = 5.0) -> list[dict[str, Any]]:
        """The audit lines `match` selects once `done` holds of them (by default: there
        is one), or when `timeout` seconds have passed (`lines_until`)."""
        return lines_until(self.audit_lines, match, done, timeout)

    def terminate(self) -> int | None:
        """SIGTERM (a graceful stop: the supervisor stops its workers), up to 30 s for it
        to end, then `stop()`; its exit status (None: it had to be killed)."""
        status = None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    status = self.proc.wait(30)
            else:
                status = self.proc.returncode
        finally:
            self.stop()
        return status

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def start_gateway(workdir: Path, names: dict[str, int], ca: LocalCA, *,
                  proxy: int | None = None, admin: int | None = None, workers: int = 1,
                  policy: str = POLICY,
                  extra: dict[str, Any] | None = None, wait: bool = True,
                  fd_limit: int | None = None, log: Path | None = None,
                  stdout: int = subprocess.DEVNULL) -> GatewayProcess:
    """`sandbox-gateway run` with policies in `workdir`, `names` resolved to local ports;
    `fd_limit` sets its open-files limit (soft and hard) as a container's ulimit would;
    `log`: a file for its stderr (for a chatty process: debug logging); `stdout`: where
    its stdout goes (audit lines, with `audit: {path: null}`); `proxy`, `admin`: the
    listeners' ports (a restart on the same ones). A port picked here (`free_port`) may
    be taken by another test's process before the gateway binds it: then it starts again
    on other ones (twice at most); a port the caller gave is not changed."""
    for attempt in range(3):
        try:
            return _start_gateway(workdir, names, ca, proxy=proxy or free_port(),
                                  admin=admin or free_port(), workers=workers,
                                  policy=policy, extra=extra, wait=wait,
                                  fd_limit=fd_limit, log=log, stdout=stdout)
        except RuntimeError as exc:
            if (proxy and admin) or attempt == 2 or "Address already in use" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _start_gateway(workdir: Path, names: dict[str, int], ca: LocalCA, *, proxy: int,
                   admin: int, workers: int, policy: str, extra: dict[str, Any] | None,
                   wait: bool, fd_limit: int | None, log: Path | None,
                   stdout: int) -> GatewayProcess:
    """`start_gateway` on these ports."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "policies").mkdir(exist_ok=True)
    (workdir / "policies" / "agent.yaml").write_text(policy)
    config: dict[str, Any] = {
        "listen": {"proxy": f"127.0.0.1:{proxy}", "admin": f"127.0.0.1:{admin}"},
        "admin_token": ADMIN, "policies": "policies", "certs": "certs", "workers": workers,
        "secrets": {"store": "env"}, "audit": {"path": str(workdir / "audit.jsonl")},
        "network": {"upstream_ca": str(ca.cert_path),
                    "resolve": {n: f"127.0.0.1:{p}" for n, p in names.items()}},
        "shutdown": {"drain": "10s"},
        "refusals": {"inside_tls": False},  # (read at the CONNECT; see helpers/gateway.py)
    }
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    if workers > 1:  # (where each worker says it serves: `ready-<index>`)
        config.setdefault("runtime_dir", str(workdir / "runtime"))
    (workdir / "gateway.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_GATEWAY_")}
    with contextlib.ExitStack() as files:
        stderr: Any = subprocess.PIPE if log is None else files.enter_context(log.open("w"))
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "run", "--config",
                                 str(workdir / "gateway.yaml")], cwd=ROOT, env=env,
                                stdout=stdout, stderr=stderr, text=True,
                                preexec_fn=None if fd_limit is None else
                                lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                           (fd_limit, fd_limit)))
    gw = GatewayProcess(proc, proxy, admin, workdir, log)
    if wait:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                said = gw.stderr()
                gw.stop()  # (its stderr pipe closed: the exception's traceback keeps `gw`,
                raise RuntimeError(said)  # and a later test's garbage collection warned)
            if _serving(admin, workdir / config["runtime_dir"] if workers > 1 else None,
                        workers):
                return gw
            time.sleep(0.02)  # (a readiness check is one refused connect or file stat)
        gw.stop()
        raise TimeoutError("gateway not ready within 30 s")
    return gw


def _serving(admin: int, runtime: Path | None, workers: int) -> bool:
    """`/readyz` answers, and with worker processes every one of them serves (it wrote
    `ready-<index>` in `runtime`): one answering is not all of them (a worker still
    importing for seconds under load would miss what the test does first, a state store
    stopped before it connected would keep it from starting at all)."""
    if runtime is not None and not all((runtime / f"ready-{i}").exists()
                                       for i in range(workers)):
        return False
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1).close()
    except OSError:
        return False
    return True


def start_with_provider(workdir: Path, fake: Any, ca: LocalCA, *, key: str, policy: str,
                        workers: int = 2, extra: dict[str, Any] | None = None,
                        proxy: int | None = None) -> GatewayProcess:
    """`start_gateway` with `api.openai.com` at the fake provider `fake`
    (`fakes.inference.FakeInference`), its key in a secrets file as `provider-key`;
    `extra`: more top-level config; `proxy`: the proxy port (a restart on the same one)."""
    secrets = workdir / "secrets.yaml"
    workdir.mkdir(parents=True, exist_ok=True)
    secrets.write_text(f"provider-key: {key}\n")
    secrets.chmod(0o600)
    return start_gateway(workdir, {"api.openai.com": fake.port}, ca, policy=policy,
                         workers=workers, proxy=proxy, extra={
                             "secrets": {"store": "file", "path": str(secrets)},
                             "network": {"upstream_ca": str(fake.ca_path)}, **(extra or {})})
