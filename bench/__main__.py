"""``python -m bench [--quick] [--out FILE] [--only ROWS/SECTIONS]``: the benchmark, in one run.

Starts a local TLS upstream (nginx + a Python SSE server), then each proxy under test
in turn (the gateway, plain ``mitmdump -q`` with a header-injection script, squid),
pinned to one core, and drives every workload with the load client (``bench.load``)
pinned to another. Proxy CPU comes from the proxy's own utime+stime (/proc), sampled
right before and after the measured phase. Then worker scaling (``run --workers 1`` and
``--workers 2``, unpinned), and the in-process measurements (policy decision time,
cold secret). Prints a table and the targets, writes JSON to
``bench/results/<date>.json`` and a markdown table to ``bench/results/latest.md``.
Everything listens and connects on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from bench import (
    dlp_instructions,
    dlp_rounds,
    metering,
    micro,
    otel_rounds,
    pass_rounds,
    report,
    targets,
)
from bench.proxies import GatewayProxy, MitmdumpProxy, NginxProxy, Proxy, SquidProxy
from bench.upstream import LocalCA, SSEServer, StaticUpstream, stop_process

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Sizes:
    """Durations and sizes of one run (full or ``--quick``)."""

    get_seconds: float
    big_bytes: int
    sse_streams: int
    sse_events: int
    sse_interval_ms: int
    idle_tunnels: int
    policy_sizes: tuple[int, ...]
    policy_samples: int
    worker_concurrency: tuple[int, ...]  # the workers section: GET /small at these
    secret_concurrency: int = 100
    metering_requests: int = 100  # per row and round: streamed calls, metered vs not
    metering_rounds: int = 24  # short alternating rounds: many ratios, little drift in each
    dlp_stream_mib: int = 100  # the streamed upload through the credential scanner
    upload_bytes: int = 100 << 20  # the POST upload rows' one body (issue 43)
    otel_rounds: int = 6  # alternating rounds of export off / spans / spans + logs (c10)
    pass_rounds: int = 6  # alternating rounds of passthrough GETs, gateway / squid (c10)
    # alternating rounds of the POST rows' workloads, detection off / on: many short ones
    # (a round's ratio spreads ±20 % on a busy 2-vCPU host: six could not tell 2 % from 8 %)
    dlp_rounds: int = 16
    dlp_round_seconds: float = 1.5  # each run of a POST workload in a round
    # each count of the POST workloads' instructions under callgrind (bench/
    # dlp_instructions.py); 0: not counted (--quick: valgrind is not a test tool)
    dlp_instruction_seconds: float = 12.0
    pass_round_seconds: float = 4.0
    otel_round_seconds: float = 4.0
    # seconds an OTLP gateway's CPU is read after its load: the worker's frames go every
    # 0.2 s, the exporter's batches 1 s after their first line (its loop looks every
    # 0.25 s); none with --quick, which measures nothing
    otel_settle: float = 1.6
    idle_settle: float = 2.0  # seconds after a workers gateway started before its RSS is read


FULL = Sizes(get_seconds=5.0, big_bytes=100_000_000, sse_streams=20, sse_events=20,
             sse_interval_ms=10, idle_tunnels=1000, policy_sizes=(10, 1000, 100_000),
             policy_samples=50_000, worker_concurrency=(10, 20))
# --quick (the smoke test, tests/test_bench_smoke.py) measures nothing: every row, workload
# and section once, as short as each still answers (0.2 s of load each; two rounds of
# each alternation, in both orders).
QUICK = Sizes(get_seconds=0.2, big_bytes=2_000_000, sse_streams=3, sse_events=5,
              sse_interval_ms=5, idle_tunnels=20, policy_sizes=(10, 100, 1000),
              policy_samples=2000, worker_concurrency=(10,), metering_requests=20,
              metering_rounds=2, dlp_stream_mib=2, upload_bytes=2 << 20,
              otel_rounds=2, otel_round_seconds=0.2, otel_settle=0.0, pass_rounds=2,
              dlp_rounds=2, dlp_round_seconds=0.2, dlp_instruction_seconds=0.0,
              pass_round_seconds=0.2, idle_settle=0.2)
WORKER_COUNTS = (1, 2)  # `run --workers N` in the workers section
IDLE_TIMEOUT = "2s"  # network.upstream_idle_timeout of the idle_after_timeout gateway
IDLE_TIMEOUT_WAIT_S = 4.0  # idle_after_timeout: wait at least this long after the tunnels
IDLE_TIMEOUT_MAX_WAIT_S = 20.0  # ... and until nginx sees no connection left, up to this
WORKER_ROW = "gateway_policy"  # its host and workload: intercepted + policy, GET /small
WORKERS_NOTE = (
    "unpinned: the gateway processes, the load client and nginx share every core. On a "
    "2-core machine the ratio is bounded by the client (and nginx) sharing the cores with "
    "the workers; 0.8 x N can only be shown on a machine with more cores than N + the client.")


@dataclass(frozen=True)
class Row:
    """One line of the table: a proxy in one path, and the workloads that apply to it."""

    key: str
    label: str
    proxy: str | None  # None = direct; else gateway | mitmdump | squid | nginx
    host: str
    workloads: tuple[str, ...]
    inject_header: bool = False  # send X-Api-Key: <token> as a sandbox would


# (post_agent: a coding agent's chat request, as the OpenAI SDK sends one: bench/agent.py)
POST_WORKLOADS = ("post_2k", "post_1m", "post_agent", "upload")
POST_BODY = {"post_2k": 2_000, "post_1m": 1 << 20}  # bytes of the loops' JSON bodies

ROWS = (
    Row("direct", "direct (no proxy)", None, "pass.bench.test",
        ("get_c1", "get_c10", "download", "sse")),
    Row("gateway_passthrough", "gateway passthrough", "gateway", "pass.bench.test",
        ("get_c1", "get_c10", "download", "idle")),
    Row("gateway_policy", "gateway intercept + policy", "gateway", "policy.bench.test",
        ("get_c1", "get_c10", "download", "idle", "idle_after_timeout")),
    # The same gateway and workload with OTLP/gRPC export on (issue 45), to a receiver on
    # the client core: a span per request; a span and a log record per request; spans of
    # one request in ten (`telemetry.sample: 0.1`).
    Row("gateway_otel", "gateway intercept + policy, OTLP spans", "gateway_otel",
        "policy.bench.test", ("get_c1", "get_c10")),
    Row("gateway_otel_logs", "gateway intercept + policy, OTLP spans + audit logs",
        "gateway_otel_logs", "policy.bench.test", ("get_c1", "get_c10")),
    Row("gateway_otel_sampled", "gateway intercept + policy, OTLP spans sampled 0.1",
        "gateway_otel_sampled", "policy.bench.test", ("get_c1", "get_c10")),
    Row("gateway_otel_apart", "gateway intercept + policy, OTLP spans, exporter on the "
        "client's core", "gateway_otel_apart", "policy.bench.test", ("get_c1", "get_c10")),
    Row("gateway_inject", "gateway intercept + inject", "gateway", "inject.bench.test",
        ("get_c1", "get_c10", "new_c10", "resume_c10"), inject_header=True),
    Row("gateway_sse", "gateway SSE (intercept)", "gateway", "sse.bench.test", ("sse",)),
    # POSTs without a credential in them, intercepted, with outbound credential detection
    # off and on (`dlp:` on the second host's rule; issue 43), in the same gateway: a 2 KB
    # chat request, a 1 MiB one (c1 loops) and one upload of `upload_bytes` of text.
    Row("gateway_post", "gateway intercept, POST", "gateway", "upload.bench.test",
        POST_WORKLOADS),
    Row("gateway_post_dlp", "gateway intercept, POST, credential detection", "gateway",
        "dlp.bench.test", POST_WORKLOADS),
    Row("nginx", "nginx TLS reverse proxy + header", "nginx", "inject.bench.test",
        ("get_c1", "get_c10", "new_c10", "resume_c10", "download")),
    Row("mitmdump", "mitmdump -q + inject script", "mitmdump", "inject.bench.test",
        ("get_c1", "get_c10", "new_c10", "download", "sse", "idle"), inject_header=True),
    Row("squid", "squid CONNECT", "squid", "pass.bench.test",
        ("get_c1", "get_c10", "download", "sse", "idle")),
)
# the OTLP rows' gateways: (audit.otlp, telemetry.sample); `_apart`: the exporter process
# moved off the gateway's core (to the client's), to tell its CPU from the worker's own
OTEL_KINDS = {"gateway_otel": (False, 1.0), "gateway_otel_logs": (True, 1.0),
              "gateway_otel_sampled": (False, 0.1), "gateway_otel_apart": (False, 1.0)}
SECTIONS = ("workers", "otel_rounds", "pass_rounds", "dlp_rounds", "dlp_instructions",
            "policy", "secret", "metering", "dlp")


class ClientError(RuntimeError):
    """The load client failed; the message carries its reason."""


class _Lines:
    """Line reader over a pipe with timeouts (select on the raw fd, own buffer)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.proc = proc
        self.buf = b""

    def read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClientError(f"load client gave no answer within {timeout:.0f} s")
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    err = self.proc.stderr.read().decode(errors="replace") \
                        if self.proc.stderr else ""
                    raise ClientError(f"load client exited: {err[-800:]}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        obj: dict[str, Any] = json.loads(line)
        if "error" in obj:
            raise ClientError(obj["error"])
        return obj


@dataclass
class Bench:
    sizes: Sizes
    workdir: Path
    proxy_cpu: int | None
    client_cpu: int | None
    only: set[str] = field(default_factory=set)
    all_cpus: tuple[int, ...] = ()  # the usable cores before the orchestrator pinned itself
    results: dict[str, Any] = field(default_factory=dict)

    # -- plumbing ------------------------------------------------------------------------

    def client(self, spec: dict[str, Any], proxy: Proxy | None, timeout: float,
               pin: bool = True,
               idle_wait: Callable[[Proxy | None], dict[str, Any]] | None = None,
               settle: float = 0.0) -> dict[str, Any]:
        """Run one workload in the load client; sample the proxy around the measured phase.

        ``pin`` False: the client gets the orchestrator's affinity (see `_unpinned`).
        ``idle_wait``: idle only, called once the tunnels are open and before the proxy's
        RSS is read (the upstream idle timeout); its figures go into the result.
        ``settle``: seconds waited after the measured phase before the proxy's CPU is
        read (an OTLP exporter's last batches, sent up to 1.45 s later, counted:
        `Sizes.otel_settle`).
        """
        spec = {**spec, "cpu": self.client_cpu if pin else None}
        proc = subprocess.Popen([sys.executable, "-m", "bench.load", json.dumps(spec)],
                                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        try:
            lines = _Lines(proc)
            ready = lines.read(120)
            warm = {int(k): v for k, v in ready.get("warmup_statuses", {}).items()}
            if warm and set(warm) != {200}:
                return {"warmup_statuses": warm}
            cpu0 = proxy.cpu_by_pid() if proxy else {}
            ticks0 = proxy.cpu_ticks_by_pid() if proxy else {}
            rss0 = proxy.rss_kb() if proxy else 0
            machine0 = _machine_cpu()
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            result = lines.read(timeout)
            if settle:
                time.sleep(settle)
            machine = _machine_busy(machine0, _machine_cpu())
            if machine:
                result.update(machine)
            if spec["workload"] == "idle":
                if idle_wait is not None:
                    result.update(idle_wait(proxy))
                time.sleep(0.5)  # let the proxy settle its buffers
            if proxy is not None:
                # Per process of the proxy's tree (a supervisor and its workers): a process
                # that appeared during the window counts from zero.
                by_pid = {p: c - cpu0.get(p, 0.0) for p, c in proxy.cpu_by_pid().items()}
                ticks = proxy.cpu_ticks_by_pid()
                result["proxy_cpu_s"] = sum(by_pid.values())
                result["proxy_cpu_s_ticks"] = sum(t - ticks0.get(p, 0.0)
                                                  for p, t in ticks.items())
                result["proxy_processes"] = len(by_pid)
                # the process started (a worker without its exporter process, issue 45)
                result["proxy_cpu_s_root"] = by_pid.get(proxy.pid)
                if len(by_pid) > 1:
                    result["proxy_cpu_s_by_pid"] = {str(p): c for p, c in by_pid.items()}
                result["proxy_rss_kb_before"] = rss0
                result["proxy_rss_kb_after"] = proxy.rss_kb()
            proc.stdin.write(b"bye\n")
            proc.stdin.flush()
            proc.wait(30)
            return result
        finally:
            stop_process(proc)

    def spec(self, row: Row, workload: str, proxy: Proxy | None) -> dict[str, Any]:
        s = self.sizes
        sse = workload == "sse"
        host = "sse.bench.test" if sse else row.host
        upstream_port = self.sse.port if sse else self.static.port
        spec: dict[str, Any] = {"workload": workload.split("_")[0], "host": host, "port": 443}
        if proxy is None:
            spec.update(direct=["127.0.0.1", upstream_port], cafile=str(self.ca.cert_path))
        elif isinstance(proxy, GatewayProxy):
            intercepted = row.key != "gateway_passthrough"
            spec.update(proxy=["127.0.0.1", proxy.port], proxy_auth=proxy.auth,
                        cafile=str(proxy.ca_cert if intercepted else self.ca.cert_path))
            if row.inject_header:
                spec["headers"] = {"X-Api-Key": proxy.token}
        elif isinstance(proxy, NginxProxy):  # a reverse proxy: dialled as the host itself
            spec.update(direct=["127.0.0.1", proxy.port], cafile=str(self.ca.cert_path))
        elif isinstance(proxy, MitmdumpProxy):
            spec.update(proxy=["127.0.0.1", proxy.port], cafile=str(proxy.ca_cert))
            spec["headers"] = {"X-Api-Key": "sandbox-token-the-script-replaces"}
        else:  # squid maps names, not ports: the CONNECT authority carries the real port
            spec.update(proxy=["127.0.0.1", proxy.port], port=upstream_port,
                        cafile=str(self.ca.cert_path))
        if workload.startswith(("get_c", "new_c", "resume_c")):  # get_c<connections>, …
            spec.update(connections=int(workload.rpartition("_c")[2]), duration=s.get_seconds)
        elif workload == "download":
            spec.update(path="/big")
        elif workload in POST_BODY:
            spec.update(path="/upload", body_size=POST_BODY[workload], duration=s.get_seconds)
        elif workload == "post_agent":
            spec.update(workload="agent", path="/upload", duration=s.get_seconds)
        elif workload == "upload":
            spec.update(path="/upload", body_size=s.upload_bytes)
        elif sse:
            spec.update(streams=s.sse_streams, events=s.sse_events,
                        interval_ms=s.sse_interval_ms)
        elif workload.startswith("idle"):
            spec.update(connections=s.idle_tunnels)
        return spec

    def timeout(self, workload: str) -> float:
        s = self.sizes
        if workload.startswith(("get", "new", "resume", "post")):
            return s.get_seconds + 60
        if workload.startswith("idle"):
            return 60 + s.idle_tunnels * 0.2
        return {"download": 60 + s.big_bytes / 5e6, "upload": 60 + s.upload_bytes / 2e6,
                "sse": 60 + s.sse_streams * s.sse_events
                * s.sse_interval_ms / 100}[workload]

    # -- workloads -----------------------------------------------------------------------

    def run_workload(self, row: Row, workload: str, proxy: Proxy | None,
                     label: str | None = None, pin: bool = True) -> dict[str, Any]:
        label = label or f"{row.key}/{workload}"
        print(f"  {label} ...", end="", flush=True, file=sys.stderr)
        t0 = time.monotonic()
        try:
            res = self.client(self.spec(row, workload, proxy), proxy, self.timeout(workload),
                              pin=pin, idle_wait=self._wait_upstream_idle
                              if workload == "idle_after_timeout" else None,
                              settle=self.sizes.otel_settle if row.proxy in OTEL_KINDS
                              else 0.0)
        except ClientError as exc:
            tail = proxy.log_tail() if proxy is not None else ""
            res = {"error": str(exc)[:800], "proxy_log_tail": tail[-600:]}
        if "warmup_statuses" in res and len(res) == 1:
            if row.key == "gateway_inject" and 401 in res["warmup_statuses"]:
                res = {"na": "injection not available", **res}
            else:
                res = {"error": f"warm-up request answered {res['warmup_statuses']}", **res}
        report.derive(workload, res)
        print(f" {report.brief(workload, res)} ({time.monotonic() - t0:.1f} s)",
              file=sys.stderr)
        return res

    def run_proxy_rows(self, kind: str | None, stack: contextlib.ExitStack) -> None:
        rows = [r for r in ROWS if r.proxy == kind and self.wanted(r.key)]
        if not rows:
            return
        proxy = self.make_proxy(kind, "main") if kind else None
        if proxy is not None:
            print(f"starting {proxy.name} ...", file=sys.stderr)
            stack.callback(proxy.stop)
            proxy.start()
        try:
            for row in rows:
                entry = self.results["rows"].setdefault(row.key, {"label": row.label})
                for workload in row.workloads:
                    if not workload.startswith("idle"):
                        entry[workload] = self.run_workload(row, workload, proxy)
        finally:
            if proxy is not None:
                proxy.stop()
        for row in rows:
            for workload in row.workloads:
                if not workload.startswith("idle"):
                    continue
                # A fresh process per idle measurement: memory freed by earlier workloads
                # would otherwise be reused and hide the per-tunnel cost. idle_after_timeout:
                # the gateway with network.upstream_idle_timeout IDLE_TIMEOUT, measured after
                # it has closed the upstream half of every tunnel.
                after = workload == "idle_after_timeout"
                fresh = self.make_proxy(kind, f"{workload}-{row.key}",
                                        upstream_idle_timeout=IDLE_TIMEOUT if after else None)
                stack.callback(fresh.stop)
                entry = self.results["rows"][row.key]
                try:
                    fresh.start()
                    entry[workload] = self.run_workload(row, workload, fresh)
                except RuntimeError as exc:
                    entry[workload] = {"error": str(exc)[:800]}
                finally:
                    fresh.stop()
                if after:
                    entry[workload]["upstream_idle_timeout"] = IDLE_TIMEOUT

    def _wait_upstream_idle(self, proxy: Proxy | None) -> dict[str, Any]:
        """Wait IDLE_TIMEOUT_WAIT_S, and on until nginx holds no connection (max 20 s).

        Counts ESTABLISHED TCP connections on nginx's port (the gateway's upstream
        halves; nothing else talks to nginx meanwhile) and on the proxy's port (the
        tunnels, which must stay open).
        """
        t0 = time.monotonic()
        port = proxy.port if proxy is not None else 0
        before = {"upstream_conns_before_wait": _established(self.static.port),
                  "tunnels_open_before_wait": _established(port)}
        while True:
            waited = time.monotonic() - t0
            left = _established(self.static.port)
            if waited >= IDLE_TIMEOUT_MAX_WAIT_S or (
                    waited >= IDLE_TIMEOUT_WAIT_S and left == 0):
                break
            time.sleep(0.2)
        return {**before, "idle_wait_s": waited, "upstream_conns_after_wait": left,
                "tunnels_open_after_wait": _established(port)}

    @contextlib.contextmanager
    def _unpinned(self) -> Iterator[None]:
        """The orchestrator (so every process it starts) and nginx on every usable core."""
        every = set(self.all_cpus)
        nginx = self.static.proc.pid if self.static.proc is not None else None
        if self.client_cpu is None or len(every) < 2:
            yield
            return
        os.sched_setaffinity(0, every)
        if nginx is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(nginx, every)
        try:
            yield
        finally:
            os.sched_setaffinity(0, {self.client_cpu})
            if nginx is not None:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(nginx, {self.client_cpu})

    def run_workers(self, stack: contextlib.ExitStack) -> None:
        """``run --workers 1`` then ``--workers 2``, unpinned: intercepted + policy GETs."""
        row = next(r for r in ROWS if r.key == WORKER_ROW)
        workloads = [f"get_c{c}" for c in self.sizes.worker_concurrency]
        section: dict[str, Any] = {
            "label": f"{row.label}, GET /small", "host": row.host,
            "duration_s": self.sizes.get_seconds, "cores": sorted(self.all_cpus),
            "note": WORKERS_NOTE, "workers": {}, "scaling": {}}
        self.results["workers"] = section
        with self._unpinned():
            for n in WORKER_COUNTS:
                entry: dict[str, Any] = section["workers"].setdefault(str(n), {})
                proxy = GatewayProxy(self.workdir / f"gateway-workers{n}", self.ca.cert_path,
                                     self.static.port, self.sse.port, None, workers=n)
                print(f"starting gateway --workers {n} (unpinned) ...", file=sys.stderr)
                stack.callback(proxy.stop)
                try:
                    proxy.start()
                    entry["idle_rss"] = idle_rss(proxy.pid, self.sizes.idle_settle)
                    print(f"  workers={n}/idle ... RSS {_rss_text(entry['idle_rss'])}",
                          file=sys.stderr)
                    for w in workloads:
                        entry[w] = self.run_workload(row, w, proxy, f"workers={n}/{w}",
                                                     pin=False)
                except RuntimeError as exc:  # could not start: say so, go on
                    print(f"  gateway --workers {n}: {exc}", file=sys.stderr)
                    for w in workloads:
                        entry.setdefault(w, {"error": str(exc)[:800]})
                finally:
                    proxy.stop()
        runs = section["workers"]
        for w in workloads:
            one, two = (runs.get(str(n), {}).get(w, {}) for n in WORKER_COUNTS)
            if one.get("rps") and two.get("rps") and "error" not in one and "error" not in two:
                section["scaling"][w] = two["rps"] / one["rps"]
        print("  scaling " + ", ".join(f"{w}: {v:.2f}x" for w, v in section["scaling"].items())
              + " (unpinned, cores shared with the client)", file=sys.stderr)

    def run_pass_rounds(self) -> None:
        """Passthrough's small requests against squid's in alternating rounds
        (bench/pass_rounds.py)."""
        print("passthrough vs squid, alternating rounds ...", file=sys.stderr)
        rows = {"gateway": next(r for r in ROWS if r.key == "gateway_passthrough"),
                "squid": next(r for r in ROWS if r.key == "squid")}
        try:
            found = pass_rounds.run(self, rows, self.sizes.pass_rounds,
                                    self.sizes.pass_round_seconds)
        except RuntimeError as exc:
            found = {"error": str(exc)[:800]}
        self.results["pass_rounds"] = found
        if "median" in found:
            print(f"  gateway vs squid: {found['median']:.2f}x (median of {found['rounds']} "
                  f"rounds, {min(found['ratios']):.2f} to {max(found['ratios']):.2f}x)",
                  file=sys.stderr)

    def run_dlp_instructions(self) -> None:
        """Detection on against off on the POST workloads, in instructions under
        callgrind (bench/dlp_instructions.py: what the issue's target judges)."""
        print("credential detection on vs off, instructions under callgrind ...",
              file=sys.stderr)
        pinned = os.sched_getaffinity(0)
        if self.all_cpus:  # (counts do not depend on cores: the processes get them all)
            os.sched_setaffinity(0, set(self.all_cpus))
        try:
            found = dlp_instructions.run(self.sizes.dlp_instruction_seconds)
        finally:
            os.sched_setaffinity(0, pinned)
        self.results["dlp_instructions"] = found
        for workload, _, _ in dlp_instructions.WORKLOADS:
            part = found.get(workload) or {}
            print(f"  {workload}: " + (f"on vs off {part['ratio']:.3f}x ({part['on']:,} vs "
                                       f"{part['off']:,})" if "ratio" in part
                                       else part.get("error", "?")), file=sys.stderr)

    def run_dlp_rounds(self) -> None:
        """Detection on against off on the POST rows' workloads, in alternating rounds
        (bench/dlp_rounds.py)."""
        print("credential detection on vs off, alternating rounds ...", file=sys.stderr)
        rows = (next(r for r in ROWS if r.key == "gateway_post"),
                next(r for r in ROWS if r.key == "gateway_post_dlp"))
        try:
            found = dlp_rounds.run(self, rows, self.sizes.dlp_rounds,
                                   self.sizes.dlp_round_seconds)
        except RuntimeError as exc:
            found = {"error": str(exc)[:800]}
        self.results["dlp_rounds"] = found
        for what, part in (("2 KB POST", found.get("post_2k")),
                           ("1 MiB POST", found.get("post_1m")),
                           ("agent's request", found.get("post_agent")), ("upload", found)):
            if part and "median" in part:
                print(f"  {what}: on vs off {part['median']:.2f}x (median of "
                      f"{found['rounds']} rounds, {min(part['ratios']):.2f} to "
                      f"{max(part['ratios']):.2f}x)", file=sys.stderr)

    def run_otel_rounds(self) -> None:
        """The export's cost against export off in alternating rounds (bench/otel_rounds.py)."""
        print("OTLP export, alternating rounds ...", file=sys.stderr)
        row = next(r for r in ROWS if r.key == "gateway_policy")
        try:
            found = otel_rounds.run(self, row, self.sizes.otel_rounds,
                                    self.sizes.otel_round_seconds, self.sizes.otel_settle)
        except RuntimeError as exc:
            found = {"error": str(exc)[:800]}
        self.results["otel_rounds"] = found
        for kind in otel_rounds.GATEWAYS[1:]:
            if f"{kind}_tree_median" in found:
                print(f"  {kind}: tree {found[kind + '_tree_median']:.2f}x, worker "
                      f"{found[kind + '_worker_median']:.2f}x vs off (medians of "
                      f"{found['rounds']} rounds)", file=sys.stderr)

    def make_proxy(self, kind: str | None, tag: str,
                   upstream_idle_timeout: str | None = None) -> Proxy:
        d = self.workdir / f"{kind}-{tag}"
        if kind in OTEL_KINDS:
            receiver = self.otlp_receiver()
            logs, sample = OTEL_KINDS[kind]
            return GatewayProxy(d, self.ca.cert_path, self.static.port, self.sse.port,
                                self.proxy_cpu, telemetry={
                                    "endpoint": receiver.grpc_endpoint, "protocol": "grpc",
                                    "metrics_interval": "5s", "sample": sample}, otlp_logs=logs,
                                children_cpu=self.client_cpu if kind.endswith("_apart")
                                else None)
        if kind == "gateway":
            return GatewayProxy(d, self.ca.cert_path, self.static.port, self.sse.port,
                                self.proxy_cpu, upstream_idle_timeout=upstream_idle_timeout)
        if kind == "mitmdump":
            return MitmdumpProxy(d, self.ca.cert_path, self.static.port, self.sse.port,
                                 self.proxy_cpu)
        if kind == "squid":
            return SquidProxy(d, self.static.port, self.sse.port, self.proxy_cpu)
        if kind == "nginx":
            return NginxProxy(d, self.ca, self.static.port, self.proxy_cpu)
        raise ValueError(kind)

    def otlp_receiver(self) -> Any:
        """The OTLP/gRPC receiver the export row sends to (tests/helpers/otlp_receiver.py),
        started once, in this process (the client's core)."""
        if getattr(self, "_otlp", None) is None:
            from helpers.otlp_receiver import OtlpReceiver
            self._otlp = OtlpReceiver()
            self._otlp_stack.callback(self._otlp.close)
        return self._otlp

    def wanted(self, key: str) -> bool:
        return not self.only or key in self.only

    # -- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.results = {"meta": report.machine_info(), "rows": {}}
        self.results["meta"].update(
            quick=self.sizes is QUICK, sizes=self.sizes.__dict__,
            cores={"proxy": self.proxy_cpu, "client_and_upstream": self.client_cpu})
        with contextlib.ExitStack() as stack:
            self._otlp_stack = stack
            if any(self.wanted(r.key) for r in ROWS) or self.wanted("workers") or \
                    self.wanted("otel_rounds") or self.wanted("pass_rounds") or \
                    self.wanted("dlp_rounds"):
                self.ca = LocalCA.create(self.workdir / "ca")
                print("starting upstreams ...", file=sys.stderr)
                self.static = StaticUpstream(self.workdir, self.ca, self.sizes.big_bytes,
                                             self.client_cpu)
                stack.callback(self.static.stop)
                self.static.start()
                self.sse = SSEServer(self.workdir, self.ca)
                stack.callback(self.sse.stop)
                self.sse.start()
                self.results["meta"]["upstream"] = self.static.kind
                for kind in (None, "gateway", *OTEL_KINDS, "nginx", "mitmdump", "squid"):
                    try:
                        self.run_proxy_rows(kind, stack)
                    except RuntimeError as exc:  # a proxy that cannot start: say so, go on
                        print(f"  {kind}: {exc}", file=sys.stderr)
                        for row in ROWS:
                            if row.proxy == kind and self.wanted(row.key):
                                entry = self.results["rows"].setdefault(
                                    row.key, {"label": row.label})
                                for w in row.workloads:
                                    entry.setdefault(w, {"error": str(exc)[:800]})
                if getattr(self, "_otlp", None) is not None:  # (the rows' gateways stopped:
                    self.results["meta"]["otlp_received"] = {  # everything is exported)
                        "spans": len(self._otlp.spans()), "logs": len(self._otlp.logs())}
                if self.wanted("workers"):
                    self.run_workers(stack)
                if self.wanted("otel_rounds"):
                    self.run_otel_rounds()
                if self.wanted("pass_rounds"):
                    self.run_pass_rounds()
                if self.wanted("dlp_rounds"):
                    self.run_dlp_rounds()
            if self.wanted("dlp_instructions") and self.sizes.dlp_instruction_seconds:
                self.run_dlp_instructions()
            if self.wanted("metering"):
                print("metering overhead ...", file=sys.stderr)
                ca = getattr(self, "ca", None) or LocalCA.create(self.workdir / "ca-metering")
                try:
                    self.results["metering"] = metering.run(
                        self.workdir, ca, self.proxy_cpu,
                        requests=self.sizes.metering_requests,
                        rounds=self.sizes.metering_rounds)
                except RuntimeError as exc:
                    self.results["metering"] = {"error": str(exc)[:800]}
        if self.wanted("policy"):
            print("policy decisions ...", file=sys.stderr)
            self.results["policy"] = micro.policy_decisions(list(self.sizes.policy_sizes),
                                                            self.sizes.policy_samples)
        if self.wanted("secret"):
            print("cold secret ...", file=sys.stderr)
            self.results["cold_secret"] = micro.cold_secret(self.sizes.secret_concurrency)
        if self.wanted("dlp"):
            print("credential detection ...", file=sys.stderr)
            self.results["dlp"] = micro.dlp_scan(self.sizes.dlp_stream_mib)
        self.results["targets"] = targets.evaluate(self.results)
        return self.results


def _established(port: int) -> int:
    """ESTABLISHED TCP connections whose local port is ``port`` (/proc/net/tcp, tcp6)."""
    if not port:
        return 0
    want = f":{port:04X}"
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 3 and parts[1].endswith(want) and parts[3] == "01":
                        n += 1
        except OSError:
            pass
    return n


def _machine_cpu() -> list[int] | None:
    """The ``cpu`` line of /proc/stat: jiffies of every core, by state."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def _machine_busy(before: list[int] | None, after: list[int] | None) -> dict[str, float]:
    """Whole-machine CPU use between two samples, % of all cores (busy, and stolen)."""
    if not before or not after or len(before) < 8 or len(after) < 8:
        return {}
    d = [b - a for a, b in zip(before, after, strict=False)][:8]
    total = sum(d)  # user nice system idle iowait irq softirq steal
    if total <= 0:
        return {}
    idle = d[3] + d[4]
    return {"machine_busy_pct": 100 * (total - idle - d[7]) / total,
            "machine_steal_pct": 100 * d[7] / total}


def _cores() -> tuple[int | None, int | None]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        return cores[0], cores[1]
    return None, None


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP unwind like Ctrl-C, so every started process is stopped."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def idle_rss(pid: int, settle: float = 2.0) -> dict[str, Any]:
    """Resident memory (MiB) of a started gateway at idle, `settle` s after start: its
    process, each worker it runs, and the total (what `make run` holds before any
    request)."""
    time.sleep(settle)

    def rss(p: int) -> float:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    workers = [rss(int(c)) for c in children]
    main = rss(pid)
    return {"process": main, "workers": workers, "total": main + sum(workers),
            "per_worker": max(workers) if workers else main}


def _rss_text(found: dict[str, Any]) -> str:
    workers = " + ".join(f"{w:.0f}" for w in found["workers"])
    return (f"{found['total']:.0f} MiB" + (f" ({found['process']:.0f} supervisor + {workers} "
                                           "workers)" if workers else " (one process)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, ~0.5 s per workload (the smoke test uses this)")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/<date>.json)")
    parser.add_argument("--markdown", type=Path,
                        help="markdown table (default bench/results/latest.md; "
                             "--quick: next to --out)")
    parser.add_argument("--only", default="",
                        help="comma-separated rows/sections: " + ", ".join(
                            [r.key for r in ROWS] + list(SECTIONS)))
    args = parser.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = only - {r.key for r in ROWS} - set(SECTIONS)
    if unknown:
        parser.error(f"unknown --only entries: {', '.join(sorted(unknown))}")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H%M%SZ")
    out = args.out or RESULTS / f"{stamp}{'-quick' if args.quick else ''}.json"
    md = args.markdown or (out.with_suffix(".md") if args.quick else RESULTS / "latest.md")
    proxy_cpu, client_cpu = _cores()
    all_cpus = tuple(sorted(os.sched_getaffinity(0)))
    if client_cpu is not None:
        os.sched_setaffinity(0, {client_cpu})  # the orchestrator + SSE server thread
    with _signals_raise(), tempfile.TemporaryDirectory(prefix="sandbox-gateway-bench-") as tmp:
        bench = Bench(QUICK if args.quick else FULL, Path(tmp), proxy_cpu, client_cpu, only,
                      all_cpus)
        try:
            results = bench.run()
        except KeyboardInterrupt:
            print("interrupted; every started process was stopped", file=sys.stderr)
            return 130
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=False, default=str) + "\n")
    text = report.text_table(results)
    print(text)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(report.markdown(results))
    print(f"\nJSON: {out}\nmarkdown: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
