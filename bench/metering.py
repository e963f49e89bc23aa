"""Metering overhead: gateway CPU per streamed inference request, metered vs not.

One gateway process (pinned like the other rows), one OpenAI-shaped upstream that answers
every POST with a chunked SSE stream (``chunks`` content events, a usage
event, ``[DONE]``), the same key swap on both rules. The only difference is the
credential: ``preset: openai`` on ``api.openai.com`` is metered (the request's model is
read, ``stream_options.include_usage`` added, the stream parsed for usage, counted in
metrics, the ledger and the audit line); the same call to ``plain.bench.test`` under a
custom bearer credential goes to ``/bench/stream``, a path that is not an inference
endpoint, so nothing is metered (any credential's ``/v1/chat/completions`` would be:
OpenAI-compatible providers are metered too). The rows alternate (metered, plain,
metered, plain) so drift hits both alike.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import ssl
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from bench.proxies import _pinned, cpu_seconds
from bench.upstream import ROOT, LocalCA, _LoopThread, free_port

NAMES = ["api.openai.com", "plain.bench.test"]
PATHS = {"api.openai.com": "/v1/chat/completions", "plain.bench.test": "/bench/stream"}
KEY = "sk-bench-metering-key-0123456789"
POLICY = """\
version: v1
name: bench
egress:
  - host: api.openai.com
    credential: openai
  - host: plain.bench.test
    credential: plain
credentials:
  openai: {preset: openai, secret: bench-key}
  plain: {hosts: [plain.bench.test], secret: bench-key, inject: {bearer: true}}
"""
BODY = json.dumps({"model": "gpt-4o-mini", "stream": True,
                   "messages": [{"role": "user", "content": "Say something."}]}).encode()


class StreamingProvider:
    """An OpenAI-shaped chat completions endpoint that always streams."""

    def __init__(self, workdir: Path, ca: LocalCA, chunks: int) -> None:
        d = workdir / "provider"
        d.mkdir(parents=True, exist_ok=True)
        self.ctx = ca.server_context(d, NAMES)
        self.port = free_port()
        self.lt = _LoopThread()
        events = [{"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini",
                   "choices": [{"index": 0, "delta": {"content": f"word{i} "}}]}
                  for i in range(chunks)]
        events.append({"id": "c1", "object": "chat.completion.chunk", "model": "gpt-4o-mini",
                       "choices": [], "usage": {"prompt_tokens": 12,
                                                "completion_tokens": chunks,
                                                "total_tokens": 12 + chunks}})
        self.stream = [f"data: {json.dumps(e)}\n\n".encode() for e in events]
        self.stream.append(b"data: [DONE]\n\n")
        self.keys_seen: set[str] = set()

    def start(self) -> None:
        self.lt.serve(self._handle, self.port, self.ctx)

    def stop(self) -> None:
        self.lt.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError, OSError,
                                 asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (
                    line.partition(":") for line in head.decode("latin-1").split("\r\n")[1:]
                    if line)}
                if "content-length" in headers:
                    await reader.readexactly(int(headers["content-length"]))
                else:  # chunked
                    while (size := int((await reader.readline()).split(b";")[0], 16)):
                        await reader.readexactly(size + 2)
                    await reader.readline()
                self.keys_seen.add(headers.get("authorization", ""))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for event in self.stream:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                writer.write(b"0\r\n\r\n")
                await writer.drain()


async def _client(port: int, auth: str, token: str, host: str, cafile: Path,
                  requests: int) -> int:
    """One keep-alive tunnel, `requests` streamed calls; returns the events received."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    cred = base64.b64encode(auth.encode()).decode()
    writer.write(f"CONNECT {host}:443 HTTP/1.1\r\nProxy-Authorization: Basic {cred}\r\n\r\n"
                 .encode())
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"CONNECT {host}: {head[:200]!r}")
    ctx = ssl.create_default_context(cafile=str(cafile))
    await writer.start_tls(ctx, server_hostname=host)
    request = (f"POST {PATHS[host]} HTTP/1.1\r\nHost: {host}\r\n"
               f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    events = 0
    for _ in range(requests):
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{host}: {head[:300]!r}")
        while (size := int((await reader.readline()).split(b";")[0], 16)):
            events += (await reader.readexactly(size + 2)).count(b"\n\n")
        await reader.readline()
    writer.close()
    return events


def run(workdir: Path, ca: LocalCA, proxy_cpu: int | None, *, requests: int = 200,
        conc: int = 4, chunks: int = 50, rounds: int = 8) -> dict[str, Any]:
    """Gateway CPU µs per streamed request on the metered and the plain rule (medians
    over `rounds` rounds of `requests` calls each) and the median of the rounds'
    metered/plain ratios: a shared VM's CPU time per request drifts by 20% and more
    between seconds, two rows run back to back much less."""
    provider = StreamingProvider(workdir, ca, chunks)
    provider.start()
    gw_dir = workdir / "gateway-metering"
    (gw_dir / "policies").mkdir(parents=True, exist_ok=True)
    (gw_dir / "policies" / "bench.yaml").write_text(POLICY)
    port, admin = free_port(), free_port()
    (gw_dir / "gateway.yaml").write_text(yaml.safe_dump({
        "listen": {"proxy": f"127.0.0.1:{port}", "admin": f"127.0.0.1:{admin}"},
        "policies": str(gw_dir / "policies"), "certs": str(gw_dir / "certs"),
        "secrets": {"store": "env"}, "audit": {"path": str(gw_dir / "audit.log")},
        "log_level": "warning", "workers": 1,
        "network": {"upstream_ca": str(ca.cert_path),
                    "resolve": {n: f"127.0.0.1:{provider.port}" for n in NAMES}}}))
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith(("SANDBOX_GATEWAY_", "HTTP_PROXY", "HTTPS_PROXY"))}
    env["SANDBOX_GATEWAY_SECRET_BENCH_KEY"] = KEY
    log = (gw_dir / "gateway.log").open("wb")
    proc = subprocess.Popen(_pinned([sys.executable, "-m", "gateway", "run", "--config",
                                     str(gw_dir / "gateway.yaml")], proxy_cpu),
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("metering gateway did not start: " + (
                        gw_dir / "gateway.log").read_text(errors="replace")[-800:]) from None
                time.sleep(0.1)
        token = subprocess.run(
            [sys.executable, "-m", "gateway", "token", "mint", "--config",
             str(gw_dir / "gateway.yaml"), "--sandbox", "bench", "--policy", "bench",
             "--ttl", "2h"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
            check=True).stdout.strip()
        cafile = gw_dir / "certs" / "ca.crt"

        def measure(host: str, n: int) -> tuple[float, int]:
            async def all_clients() -> list[int]:
                return await asyncio.gather(*(
                    _client(port, f"bench:{token}", token, host, cafile, n // conc)
                    for _ in range(conc)))
            before = cpu_seconds(proc.pid)
            events = sum(asyncio.run(all_clients()))
            return cpu_seconds(proc.pid) - before, events

        for host in NAMES:  # warm: leaf certificates, pools, imports
            measure(host, conc * 5)
        per_request: dict[str, list[float]] = {h: [] for h in NAMES}
        events = {h: 0 for h in NAMES}
        for r in range(rounds):  # ABBA order: drift between rounds hits both alike
            for host in (NAMES if r % 2 == 0 else NAMES[::-1]):
                seconds, got = measure(host, requests)
                per_request[host].append(seconds / requests * 1e6)
                events[host] += got
        done = requests * rounds
        metered, plain = (statistics.median(per_request[h]) for h in NAMES)
        # Each round's two rows ran back to back: their ratio is what drift cannot move.
        ratio = statistics.median(a / b for a, b in zip(*per_request.values(), strict=True))
        # An exchange's audit line is written once its answer has gone out: the last
        # calls' lines may follow the clients' end by a moment.
        deadline = time.monotonic() + 10
        while True:
            audit = (gw_dir / "audit.log").read_text()
            usage = [json.loads(line).get("usage") for line in audit.splitlines()]
            metered_lines = sum(1 for u in usage if u and u.get("output_tokens") == chunks)
            if metered_lines >= done + conc * 5 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if KEY in audit or provider.keys_seen != {f"Bearer {KEY}"}:
            raise RuntimeError("metering bench: the key was not swapped, or reached the audit")
        if metered_lines != done + conc * 5 or sum(1 for u in usage if u) != metered_lines:
            raise RuntimeError(f"metering bench: {metered_lines} metered audit lines, "
                               f"expected {done + conc * 5} (the metered calls only)")
        return {"requests": done, "chunks": chunks, "conc": conc, "rounds": rounds,
                "per_round_us": per_request,
                "metered_us": metered, "plain_us": plain, "ratio": ratio,
                "events_per_request": events[NAMES[0]] / done,
                "metered_audit_lines_with_usage": metered_lines}
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        if proc.poll() is None:
            proc.kill()
        log.close()
        provider.stop()
