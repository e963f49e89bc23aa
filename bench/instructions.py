"""``python -m bench.instructions [--row inject|policy|post|post_dlp|bulk]
[--connection keep|new|resume] [--agent] [--seconds S] [--top N]``: the gateway's CPU instructions
per intercepted request (``bulk``: per MiB of an intercepted download), counted by
valgrind's callgrind.

The timing rows of ``python -m bench`` move by 10-20 % with whatever else runs on the
machine; an instruction count does not. This runs the gateway (one process, under
``valgrind --tool=callgrind`` with instrumentation off), warms ten keep-alive connections
through it to nginx, then counts only the measured phase (``callgrind_control -i on``)
of the load client's keep-alive GETs (c10), subtracts what the process counts in a
window as long with no request (its timers), and divides by the requests answered. Two
checkouts compared this way differ by what their code does, not by the machine's load:
run it in each and compare the figures (about 1-2 minutes each; the gateway runs about
50x slower under callgrind, so a run answers a few hundred requests). ``--connection
new`` puts each GET on a new connection (CONNECT, a full TLS handshake, the request, the
close: the bench's ``new_c10``), ``resume`` on a new connection resuming the warm-up's TLS
session (``resume_c10``): what a connection costs besides its request. ``--row bulk``
downloads ``--body`` bytes (default 1 MiB; 64 MiB is a few seconds under callgrind) on
one warm intercepted connection (the bench's ``download`` workload on the intercept +
policy row) and divides by the MiB. ``--agent`` makes the post rows send a coding agent's
request instead (the bench's ``post_agent``: the OpenAI SDK's head with new ids, a 13 KB
chat with code): ``post`` against ``post_dlp`` is what detection adds to one, in
instructions, where the timing rows read the instructions and the cache misses alike.

The gateway runs on the allocator `run` would choose (jemalloc where installed);
``BENCH_GATEWAY_ENV=PYTHONMALLOC=pymalloc`` measures CPython's own instead.

With ``--otel spans|logs`` (OTLP export to a local receiver) the worker's exporter process
runs under callgrind too (``--trace-children``) and is counted over the same windows:
the figures are the worker's, the exporter's and their sum (the gateway's process tree per
request). Both processes run about 50x slower under callgrind, so the exporter's batches
are smaller than at full speed (fewer lines a datagram, a wake-up and an export): its
count is an upper bound of its cost a line (``python -m bench.otel_lines`` measures the
exporter's path at full batches). Needs
``valgrind`` (Debian ``valgrind``) and nginx as ``python -m bench`` does. Listens
and connects on 127.0.0.1 only; every process it starts is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.proxies import ROOT, GatewayProxy, stop_process
from bench.upstream import LocalCA, SSEServer, StaticUpstream

try:
    from gateway.runtime.allocator import environment
except ImportError:  # (a checkout from before jemalloc: nothing to set)
    def environment(env: Any) -> dict[str, str] | None:  # type: ignore[misc]
        return None

HOSTS = {"inject": "inject.bench.test", "policy": "policy.bench.test",
         "post": "upload.bench.test", "post_dlp": "dlp.bench.test",
         "bulk": "policy.bench.test"}
MIB = 1 << 20
_COUNT = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$")


def measure(row: str, seconds: float, top: int, body: int = 1 << 20,
            otel: str = "off", connection: str = "keep",
            keep: Path | None = None, agent: bool = False) -> dict[str, Any]:
    """Instructions per request of `row` (inject: the token swapped for the key; post and
    post_dlp: POSTs of `body` bytes of JSON without a credential, without and with
    outbound credential detection), on keep-alive connections or (`connection` new,
    resume) each on a new one, with a full or a resumed TLS handshake. `otel`: OTLP
    export on (spans, or logs: spans and log records, to a local OTLP receiver): the
    worker's exporter process is counted too, apart (``exporter_*``; ``tree_*``: the
    sum). `keep`: where to copy the measured phase's (the worker's) callgrind dump."""
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: apt-get install valgrind")
    with tempfile.TemporaryDirectory(prefix="sandbox-gateway-instructions-") as tmp:
        work = Path(tmp)
        out = work / "callgrind.out"  # (with --otel: callgrind.out.<pid>, a process each)
        ca = LocalCA.create(work / "ca")
        static = StaticUpstream(work, ca, body if row == "bulk" else 1000, None)
        sse = SSEServer(work, ca)
        gateway: GatewayProxy | None = None
        client: subprocess.Popen[bytes] | None = None
        receiver: Any = None
        try:
            static.start()
            sse.start()
            telemetry = None
            if otel != "off":
                if str(ROOT / "tests") not in sys.path:
                    sys.path.insert(0, str(ROOT / "tests"))
                from helpers.otlp_receiver import OtlpReceiver
                receiver = OtlpReceiver()
                telemetry = {"endpoint": receiver.grpc_endpoint, "protocol": "grpc",
                             "metrics_interval": "5s"}
            wrap: tuple[str, ...] = ("valgrind", "--tool=callgrind", "--instr-atstart=no",
                                     f"--callgrind-out-file={out}")
            if otel != "off":  # (the exporter process under callgrind too, a file each)
                wrap = (*wrap[:3], "--trace-children=yes",
                        f"--callgrind-out-file={out}.%p")
            gateway = GatewayProxy(
                work / "gateway", ca.cert_path, static.port, sse.port, None, workers=1,
                ready_seconds=300, wrap=wrap, telemetry=telemetry,
                otlp_logs=otel == "logs")
            # `run` starts itself again on jemalloc (gateway/runtime/allocator.py), and
            # valgrind does not follow an exec: the allocator's environment is set here.
            gateway.env.update(environment(gateway.env) or {})
            gateway.start()
            spec: dict[str, Any] = {
                "workload": "get", "host": HOSTS[row], "port": 443, "connections": 10,
                "duration": seconds, "cpu": None, "proxy": ["127.0.0.1", gateway.port],
                "proxy_auth": gateway.auth, "cafile": str(gateway.ca_cert)}
            if row.startswith("post"):
                spec.update(workload="agent" if agent else "post", path="/upload",
                            body_size=body, connections=2)
            if row == "inject":
                spec["headers"] = {"X-Api-Key": gateway.token}
            if row == "bulk":
                spec.update(workload="download", path="/big", connections=1)
            if connection != "keep":
                if row.startswith("post") or row == "bulk":
                    raise SystemExit("--connection new|resume: the get rows (inject, policy)")
                spec["workload"] = connection
            client = subprocess.Popen([sys.executable, "-m", "bench.load", json.dumps(spec)],
                                      cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert client.stdin is not None and client.stdout is not None
            ready = json.loads(client.stdout.readline())
            if set(ready.get("warmup_statuses") or {}) != {"200"}:
                raise SystemExit(f"warm-up failed: {ready}\n{gateway.log_tail()}")
            pids = [str(gateway.pid)]
            if receiver is not None:  # (its exporter up: the warm-up's spans arrived)
                pids.append(str(_exporter(gateway.pid, receiver)))
            for pid in pids:
                _control("-z", pid)  # (nothing counted before; the counters start at zero)
                _control("-i", "on", pid)
            started = time.monotonic()
            client.stdin.write(b"go\n")
            client.stdin.flush()
            result = json.loads(client.stdout.readline())
            if receiver is not None:
                time.sleep(SETTLE)  # (the last batches exported, in the window)
            window = time.monotonic() - started
            for pid in pids:
                _control("-i", "off", pid)
                _control("-d", pid)
            client.stdin.write(b"bye\n")
            client.stdin.flush()
            client.wait(30)
            # The same window with no request: what the process does anyway (its timers,
            # the sweepers), subtracted so the figure does not depend on how many requests
            # a loaded machine let through the window.
            for pid in pids:
                _control("-z", pid)
                _control("-i", "on", pid)
            time.sleep(window)
            for pid in pids:
                _control("-i", "off", pid)
                _control("-d", pid)
            if row == "bulk":  # (one download: its bytes, counted per MiB below)
                result["ok"] = int(result.get("status") == 200 and result.get("bytes") == body)
            counted = []
            for pid in pids:
                stem = "callgrind.out" if receiver is None else f"callgrind.out.{pid}"
                dumps = sorted(work.glob(f"{stem}.*"), key=lambda p: int(p.suffix[1:]))
                if len(dumps) < 2 or not result.get("ok"):
                    raise SystemExit(f"nothing measured: {result}\n{gateway.log_tail()}")
                if keep is not None and not counted:  # (callgrind_annotate --tree=caller)
                    shutil.copy(dumps[-2], keep)
                total, functions = _annotate(dumps[-2])
                idle, _ = _annotate(dumps[-1])
                counted.append((total, idle, functions))
        finally:
            if client is not None:
                stop_process(client)
            if gateway is not None:
                gateway.stop()
            if receiver is not None:
                receiver.close()
            sse.stop()
            static.stop()
    requests = int(result["ok"]) if row != "bulk" else body / MIB  # (bulk: per MiB)
    if connection == "resume" and result.get("resumed", 0) < requests:
        print(f"warning: {result.get('resumed', 0)} of {requests} connections resumed",
              file=sys.stderr)
    (total, idle, functions), *exporter = counted
    found = {"row": row, "otel": otel, "connection": connection, "requests": requests,
             "instructions": total, "idle_instructions": idle,
             "window_s": round(window, 1),
             "instructions_per_request": round((total - idle) / requests),
             "unit": "MiB" if row == "bulk" else "request",
             "top": [{"function": name, "per_request": round(count / requests)}
                     for name, count in functions[:top]]}
    if exporter:
        spent = exporter[0][0] - exporter[0][1]
        found.update(exporter_instructions=exporter[0][0],
                     exporter_idle_instructions=exporter[0][1],
                     exporter_per_request=round(spent / requests),
                     tree_per_request=round((total - idle + spent) / requests),
                     exporter_top=[{"function": name, "per_request": round(count / requests)}
                                   for name, count in exporter[0][2][:top]])
    return found


SETTLE = 2.0  # seconds the windows go on after the load (the exporter's last batches)


def _exporter(worker: int, receiver: Any, timeout: float = 300.0) -> int:
    """The worker's exporter process, once the warm-up's spans reached `receiver`."""
    from bench.proxies import _tree

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = _tree(worker)[1:]
        if children and receiver.received["traces"]:
            return children[0]
        time.sleep(0.5)
    raise SystemExit("the exporter process exported nothing of the warm-up")


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=60)


def _annotate(path: Path) -> tuple[int, list[tuple[str, int]]]:
    """The dump's total and its functions by self cost, most first."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", str(path)], check=True,
                          capture_output=True, text=True, timeout=300).stdout
    total = 0
    functions: list[tuple[str, int]] = []
    for line in text.splitlines():
        found = _COUNT.match(line)
        if found is None:
            continue
        count = int(found.group(1).replace(",", ""))
        name = re.sub(r"\s*\[.*\]$", "", found.group(2).strip())  # (the object's path)
        if name.startswith("PROGRAM TOTALS"):
            total = count
        else:
            functions.append((name.rsplit("/", 1)[-1][:100] or "?", count))
    return total, functions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--row", choices=sorted(HOSTS), default="inject",
                        help="inject: the token swapped for the key (default); policy: no "
                             "key; post, post_dlp: POSTs of --body bytes (c2), without and "
                             "with credential detection (dlp:); bulk: one download of --body "
                             "bytes, counted per MiB")
    parser.add_argument("--connection", choices=("keep", "new", "resume"), default="keep",
                        help="keep: keep-alive connections (default); new: each request on a "
                             "new connection, a full TLS handshake; resume: the same, "
                             "resuming the warm-up's TLS session")
    parser.add_argument("--body", type=int, default=1 << 20,
                        help="bytes of a post row's JSON body, or of the bulk row's download "
                             "(default 1 MiB)")
    parser.add_argument("--agent", action="store_true",
                        help="post rows: a coding agent's request (bench/agent.py) instead "
                             "of --body bytes of JSON")
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="measured phase (default 15; a few hundred requests)")
    parser.add_argument("--top", type=int, default=0, help="also list the N costliest functions")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--keep", type=Path, help="copy the measured phase's callgrind dump here")
    parser.add_argument("--otel", choices=("off", "spans", "logs"), default="off",
                        help="OTLP export: a span per request, or a span and a log record "
                             "(the worker and its exporter process counted, apart and "
                             "summed)")
    args = parser.parse_args(argv)
    if args.agent and not args.row.startswith("post"):
        raise SystemExit("--agent: the post rows (post, post_dlp)")
    found = measure(args.row, args.seconds, args.top, args.body, args.otel, args.connection,
                    args.keep, args.agent)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    otel = f" (OTLP export: {found['otel']})" if found["otel"] != "off" else ""
    how = {"keep": "keep-alive", "new": "a new connection each",
           "resume": "a resumed connection each"}[found["connection"]]
    if found["unit"] == "MiB":
        print(f"bulk: {found['instructions_per_request']:,} instructions per MiB of an "
              f"intercepted download ({found['requests']:g} MiB, one keep-alive connection)")
    else:
        print(f"{found['row']}{otel}: {found['instructions_per_request']:,} instructions per "
              f"request ({found['requests']} requests, {how})")
    if "tree_per_request" in found:
        print(f"  the worker: {found['instructions_per_request']:,}; its exporter process: "
              f"{found['exporter_per_request']:,}; the tree: {found['tree_per_request']:,}")
        for entry in found["exporter_top"]:
            print(f"  {entry['per_request']:>9,}  {entry['function']} (exporter)")
    for entry in found["top"]:
        print(f"  {entry['per_request']:>9,}  {entry['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
