"""``python -m bench.otel_lines [--logs] [--lines N] [--instructions]``: what the OTLP
exporter process spends per audit line, outside the gateway.

Feeds N frames as the worker sends them (`otel_feed`: a typical intercepted GET's audit
line) through the exporter process's own path — `otel_export.parse`, `OtelExport.emit`,
the batches encoded in the sending thread — with the network send left out (a no-op in
place of the gRPC call), and reports CPU µs per line over all its threads
(`time.process_time`). ``--instructions`` counts instructions instead, with valgrind's
callgrind: two runs of the script (N and 11 N lines), their difference divided by
10 N, so start-up and imports cancel out (about ±0.5 %, whatever the machine's load).
The exporter's cost per line is also its share of the gateway's process tree per
request (one audit line per intercepted request).
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

LINE = {  # an intercepted, allowed GET's audit line, as the JSON sink writes it
    "sandbox": "sandbox-1", "policy": "agent", "jti": "164ab491f2e4435ba6ec0857e5bd544a",
    "client": "127.0.0.1:58142", "listener": "proxy", "method": "GET", "scheme": "https",
    "host": "policy.bench.test", "port": 443, "path": "/small", "decision": "allow",
    "reason": "allowed by rule policies/agent.yaml:6 (host: policy.bench.test)",
    "rule": "policies/agent.yaml:6", "status": 200, "error": None, "bytes_in": 1000,
    "bytes_out": 0, "duration_ms": 1.873, "path_taken": "intercept", "engine": "h1",
    "credential": None, "policy_rev": "sha256:14b5744a5785", "usage": None,
    "workload": None, "mcp": None, "models": None, "trace": None, "dlp": None,
    "time": "2026-11-29T09:15:31.339Z", "worker": 0}


def frames(count: int) -> list[bytes]:
    """`count` frames as `otel_feed.OtelFeed.tap` builds them (traced, no content); made
    from one template, so that building them costs little beside what is measured."""
    now = time.time_ns()
    line = json.dumps({**LINE, "path": "/small/%d"}, separators=(",", ":")).encode()
    frame = b"T\x1f%d\x1f\x1f\x1f" + line
    return [frame % (now + n, n % 50) for n in range(count)]


def run(count: int, logs: bool) -> float:
    """CPU seconds (all threads) the exporter's path spends on `count` lines."""
    from gateway.observability import otel_send

    def no_network(kind: str, endpoint: str, headers: dict[str, str]) -> object:
        return lambda data: None
    otel_send._grpc = no_network  # type: ignore[assignment]  # (the send left out)
    from gateway.observability import otel_export
    from gateway.observability.otel import OtelExport

    todo = frames(count)
    export = OtelExport(endpoint="http://127.0.0.1:9", traces=True, logs=logs,
                        metrics_on=False, queue=1 << 24)
    text = hasattr(export, "emit_json")  # (the line read by the exporter: since 11-29 PM)
    start = time.process_time()
    for n, frame in enumerate(todo):
        if text:
            traced, end, provider, content, raw = otel_export.read(frame)
            export.emit_json(raw, end, traced, provider, content)
        else:
            traced, end, provider, content, line, *rest = otel_export.parse(frame)
            export.emit(line, end, traced, provider, content, *rest)
        if n % 64 == 0:
            export.tick()
    export.close(timeout=60)
    spent = time.process_time() - start
    dropped = sum(export.drops().values()) if hasattr(export, "drops") else 0
    if dropped:
        raise SystemExit(f"{dropped} dropped: the measure is not of every line")
    return spent


_TOTAL = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)


def instructions(count: int, logs: bool) -> float:
    """Instructions per line: callgrind runs of `count` and 11 `count` lines, diffed."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    totals = []
    with tempfile.TemporaryDirectory(prefix="sandbox-gateway-otel-lines-") as tmp:
        for n in (count, 11 * count):
            out = Path(tmp) / f"callgrind.{n}"
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                            sys.executable, "-m", "bench.otel_lines", "--lines", str(n),
                            *(["--logs"] if logs else [])], check=True,
                           capture_output=True)
            found = _TOTAL.search(out.read_text(errors="replace"))
            if found is None:
                raise SystemExit(f"no total in {out}")
            totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / (10 * count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--logs", action="store_true", help="a log record per line too")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions with callgrind (N = lines / 10)")
    args = parser.parse_args()
    what = "span + log record" if args.logs else "span"
    if args.instructions:
        per = instructions(max(1, args.lines // 10), args.logs)
        print(f"{what}: {per:,.0f} instructions a line")
        return
    spent = run(args.lines, args.logs)
    print(f"{what}: {spent / args.lines * 1e6:.1f} µs CPU a line ({args.lines} lines)")


if __name__ == "__main__":
    main()
