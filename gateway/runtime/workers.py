"""`run --workers N`: N gateway processes sharing the listening ports (SO_REUSEPORT).

One Python process runs one event loop on one core; mitmproxy's per-request work is
CPU-bound, so the gateway scales by processes. The supervisor prepares what every
worker must share before any starts (CA, signing keys, admin token, valid policies),
reserves the ports, and starts the workers with:

- the same ports (the kernel spreads connections over them, proxy and admin alike);
- one state: the SQLite file of `state.path` (the default store: every worker opens
  it, a change one makes is seen by the others' next request), a file in the runtime
  directory when the store is `memory`, or Redis as separate replicas share it;
- prometheus_client's multiprocess directory, so any worker's `/metrics` reports the
  sum over all workers;
- the audit spill journal (`audit.spill.path`): each worker keeps its own files, and
  those of workers a previous run had and this one has not go to worker 0 (`adopt`).

Then it becomes a lean process of the standard library only (`watch.py`): it forwards
SIGTERM/SIGINT, restarts a worker that dies (with backoff), relays token revocations
between the workers (`relay.py`: one socketpair each, so a revocation never waits for
the state store), and exits when every worker has stopped. Each worker keeps its own
secret cache.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from msgspec.structs import replace

from gateway.config import Config, HostPort, reach
from gateway.net import ca
from gateway.observability.audit_spill import adopt
from gateway.runtime.allocator import without
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.policy import load_policy_dir
from gateway.services.secrets import build_store
from gateway.services.state.sqlite_schema import open_file

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a
    container limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cgroup.read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    if quota != "max" and int(period) > 0:
        cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    return cpus


def reserve(host: str, port: int) -> socket.socket:
    """Hold host:port for this supervisor's workers: bind (not listen) with SO_REUSEPORT,
    after checking that no other process serves the port (SO_REUSEPORT lets any process
    of the same user join a port, so a second gateway would otherwise share it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((host, port))
        port = int(probe.getsockname()[1])
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror} (is "
                      "another gateway or program serving it?)") from None
    finally:
        probe.close()
    # Without SO_REUSEADDR: a second supervisor's probe (with it, so that a restart binds
    # beside its predecessor's closing connections) then conflicts with this socket
    # before any worker listens. With it, both could take the port in the seconds before
    # the workers listened, and the kernel spread connections over two gateways (seen
    # in CI: a token asked of one gateway answered by another's admin API, 401).
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _concrete(hp: HostPort, held: list[socket.socket]) -> HostPort:
    """Pin port 0 to a real port, holding it reserved (SO_REUSEPORT) for the workers."""
    sock = reserve(hp.host, hp.port)
    held.append(sock)
    return HostPort(hp.host, int(sock.getsockname()[1]))


class Supervisor:
    """Prepares what the workers share; `watch.Watcher` runs them."""

    def __init__(self, config: Config, config_path: str | None, workers: int) -> None:
        self.config = config
        self.config_path = config_path
        self.count = workers
        self._held: list[socket.socket] = []
        self.admin_token = ""
        self.admin_token_created = False

    def prepare(self) -> dict[str, str]:
        """Shared files and ports; returns the environment every worker gets."""
        cfg = self.config
        load_policy_dir(cfg.policies)  # fail here, once, with file:line errors
        ca.ensure_ca(cfg.certs)
        if cfg.secrets.get("store", "file") == "file":
            build_store(cfg.secrets)  # creates the default secrets file once, not N times
        SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids)
        if cfg.admin_token:
            admin_token, created = cfg.admin_token, False
        else:
            admin_token, created = ca.ensure_admin_token(cfg.certs)
        self.admin_token_created = created
        self.admin_token = admin_token
        self.listen = replace(
            cfg.listen,
            proxy=_concrete(cfg.listen.proxy, self._held),
            admin=_concrete(cfg.listen.admin, self._held),
            transparent=(_concrete(cfg.listen.transparent, self._held)
                         if cfg.listen.transparent else None),
            # TCP reserved like the others; every worker binds UDP on that port itself.
            dns=_concrete(cfg.listen.dns, self._held) if cfg.listen.dns else None,
        )
        spill = cfg.audit.spill
        if spill.max and spill.path is not None:  # a previous run's workers this one lacks
            adopt(spill.path, self.count)
        runtime = cfg.runtime_dir or Path(tempfile.mkdtemp(prefix="sandbox-gateway-"))
        self.runtime = runtime
        metrics_dir = self.metrics_dir = runtime / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        env = dict(os.environ)
        env.update({
            "SANDBOX_GATEWAY_LISTEN__PROXY": str(self.listen.proxy),
            "SANDBOX_GATEWAY_LISTEN__ADMIN": str(self.listen.admin),
            "SANDBOX_GATEWAY_ADMIN_TOKEN": admin_token,
            "SANDBOX_GATEWAY_RUNTIME_DIR": str(runtime),
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
            # how many share the container's memory (limits.memory as a percentage)
            "SANDBOX_GATEWAY_WORKERS": str(self.count),
        })
        if self.listen.transparent is not None:
            env["SANDBOX_GATEWAY_LISTEN__TRANSPARENT"] = str(self.listen.transparent)
        if self.listen.dns is not None:
            env["SANDBOX_GATEWAY_LISTEN__DNS"] = str(self.listen.dns)
        store = cfg.state.get("store", "sqlite")
        if store in ("sqlite", "memory"):
            path = Path(str(cfg.state["path"])) if store == "sqlite" else \
                runtime / "state" / "gateway.db"  # (memory: one file the workers share)
            if store == "memory":
                env["SANDBOX_GATEWAY_STATE__STORE"] = "sqlite"
                env["SANDBOX_GATEWAY_STATE__PATH"] = str(path)
            open_file(path).close()  # created and migrated once, before the workers
        return env


def follow_supervisor(supervisor: int) -> None:
    """End this worker when its supervisor ends, however it ends (SIGKILL, the OOM
    killer): Linux sends the worker SIGTERM (`PR_SET_PDEATHSIG`), so it drains and
    exits instead of serving on as an orphan nobody stops. A supervisor gone before
    this call (the race) is noticed by its pid."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != supervisor:
        os.kill(os.getpid(), signal.SIGTERM)


def run_supervisor(config: Config, config_path: str | None, workers: int) -> int:
    """Prepare, then become the lean supervisor (`watch.py`, by exec: same pid) that runs
    `workers` gateway processes until SIGTERM/SIGINT; the exit code of `run`. Returns
    only when preparing fails (2)."""
    supervisor = Supervisor(config, config_path, workers)
    try:
        env = supervisor.prepare()
    except Exception as exc:  # startup validation: say what, exit 2
        errors = getattr(exc, "errors", None)
        print("\n".join(errors) if errors else f"sandbox-gateway: {exc}", file=sys.stderr)
        return 2
    listen = supervisor.listen
    lines = [
        f"sandbox-gateway ready: {workers} workers",
        f"  proxy   http://{listen.proxy}   (HTTPS_PROXY for sandboxes; "
        f"{reach(listen.proxy.host, listen.reachable_from)})",
        f"  admin   http://{listen.admin}   (/healthz /readyz /metrics /v1/...)",
        f"  CA      {config.certs / ca.CA_CERT}   (sandboxes must trust it)",
        f"  policies {config.policies} (hot-reloaded)",
    ]
    if listen.transparent is not None:
        lines.insert(3, f"  transparent {listen.transparent}")
    if listen.dns is not None:
        lines.insert(3, f"  dns     {listen.dns}   (udp+tcp; registered sandboxes only)")
    lines.append(ca.admin_token_line(config.certs, bool(config.admin_token),
                                    supervisor.admin_token_created))
    held = [sock.fileno() for sock in supervisor._held]
    # The supervisor on CPython's own allocator (`allocator.without`), the workers on the
    # one `run` was started on: the plan's env gives them back what it leaves out.
    own = without(os.environ)
    plan = {
        "workers": workers, "config_path": config_path,
        "env": {k: v for k, v in env.items() if own.get(k) != v},  # (what it adds)
        "runtime": str(supervisor.runtime), "remove_runtime": config.runtime_dir is None,
        "metrics_dir": str(supervisor.metrics_dir),
        "stop_timeout": config.shutdown.drain + 10, "held": held,
        "banner": "\n".join(lines),
    }
    read, write = os.pipe()  # (a few KB: the write never waits for the reader)
    with os.fdopen(write, "w", encoding="utf-8") as pipe:
        json.dump(plan, pipe)
    for fd in (read, *held):
        os.set_inheritable(fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable,  # noqa: S606 (this interpreter, a fixed argv)
              [sys.executable, "-m", "gateway.runtime.watch", str(read)], own)
