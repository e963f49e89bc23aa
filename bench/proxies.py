"""The proxies under test, each started by the benchmark on 127.0.0.1 and pinned to one core.

* `GatewayProxy`: ``python -m gateway run`` with a generated config and policy:
  ``pass.bench.test`` host-only (passthrough), ``policy.bench.test`` with methods/paths
  (intercepted), ``inject.bench.test`` with a credential (intercepted + injection),
  ``sse.bench.test`` with methods/paths (intercepted streaming), ``upload.bench.test``
  and ``dlp.bench.test`` (POST /upload, intercepted; the second with `dlp:`).
* `MitmdumpProxy`: plain ``mitmdump -q`` with the one-line header-injection script a
  user would write instead (plus the name mapping the benchmark's fake names need).
* `SquidProxy`: Debian squid as a CONNECT proxy, names mapped by its ``hosts_file``.

All expose ``pid``, ``cpu_seconds()`` (utime+stime of the process tree from /proc: with
``run --workers N`` the supervisor and every worker), ``cpu_by_pid()`` (the same per
process) and ``rss_kb()`` (VmRSS of the process tree).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.upstream import (
    NAMES,
    NGINX_HEAD,
    SECRET,
    LocalCA,
    free_port,
    nginx_binary,
    stop_process,
    wait_port,
)

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


# /proc/<pid>/task/<tid>/children needs CONFIG_PROC_CHILDREN; without it the tree is
# found from every process's parent pid (/proc/<pid>/stat), as `pgrep -P` does.
_HAS_CHILDREN = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def _children_by_ppid() -> dict[int, list[int]]:
    """Parent pid -> child pids, over every process in /proc."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a supervisor and its workers, taskset's exec'd child)."""
    by_ppid = None if _HAS_CHILDREN else _children_by_ppid()
    todo, seen = [pid], []
    while todo and len(seen) < 256:
        p = todo.pop()
        seen.append(p)
        todo.extend(_children(p) if by_ppid is None else by_ppid.get(p, []))
    return seen


def _stat_seconds(pid: int) -> float:
    """utime+stime of one process (all threads, exited ones too), in 1/CLK_TCK ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_ticks_seconds(pid: int) -> float:
    """utime+stime of ``pid`` and its descendants from /proc/<pid>/stat (10 ms ticks)."""
    return sum(_stat_seconds(p) for p in _tree(pid))


def cpu_ticks_by_pid(pid: int) -> dict[int, float]:
    """`cpu_ticks_seconds`, per process of the tree."""
    return {p: _stat_seconds(p) for p in _tree(pid)}


def _sched_seconds(pid: int) -> float | None:
    """Sum of ``se.sum_exec_runtime`` (ms, µs precision) over the threads of ``pid``."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/sched") as f:
                for line in f:
                    if line.startswith("se.sum_exec_runtime"):
                        total += float(line.split(":", 1)[1])
                        break
                else:
                    return None
        except FileNotFoundError:
            if tid == str(pid):
                return None  # no /proc/<pid>/sched on this kernel (CONFIG_SCHED_DEBUG off)
        except OSError:
            return None
    return total / 1e3


def cpu_seconds(pid: int) -> float:
    """CPU time (user+system, all threads) of ``pid`` and its descendants, in seconds.

    From the scheduler's ``sum_exec_runtime`` where the kernel exposes it (µs
    precision, so short ``--quick`` runs still measure); else utime+stime ticks.
    """
    return sum(cpu_by_pid(pid).values())


def cpu_by_pid(pid: int) -> dict[int, float]:
    """`cpu_seconds`, per process of the tree (the root first)."""
    out: dict[int, float] = {}
    for p in _tree(pid):
        precise = _sched_seconds(p)
        out[p] = precise if precise is not None else _stat_seconds(p)
    return out


def rss_kb(pid: int) -> int:
    total = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


def _pinned(cmd: list[str], cpu: int | None) -> list[str]:
    """``taskset -c cpu cmd``; ``cpu`` None: unpinned (the caller's own affinity)."""
    return ["taskset", "-c", str(cpu), *cmd] if cpu is not None else cmd


class Proxy:
    """A started proxy process."""

    name = "proxy"
    proc: subprocess.Popen[bytes] | None = None
    port = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def cpu_ticks_seconds(self) -> float:
        return cpu_ticks_seconds(self.pid)

    def cpu_by_pid(self) -> dict[int, float]:
        return cpu_by_pid(self.pid)

    def cpu_ticks_by_pid(self) -> dict[int, float]:
        return cpu_ticks_by_pid(self.pid)

    def rss_kb(self) -> int:
        return rss_kb(self.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def log_tail(self) -> str:
        return ""


def _upstream_map(static_port: int, sse_port: int) -> dict[str, int]:
    return {n: (sse_port if n.startswith("sse.") else static_port) for n in NAMES}


POLICY = """\
version: v1
name: bench
egress:
  - host: pass.bench.test
  - host: policy.bench.test
    methods: [GET]
    paths: ["/small", "/big"]
  - host: inject.bench.test
    credential: bench-key
  - host: sse.bench.test
    methods: [GET]
    paths: ["/events"]
  # the same uploads without and with outbound credential detection (issue 43)
  - host: upload.bench.test
    methods: [POST]
    paths: ["/upload"]
  - host: dlp.bench.test
    methods: [POST]
    paths: ["/upload"]
    dlp: {action: refuse}
credentials:
  bench-key:
    hosts: [inject.bench.test]
    secret: bench-key
    inject: {header: X-Api-Key}
"""


class GatewayProxy(Proxy):
    name = "gateway"

    def __init__(self, workdir: Path, upstream_ca: Path, static_port: int, sse_port: int,
                 cpu: int | None, workers: int | None = None,
                 upstream_idle_timeout: str | None = None,
                 telemetry: dict[str, Any] | None = None, otlp_logs: bool = False,
                 wrap: tuple[str, ...] = (), ready_seconds: float = 30.0,
                 children_cpu: int | None = None) -> None:
        self.dir = workdir
        self.wrap = wrap  # a command the gateway runs under (bench/instructions.py: valgrind)
        self.ready_seconds = ready_seconds
        self.workers = workers  # None: the config default (one per usable core)
        self.upstream_idle_timeout = upstream_idle_timeout  # None: the config default (30 s)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "policies").mkdir(exist_ok=True)
        (self.dir / "policies" / "bench.yaml").write_text(POLICY)
        self.port = free_port()
        self.admin_port = free_port()
        ports = _upstream_map(static_port, sse_port)
        cfg = {
            "listen": {"proxy": f"127.0.0.1:{self.port}", "admin": f"127.0.0.1:{self.admin_port}"},
            "policies": str(self.dir / "policies"),
            "certs": str(self.dir / "certs"),
            "secrets": {"store": "env"},
            "audit": {"path": str(self.dir / "audit.log")},
            "log_level": "warning",
            "network": {"upstream_ca": str(upstream_ca),
                        "resolve": {n: f"127.0.0.1:{p}" for n, p in ports.items()}},
            # One sandbox opens every idle tunnel of the idle workload (1,000).
            "limits": {"connections_per_sandbox": 100_000},
        }
        if upstream_idle_timeout is not None:
            cfg["network"]["upstream_idle_timeout"] = upstream_idle_timeout
        if telemetry is not None:  # OTLP export on (`telemetry:`; `audit.otlp`: the lines)
            cfg["telemetry"] = telemetry
            cfg["audit"]["otlp"] = otlp_logs
        self.config = self.dir / "gateway.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.cpu = cpu
        # the gateway's child processes (its OTLP exporter) moved to this core once ready
        self.children_cpu = children_cpu
        self.token = ""
        self.env = {k: v for k, v in os.environ.items()
                    if not k.upper().startswith(("SANDBOX_GATEWAY_", "HTTP_PROXY", "HTTPS_PROXY",
                                                 "ALL_PROXY", "NO_PROXY"))}
        self.env["SANDBOX_GATEWAY_SECRET_BENCH_KEY"] = SECRET
        # BENCH_GATEWAY_ENV="PYTHONMALLOC=pymalloc ...": variables for the gateway only (an
        # allocator's CPU cost without the load client's; bench/README.md)
        for item in os.environ.get("BENCH_GATEWAY_ENV", "").split():
            key, _, value = item.partition("=")
            self.env[key] = value

    @property
    def ca_cert(self) -> Path:
        return self.dir / "certs" / "ca.crt"

    def start(self) -> None:
        self._log = (self.dir / "gateway.log").open("wb")
        cmd = [sys.executable, "-m", "gateway", "run", "--config", str(self.config)]
        if self.workers is not None:
            cmd += ["--workers", str(self.workers)]
        self.proc = subprocess.Popen(
            [*self.wrap, *_pinned(cmd, self.cpu)],
            cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.ready_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(  # loopback admin API, plain HTTP by design
                        f"http://127.0.0.1:{self.admin_port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.1)
        else:
            raise RuntimeError(
                f"gateway not ready within {self.ready_seconds:.0f} s: {self.log_tail()}")
        if self.workers is not None and self.workers > 1:
            # /readyz answers as soon as one worker listens; the supervisor says when all do.
            banner = f"sandbox-gateway ready: {self.workers} workers"
            while banner not in self.log_tail(100_000):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gateway workers not ready: {self.log_tail()}")
                time.sleep(0.1)
        if self.children_cpu is not None:  # (the exporter starts before /readyz answers)
            for child in _tree(self.proc.pid)[1:]:  # every thread: the SDK's started already
                tasks: list[str] = []
                with contextlib.suppress(FileNotFoundError):  # (a child that ended)
                    tasks = os.listdir(f"/proc/{child}/task")
                for task in tasks:
                    with contextlib.suppress(ProcessLookupError):  # (a thread that ended
                        os.sched_setaffinity(int(task), {self.children_cpu})  # meanwhile)
        if not self.token:
            out = subprocess.run(
                [sys.executable, "-m", "gateway", "token", "mint", "--config", str(self.config),
                 "--sandbox", "bench", "--policy", "bench", "--ttl", "2h"],
                cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60, check=False)
            if out.returncode != 0:
                raise RuntimeError(f"token mint failed: {out.stderr[-800:]}")
            self.token = out.stdout.strip()

    @property
    def auth(self) -> str:
        return f"bench:{self.token}"

    def stop(self) -> None:
        super().stop()
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return (self.dir / "gateway.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""


MITM_SCRIPT = """\
# The header injection a user would write instead of the gateway (one line: `request`),
# plus the name mapping the benchmark's fake hostnames need (what /etc/hosts would do).
UPSTREAMS = {upstreams!r}


def server_connect(data):
    host = data.server.address[0]
    if host in UPSTREAMS:
        data.server.address = ("127.0.0.1", UPSTREAMS[host])


def request(flow):
    flow.request.headers["X-Api-Key"] = {secret!r}
"""


class MitmdumpProxy(Proxy):
    name = "mitmdump"

    def __init__(self, workdir: Path, upstream_ca: Path, static_port: int, sse_port: int,
                 cpu: int | None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.script = self.dir / "inject.py"
        self.script.write_text(MITM_SCRIPT.format(
            upstreams=_upstream_map(static_port, sse_port), secret=SECRET))
        self.upstream_ca = upstream_ca
        self.port = free_port()
        self.cpu = cpu

    @property
    def ca_cert(self) -> Path:
        return self.dir / "conf" / "mitmproxy-ca-cert.pem"

    def start(self) -> None:
        binary = Path(sys.executable).parent / "mitmdump"
        if not binary.exists():
            found = shutil.which("mitmdump")
            if found is None:
                raise RuntimeError("mitmdump not found (pip install mitmproxy)")
            binary = Path(found)
        self._log = (self.dir / "mitmdump.log").open("wb")
        self.proc = subprocess.Popen(
            _pinned([str(binary), "-q", "--listen-host", "127.0.0.1",
                     "--listen-port", str(self.port),
                     "--set", f"confdir={self.dir / 'conf'}",
                     "--set", f"ssl_verify_upstream_trusted_ca={self.upstream_ca}",
                     "--set", "stream_large_bodies=1m",
                     "-s", str(self.script)], self.cpu),
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_port(self.port, 30, self.proc, "mitmdump")
        deadline = time.monotonic() + 10
        while not self.ca_cert.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        super().stop()
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def log_tail(self) -> str:
        try:
            return (self.dir / "mitmdump.log").read_text(errors="replace")[-1500:]
        except OSError:
            return ""


NGINX_PROXY_CONF = NGINX_HEAD + """\
  upstream bench_upstream {{ server 127.0.0.1:{upstream_port}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} ssl;
    server_name inject.bench.test;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_tickets on;  # (nginx's default; the gateway resumes sessions too)
    location / {{
      proxy_pass https://bench_upstream;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host inject.bench.test;
      proxy_set_header X-Api-Key "{secret}";
      proxy_ssl_server_name on;
      proxy_ssl_name inject.bench.test;
      proxy_ssl_verify on;
      proxy_ssl_trusted_certificate {ca};
      proxy_ssl_session_reuse on;
      proxy_max_temp_file_size 0;  # a large body streamed, never spooled to a file
    }}
  }}
}}
"""


class NginxProxy(Proxy):
    """nginx as a TLS-terminating reverse proxy that adds the key header: the floor for
    what terminating, re-encrypting and forwarding one request costs (no CONNECT, no
    policy, no scan). Clients connect to it directly, as to inject.bench.test."""

    name = "nginx"

    def __init__(self, workdir: Path, ca: LocalCA, upstream_port: int, cpu: int | None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        cert, key = ca.issue(self.dir, ["inject.bench.test"])
        self.port = free_port()
        (self.dir / "nginx.conf").write_text(NGINX_PROXY_CONF.format(
            d=self.dir, cert=cert, key=key, port=self.port, upstream_port=upstream_port,
            secret=SECRET, ca=ca.cert_path))
        self.cpu = cpu

    def start(self) -> None:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (apt-get install nginx-light)")
        self.proc = subprocess.Popen(
            _pinned([binary, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"),
                     "-e", str(self.dir / "nginx-error.log")], self.cpu),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        wait_port(self.port, 30, self.proc, "nginx (reverse proxy)")

    def log_tail(self) -> str:
        try:
            return (self.dir / "nginx-error.log").read_text(errors="replace")[-1500:]
        except OSError:
            return ""


SQUID_CONF = """\
http_port 127.0.0.1:{port}
visible_hostname bench-squid
pid_filename {d}/squid.pid
cache_log {d}/cache.log
access_log none
cache_store_log none
coredump_dir {d}
netdb_filename none
pinger_enable off
cache deny all
cache_mem 8 MB
hosts_file {d}/hosts
dns_nameservers 127.0.0.1
max_filedescriptors 16384
shutdown_lifetime 0 seconds
acl bench_ports port {ports}
acl CONNECT method CONNECT
http_access allow CONNECT bench_ports
http_access deny all
"""


class SquidProxy(Proxy):
    name = "squid"

    def __init__(self, workdir: Path, static_port: int, sse_port: int, cpu: int | None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        # Started as root, squid drops to its cache_effective_user (proxy), which must reach
        # its config, hosts file and logs: traverse-only on the parent, writable here.
        os.chmod(self.dir.parent, 0o711)
        os.chmod(self.dir, 0o777)
        self.port = free_port()
        (self.dir / "hosts").write_text("".join(f"127.0.0.1 {n}\n" for n in NAMES))
        (self.dir / "squid.conf").write_text(SQUID_CONF.format(
            port=self.port, d=self.dir, ports=f"{static_port} {sse_port}"))
        self.cpu = cpu

    def start(self) -> None:
        binary = shutil.which("squid") or "/usr/sbin/squid"
        if not Path(binary).exists():
            raise RuntimeError("squid is not installed (apt-get install squid)")
        self._log = (self.dir / "squid.out").open("wb")
        self.proc = subprocess.Popen(
            _pinned([binary, "-N", "-f", str(self.dir / "squid.conf")], self.cpu),
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_port(self.port, 30, self.proc, "squid")

    def stop(self) -> None:
        super().stop()
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def log_tail(self) -> str:
        out = ""
        for name in ("squid.out", "cache.log"):
            with contextlib.suppress(OSError):
                out += (self.dir / name).read_text(errors="replace")[-800:]
        return out

