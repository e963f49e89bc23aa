"""``python -m bench.otel_lines [--logs] [--lines N] [--kind K] [--instructions]
[--lines-file F]``: what the OTLP exporter process spends per audit line, outside the
gateway, on audit lines a real gateway wrote.

First the lines: a gateway (`bench.proxies.GatewayProxy`, one worker, nginx behind it)
answers a few seconds of the load client's keep-alive GETs of each kind: ``policy``
(GET /small on policy.bench.test, allowed by its rule: the ``otel_rounds`` row),
``inject`` (the token swapped for the key), ``refused`` (a path no rule allows: 403);
its JSON audit sink's lines (the bytes the worker's tap hands to the exporter) are framed
by the worker's own code (`otel_feed.OtelFeed`: its tap and flush, over a real
SOCK_SEQPACKET pair) into the datagrams the exporter would receive, cut at
`otel_feed.BATCH` bytes as under load, and kept in ``--lines-file`` (made when missing;
``mixed``: the three kinds interleaved).

Then the exporter's own path over N of those lines, datagram by datagram, as its loop
runs it (`otel_export.serve`'s per-datagram step, then its batches encoded in the
sending thread), with the network send left out (a no-op in place of the gRPC call); it
reports CPU µs per line over all its threads (`time.process_time`). ``--instructions``
counts instructions instead, with valgrind's callgrind: two runs of the script (N and
11 N lines), their difference divided by 10 N, so start-up, imports and reading the
file cancel out (about ±0.5 %, whatever the machine's load). The exporter's cost per line
is also its share of the gateway's process tree per request (one audit line per
intercepted request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = ("policy", "inject", "refused")
_LENGTH = struct.Struct("<I")


def capture(path: Path, seconds: float = 3.0) -> None:
    """Run a gateway, keep its audit lines of each kind framed as datagrams in `path`."""
    from bench.proxies import ROOT, GatewayProxy, stop_process
    from bench.upstream import LocalCA, SSEServer, StaticUpstream

    lines: dict[str, list[bytes]] = {}
    with tempfile.TemporaryDirectory(prefix="sandbox-gateway-otel-lines-") as tmp:
        work = Path(tmp)
        ca = LocalCA.create(work / "ca")
        static, sse = StaticUpstream(work, ca, 1000, None), SSEServer(work, ca)
        gateway = None
        try:
            static.start()
            sse.start()
            gateway = GatewayProxy(work / "gateway", ca.cert_path, static.port, sse.port,
                                   None, workers=1)
            gateway.start()
            audit = gateway.dir / "audit.log"
            for kind in KINDS:
                spec: dict[str, Any] = {
                    "workload": "get", "host": "policy.bench.test", "port": 443,
                    "connections": 10, "duration": seconds, "cpu": None,
                    "proxy": ["127.0.0.1", gateway.port], "proxy_auth": gateway.auth,
                    "cafile": str(gateway.ca_cert)}
                if kind == "inject":
                    spec.update(host="inject.bench.test",
                                headers={"X-Api-Key": gateway.token})
                if kind == "refused":
                    spec["path"] = "/refused-by-policy"
                before = audit.stat().st_size if audit.exists() else 0
                client = subprocess.Popen([sys.executable, "-m", "bench.load",
                                           json.dumps(spec)], cwd=ROOT,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                assert client.stdin is not None and client.stdout is not None
                try:
                    client.stdout.readline()
                    client.stdin.write(b"go\n")
                    client.stdin.flush()
                    client.stdout.readline()
                    client.stdin.write(b"bye\n")
                    client.stdin.flush()
                    client.wait(30)
                finally:
                    stop_process(client)
                time.sleep(0.5)  # (the sink's last lines written)
                with audit.open("rb") as f:
                    f.seek(before)
                    lines[kind] = [ln for ln in f.read().splitlines(keepends=True)
                                   if b'"host":"' in ln and b'"method":"CONNECT"' not in ln]
                if not lines[kind]:
                    raise SystemExit(f"no audit line of {kind}: {gateway.log_tail()}")
        finally:
            if gateway is not None:
                gateway.stop()
            sse.stop()
            static.stop()
    mixed = [ln for group in zip(*lines.values(), strict=False) for ln in group]
    with path.open("wb") as out:
        for kind, group in (*lines.items(), ("mixed", mixed)):
            for datagram in _datagrams(group):
                name = kind.encode()
                out.write(_LENGTH.pack(len(name)) + name + _LENGTH.pack(len(datagram)) +
                          _LENGTH.pack(datagram.count(b"\n")) + datagram)


def _datagrams(lines: list[bytes]) -> list[bytes]:
    """`lines` framed and cut into datagrams by the worker's tap (`OtelFeed`: traced,
    sample 1, on an event loop whose flush timer never comes first: cut at BATCH bytes,
    as under load), read from a real socket pair as the exporter reads them."""
    from gateway.observability.otel_feed import OtelFeed

    out: list[bytes] = []

    def drain(sock: socket.socket) -> None:
        while True:
            try:
                out.append(sock.recv(1 << 20))
            except BlockingIOError:
                return

    async def tap_all() -> None:
        feed = OtelFeed(traces=True, queue=1 << 30)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with ours, theirs:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            theirs.setblocking(False)
            feed.sock = ours
            for line in lines:
                feed.tap(json.loads(line), time.time(), line)
                drain(theirs)
            feed.flush()
            drain(theirs)
            feed.sock = None

    asyncio.run(tap_all())
    return out


def load(path: Path, kind: str) -> list[tuple[bytes, int]]:
    """The datagrams of `kind` kept in `path`, with how many lines each holds (counted
    when captured: `bytes.count` runs a byte at a time, more than the exporter's share)."""
    data = path.read_bytes()
    out, at = [], 0
    while at < len(data):
        (size,) = _LENGTH.unpack_from(data, at)
        name = data[at + 4:at + 4 + size]
        at += 4 + size
        size, lines = _LENGTH.unpack_from(data, at)[0], _LENGTH.unpack_from(data, at + 4)[0]
        if name == kind.encode():
            out.append((data[at + 8:at + 8 + size], lines))
        at += 8 + size
    if not out:
        raise SystemExit(f"no datagram of {kind} in {path}")
    return out


def plan(datagrams: list[tuple[bytes, int]], count: int) -> tuple[list[bytes], int]:
    """Whole datagrams, in turn, until they hold at least `count` lines; and how many."""
    todo, lines, n = [], 0, 0
    while lines < count:
        datagram, held = datagrams[n % len(datagrams)]
        todo.append(datagram)
        lines += held
        n += 1
    return todo, lines


def run(todo: list[bytes], logs: bool) -> float:
    """CPU seconds (all threads) the exporter's path spends on the datagrams `todo`."""
    from gateway.observability import otel_send

    def no_network(kind: str, endpoint: str, headers: dict[str, str]) -> object:
        return lambda data: None
    otel_send._grpc = no_network  # type: ignore[assignment]  # (the send left out)
    from gateway.observability import otel_export
    from gateway.observability.otel import OtelExport

    export = OtelExport(endpoint="http://127.0.0.1:9", traces=True, logs=logs,
                        metrics_on=False, queue=1 << 24)
    bad = [0]
    take = getattr(otel_export, "take", None)  # (the loop's step: since 11-29 evening)
    start = time.process_time()
    for data in todo:
        if take is not None:
            take(data, export.emit_json, bad, export.emit_many)
        else:  # (the per-frame loop of `serve` before)
            for frame in otel_export._frames(data):
                traced, end, provider, content, raw = otel_export.read(frame)
                export.emit_json(raw, end, traced, provider, content)
        export.tick()
    export.close(timeout=60)
    spent = time.process_time() - start
    dropped = sum(export.drops().values()) + bad[0]
    if dropped:
        raise SystemExit(f"{dropped} dropped or unreadable: the measure is not of every line")
    return spent


_TOTAL = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)


def instructions(path: Path, kind: str, count: int, logs: bool) -> float:
    """Instructions per line: callgrind runs of `count` and 11 `count` lines, diffed."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    datagrams = load(path, kind)
    totals, lines = [], []
    args = ["--kind", kind, "--lines-file", str(path), *(["--logs"] if logs else [])]
    # (a run first without callgrind: what it imports compiled and cached, so that the
    # first counted run does not count compiling)
    subprocess.run([sys.executable, "-m", "bench.otel_lines", "--lines", "1", *args],
                   check=True, capture_output=True)
    with tempfile.TemporaryDirectory(prefix="sandbox-gateway-otel-lines-") as tmp:
        for n in (count, 11 * count):
            lines.append(plan(datagrams, n)[1])
            out = Path(tmp) / f"callgrind.{n}"
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                            sys.executable, "-m", "bench.otel_lines", "--lines", str(n),
                            *args], check=True,
                           capture_output=True)
            found = _TOTAL.search(out.read_text(errors="replace"))
            if found is None:
                raise SystemExit(f"no total in {out}")
            totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / (lines[1] - lines[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--logs", action="store_true", help="a log record per line too")
    parser.add_argument("--kind", choices=(*KINDS, "mixed"), default="policy")
    parser.add_argument("--lines-file", type=Path, default=None,
                        help="the captured datagrams (made there when missing)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions with callgrind (N = lines / 10)")
    args = parser.parse_args()
    what = "span + log record" if args.logs else "span"
    with tempfile.TemporaryDirectory(prefix="sandbox-gateway-otel-lines-") as tmp:
        path = args.lines_file or Path(tmp) / "datagrams.bin"
        if not path.exists():
            capture(path)
        if args.instructions:
            per = instructions(path, args.kind, max(1, args.lines // 10), args.logs)
            print(f"{what}, {args.kind} lines: {per:,.0f} instructions a line")
            return
        todo, lines = plan(load(path, args.kind), args.lines)
        spent = run(todo, args.logs)
        print(f"{what}, {args.kind} lines: {spent / lines * 1e6:.2f} µs CPU a line "
              f"({lines} lines, {len(todo)} datagrams)")


if __name__ == "__main__":
    main()
