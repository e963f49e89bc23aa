"""The load client: a separate process (``python -m bench.load SPEC_JSON``) on its own core.

(Unpinned in the worker-scaling section: ``cpu`` None keeps the affinity it inherits.)

Raw HTTP/1.1 over asyncio + ssl, keep-alive, N connections, through a CONNECT proxy
or direct. It speaks a tiny line protocol with the orchestrator so that only the
measured phase falls inside the proxy-CPU window:

1. sets up its connections (CONNECT, TLS handshake, one warm-up request each),
   prints ``{"ready": ...}``;
2. waits for a line on stdin, runs the workload, prints the result JSON (its own
   CPU time included, from ``resource.getrusage``);
3. waits for another line, then closes every connection and exits.

Workloads: ``get`` (fixed duration, per-request latency), ``new`` (like ``get``, but
each request on a new connection: CONNECT, TLS handshake, one request, close; its
latency includes the connection), ``resume`` (``new`` with the TLS session of the
warm-up offered on every connection: a resumed handshake, as curl, Node and rustls
clients make; the result says how many were resumed), ``download`` (one large
body), ``sse`` (time to first event, per-event delivery delay), ``idle`` (open N
tunnels, one request each, then hold them idle), ``post`` (like ``get``, a POST with a
JSON body of ``body_size`` bytes: a chat request of prose, no credential in it), ``agent``
(like ``post``, a coding agent's chat request as the OpenAI SDK sends one, ids new each
request: bench/agent.py), ``upload`` (one POST of ``body_size`` bytes of text,
Content-Length, written 1 MiB at a time).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import resource
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.agent import agent_body_size, agent_request

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
CHUNK = 1 << 20


@dataclass
class Spec:
    """What to run and through what (the orchestrator builds it as JSON)."""

    workload: str  # get | new | resume | download | sse | idle | post | agent | upload
    host: str  # the name the client asks for (SNI, Host header, CONNECT authority)
    port: int  # the CONNECT authority port
    cafile: str  # the CA this client trusts (gateway/mitmdump CA, or the upstream CA)
    direct: tuple[str, int] | None = None  # connect here without a proxy
    proxy: tuple[str, int] | None = None
    proxy_auth: str | None = None  # "user:password" for Proxy-Authorization: Basic
    path: str = "/small"
    headers: dict[str, str] = field(default_factory=dict)
    connections: int = 1
    duration: float = 1.0
    streams: int = 5  # sse: streams, one after another on one connection
    events: int = 10  # sse: events per stream
    interval_ms: int = 5  # sse: server pacing
    cpu: int | None = None  # core to pin this process to
    open_concurrency: int = 50  # idle: tunnels being opened at once
    body_size: int = 0  # post, upload: bytes of the request body


class _ResumingContext(ssl.SSLContext):
    """A client context that offers `session` on every connection it opens (asyncio's
    `start_tls` takes no session; its SSL protocol calls `wrap_bio`)."""

    session: ssl.SSLSession | None = None

    def wrap_bio(self, incoming: ssl.MemoryBIO, outgoing: ssl.MemoryBIO,  # type: ignore[override]
                 server_side: bool = False, server_hostname: str | None = None,
                 session: ssl.SSLSession | None = None) -> ssl.SSLObject:
        return super().wrap_bio(incoming, outgoing, server_side, server_hostname,
                                session or self.session)


def _ssl_context(cafile: str) -> ssl.SSLContext:
    ctx = _ResumingContext(ssl.PROTOCOL_TLS_CLIENT)  # (what create_default_context makes)
    ctx.load_verify_locations(cafile=cafile)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


async def connect(spec: Spec, ctx: ssl.SSLContext) -> Conn:
    """One TLS connection to ``spec.host``, through the proxy if there is one."""
    if spec.proxy is None:
        assert spec.direct is not None
        return await asyncio.open_connection(spec.direct[0], spec.direct[1], ssl=ctx,
                                             server_hostname=spec.host, limit=CHUNK)
    reader, writer = await asyncio.open_connection(spec.proxy[0], spec.proxy[1], limit=CHUNK)
    authority = f"{spec.host}:{spec.port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if spec.proxy_auth:
        lines.append("Proxy-Authorization: Basic "
                     + base64.b64encode(spec.proxy_auth.encode()).decode())
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    if status != 200:
        body = await reader.read(2000)
        writer.close()
        raise ConnectionError(f"CONNECT {authority} -> {status}: "
                              f"{(head + body).decode('latin-1')[:400]}")
    await writer.start_tls(ctx, server_hostname=spec.host)
    return reader, writer


def request_bytes(spec: Spec, path: str | None = None, method: str = "GET",
                  body: bytes | None = None, content_type: str = "application/json") -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in spec.headers.items())
    if body is not None:
        extra += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    head = f"{method} {path or spec.path} HTTP/1.1\r\nHost: {spec.host}\r\n{extra}\r\n"
    return head.encode() + (body or b"")


_WORDS = ("the", "request", "model", "parse", "file", "rows", "return", "value", "quoted",
          "field", "def", "import", "json", "error", "stream", "count", "user", "table")


def prose(size: int, seed: int = 43) -> bytes:
    """`size` bytes of words (the same every run): text without a credential, in
    which most characters are letters (what a scanner's run check finds hardest)."""
    words = [_WORDS[(i * 7919 + seed) % len(_WORDS)] for i in range(size // 3 + 1)]
    return " ".join(words).encode()[:size]


def chat_body(size: int) -> bytes:
    """A chat request of about `size` bytes (JSON, one user message of prose)."""
    frame = b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "%s"}]}'
    return frame % prose(max(0, size - len(frame) + 2))


async def read_response(reader: asyncio.StreamReader) -> tuple[int, int]:
    """Read one response (Content-Length or chunked); return (status, body bytes)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    i = lower.find(b"\r\ncontent-length:")
    if i >= 0:
        remaining = int(lower[i + 17:lower.index(b"\r\n", i + 2)])
        total = remaining
        if remaining <= 65536:
            await reader.readexactly(remaining)
        else:
            while remaining:
                data = await reader.read(min(remaining, CHUNK))
                if not data:
                    raise ConnectionError("body truncated")
                remaining -= len(data)
        return status, total
    if b"transfer-encoding: chunked" in lower:
        total = 0
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            total += size
            if size == 0:
                return status, total
    return status, 0


def _pct(sorted_ns: list[int], q: float) -> float:
    """Percentile ``q`` (0..100) of sorted nanoseconds, in milliseconds."""
    if not sorted_ns:
        return float("nan")
    k = min(len(sorted_ns) - 1, max(0, round(q / 100 * (len(sorted_ns) - 1))))
    return sorted_ns[k] / 1e6


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _get_loop(conn: Conn, req: bytes | Callable[[], bytes], end: float,
                    lat: list[int], statuses: dict[int, int]) -> None:
    """Requests one after another until `end` (`req`: the request, or what makes each)."""
    reader, writer = conn
    clock = time.perf_counter_ns
    while time.perf_counter() < end:
        t0 = clock()
        writer.write(req if isinstance(req, bytes) else req())
        status, _ = await read_response(reader)
        lat.append(clock() - t0)
        statuses[status] = statuses.get(status, 0) + 1


async def _close(conns: list[Conn]) -> None:
    for _, writer in conns:
        writer.close()
    for _, writer in conns:
        with contextlib.suppress(OSError, TimeoutError, ssl.SSLError):
            await asyncio.wait_for(writer.wait_closed(), 2)


async def _warm(spec: Spec, ctx: ssl.SSLContext, n: int) -> tuple[list[Conn], dict[int, int]]:
    conns = [await connect(spec, ctx) for _ in range(n)]
    statuses: dict[int, int] = {}
    warm = request_bytes(spec, "/small" if spec.workload != "sse" else
                         "/events?n=1&interval_ms=0")
    if spec.workload in ("post", "upload", "agent"):
        warm = request_bytes(spec, method="POST", body=chat_body(200))
    for reader, writer in conns:
        writer.write(warm)
        status, _ = await read_response(reader)
        statuses[status] = statuses.get(status, 0) + 1
    return conns, statuses


async def run(spec: Spec, stdin: asyncio.StreamReader) -> None:
    ctx = _ssl_context(spec.cafile)
    conns: list[Conn] = []
    try:
        if spec.workload != "idle":
            conns, warm_statuses = await _warm(spec, ctx, spec.connections)
            if spec.workload in ("new", "resume"):  # (warmed: the proxy's caches, the leaf)
                if spec.workload == "resume" and isinstance(ctx, _ResumingContext):
                    ssl_object = conns[0][1].get_extra_info("ssl_object")
                    ctx.session = ssl_object.session  # (its ticket came with the answer)
                    if ctx.session is None or not ctx.session.has_ticket:
                        raise ConnectionError("resume: the proxy gave no session ticket")
                await _close(conns)
                conns = []
        else:
            warm_statuses = {}
        _emit({"ready": True, "warmup_statuses": warm_statuses})
        await stdin.readline()
        cpu0, wall0 = _cpu(), time.perf_counter()
        if spec.workload == "get":
            result = await _run_get(spec, conns)
        elif spec.workload in ("new", "resume"):
            result = await _run_new(spec, ctx)
        elif spec.workload == "download":
            result = await _run_download(spec, conns[0])
        elif spec.workload == "sse":
            result = await _run_sse(spec, conns[0])
        elif spec.workload == "idle":
            result, conns = await _run_idle(spec, ctx)
        elif spec.workload == "post":
            result = await _run_get(spec, conns, request_bytes(
                spec, method="POST", body=chat_body(spec.body_size)))
        elif spec.workload == "agent":
            result = await _run_get(spec, conns, functools.partial(
                agent_request, spec.host, spec.path))
            result["body_bytes"] = agent_body_size()
        elif spec.workload == "upload":
            result = await _run_upload(spec, conns[0])
        else:
            raise ValueError(f"unknown workload {spec.workload}")
        wall = time.perf_counter() - wall0
        cpu = _cpu() - cpu0
        result.update(wall_s=wall, client_cpu_s=cpu,
                      client_cpu_pct=100 * cpu / wall if wall > 0 else 0.0)
        _emit(result)
        await stdin.readline()
    finally:
        await _close(conns)


async def _run_get(spec: Spec, conns: list[Conn],
                   req: bytes | Callable[[], bytes] | None = None) -> dict[str, Any]:
    req = req or request_bytes(spec)
    lat: list[int] = []
    statuses: dict[int, int] = {}
    start = time.perf_counter()
    end = start + spec.duration
    await asyncio.gather(*(_get_loop(c, req, end, lat, statuses) for c in conns))
    elapsed = time.perf_counter() - start
    lat.sort()
    ok = statuses.get(200, 0)
    return {"requests": len(lat), "ok": ok, "statuses": statuses, "body_bytes": spec.body_size,
            "rps": len(lat) / elapsed, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99)}


async def _new_loop(spec: Spec, ctx: ssl.SSLContext, req: bytes, end: float,
                    lat: list[int], statuses: dict[int, int], reused: list[int]) -> None:
    clock = time.perf_counter_ns
    while time.perf_counter() < end:
        t0 = clock()
        reader, writer = await connect(spec, ctx)
        writer.write(req)
        status, _ = await read_response(reader)
        lat.append(clock() - t0)
        statuses[status] = statuses.get(status, 0) + 1
        if writer.get_extra_info("ssl_object").session_reused:
            reused[0] += 1
        await _close([(reader, writer)])


async def _run_new(spec: Spec, ctx: ssl.SSLContext) -> dict[str, Any]:
    req = request_bytes(spec)
    lat: list[int] = []
    statuses: dict[int, int] = {}
    reused = [0]
    start = time.perf_counter()
    end = start + spec.duration
    await asyncio.gather(*(_new_loop(spec, ctx, req, end, lat, statuses, reused)
                           for _ in range(spec.connections)))
    elapsed = time.perf_counter() - start
    lat.sort()
    return {"requests": len(lat), "ok": statuses.get(200, 0), "statuses": statuses,
            "resumed": reused[0],
            "rps": len(lat) / elapsed, "p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99)}


async def _run_download(spec: Spec, conn: Conn) -> dict[str, Any]:
    reader, writer = conn
    t0 = time.perf_counter()
    writer.write(request_bytes(spec))
    status, size = await read_response(reader)
    elapsed = time.perf_counter() - t0
    return {"status": status, "bytes": size, "seconds": elapsed,
            "mb_per_s": size / 1e6 / elapsed if elapsed > 0 else 0.0}


async def _run_upload(spec: Spec, conn: Conn) -> dict[str, Any]:
    reader, writer = conn
    block = prose(CHUNK)
    extra = "".join(f"{k}: {v}\r\n" for k, v in spec.headers.items())
    head = (f"POST {spec.path} HTTP/1.1\r\nHost: {spec.host}\r\n{extra}Content-Type: "
            f"text/plain\r\nContent-Length: {spec.body_size}\r\n\r\n").encode()
    t0 = time.perf_counter()
    writer.write(head)
    left = spec.body_size
    while left:
        piece = block[:min(left, len(block))]
        writer.write(piece)
        left -= len(piece)
        await writer.drain()
    status, _ = await read_response(reader)
    elapsed = time.perf_counter() - t0
    return {"status": status, "bytes": spec.body_size, "seconds": elapsed,
            "mb_per_s": spec.body_size / 1e6 / elapsed if elapsed > 0 else 0.0}


async def _run_sse(spec: Spec, conn: Conn) -> dict[str, Any]:
    """Streams one after another; each event carries the server's monotonic send time."""
    reader, writer = conn
    clock = time.monotonic_ns
    ttfe: list[int] = []
    delays: list[int] = []
    received = 0
    req = request_bytes(spec, f"/events?n={spec.events}&interval_ms={spec.interval_ms}")
    for _ in range(spec.streams):
        t0 = clock()
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        if int(head[9:12]) != 200 or b"chunked" not in head.lower():
            raise ConnectionError(f"SSE: unexpected response {head[:200]!r}")
        buf = b""
        first = True
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            now = clock()
            buf += data[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                sent = int(event.split(b"data: ", 1)[1])
                received += 1
                if first:
                    ttfe.append(now - t0)
                    first = False
                else:
                    delays.append(now - sent)
    ttfe.sort()
    delays.sort()
    return {"streams": spec.streams, "events": received,
            "ttfe_p50_ms": _pct(ttfe, 50), "ttfe_p99_ms": _pct(ttfe, 99),
            "event_delay_p50_ms": _pct(delays, 50), "event_delay_p99_ms": _pct(delays, 99)}


async def _run_idle(spec: Spec, ctx: ssl.SSLContext) -> tuple[dict[str, Any], list[Conn]]:
    sem = asyncio.Semaphore(spec.open_concurrency)
    req = request_bytes(spec)
    conns: list[Conn] = []
    errors: list[str] = []

    async def one() -> None:
        async with sem:
            try:
                conn = await connect(spec, ctx)
                conn[1].write(req)
                await read_response(conn[0])
                conns.append(conn)
            except (OSError, ConnectionError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
                errors.append(repr(exc)[:200])

    await asyncio.gather(*(one() for _ in range(spec.connections)))
    return {"tunnels": len(conns), "errors": len(errors), "first_error": errors[:1]}, conns


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _main(spec: Spec) -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    await run(spec, stdin)


def main() -> None:
    raw = json.loads(sys.argv[1])
    for key in ("direct", "proxy"):
        if raw.get(key) is not None:
            raw[key] = tuple(raw[key])
    spec = Spec(**raw)
    if spec.cpu is not None:
        os.sched_setaffinity(0, {spec.cpu})
    try:
        asyncio.run(_main(spec))
    except Exception as exc:  # report, so the orchestrator can show why a row failed
        _emit({"error": f"{type(exc).__name__}: {exc}"[:600]})
        sys.exit(1)


if __name__ == "__main__":
    main()
