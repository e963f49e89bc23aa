"""The local TLS upstreams: nginx (static files, keep-alive) and a small Python SSE server.

nginx (Debian ``nginx-light``/``nginx``) runs single-process (``master_process off``)
on 127.0.0.1 with a generated config in a temporary directory: ``/small`` (100 bytes),
``/big`` (the download file), and on ``inject.bench.test`` a check that answers 401
unless ``X-Api-Key`` carries the injected secret, so an injection row cannot pass
by accident. If nginx is missing a Python asyncio server stands in (and says so).

nginx cannot pace events, so SSE comes from `SSEServer`: ``GET /events?n=N&interval_ms=M``
answers chunked ``text/event-stream`` whose events carry the server's
``time.monotonic_ns()`` at send, so a client on the same machine can compute the
delivery delay of each event.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from helpers.tls import LocalCA  # noqa: E402  (the test CA helper, shared with the tests)

NAMES = ["pass.bench.test", "policy.bench.test", "inject.bench.test", "sse.bench.test",
         "upload.bench.test", "dlp.bench.test"]
SMALL_BODY = b"x" * 99 + b"\n"
SECRET = "bench-secret-value-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0, proc: subprocess.Popen[bytes] | None = None,
              what: str = "server") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def write_big_file(path: Path, size: int) -> None:
    block = bytes(range(256)) * 4096  # 1 MiB, incompressible enough; nginx gzip is off anyway
    with path.open("wb") as f:
        left = size
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


# One process, keep-alive without limits, temp files in the run's directory (`{d}`):
# the start of every nginx config the benchmark writes.
NGINX_HEAD = """\
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 16384;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  tcp_nodelay on;
  keepalive_timeout 600s;
  keepalive_requests 100000000;
  client_body_temp_path {d}/tmp-body;
  proxy_temp_path {d}/tmp-proxy;
  fastcgi_temp_path {d}/tmp-fastcgi;
  uwsgi_temp_path {d}/tmp-uwsgi;
  scgi_temp_path {d}/tmp-scgi;
"""

NGINX_CONF = NGINX_HEAD + """\
  sendfile on;
  default_type application/octet-stream;
  ssl_certificate {cert};
  ssl_certificate_key {key};
  ssl_protocols TLSv1.2 TLSv1.3;
  ssl_session_cache shared:bench:1m;
  server {{
    listen 127.0.0.1:{port} ssl default_server;
    server_name _;
    root {d}/www;
    location = /small {{ try_files /small.txt =404; }}
    location = /big {{ try_files /big.bin =404; }}
    location = /upload {{ client_max_body_size 0; return 200 "ok\n"; }}
  }}
  server {{
    listen 127.0.0.1:{port} ssl;
    server_name inject.bench.test;
    root {d}/www;
    if ($http_x_api_key != "{secret}") {{ return 401; }}
    location = /small {{ try_files /small.txt =404; }}
    location = /big {{ try_files /big.bin =404; }}
  }}
}}
"""


class StaticUpstream:
    """nginx (or the Python fallback) serving /small and /big over TLS on 127.0.0.1."""

    def __init__(self, workdir: Path, ca: LocalCA, big_size: int, cpu: int | None) -> None:
        self.dir = workdir / "nginx"
        (self.dir / "www").mkdir(parents=True, exist_ok=True)
        (self.dir / "www" / "small.txt").write_bytes(SMALL_BODY)
        write_big_file(self.dir / "www" / "big.bin", big_size)
        self.big_size = big_size
        self.cert, self.key = ca.issue(self.dir, NAMES)
        self.port = free_port()
        self.cpu = cpu
        self.proc: subprocess.Popen[bytes] | None = None
        self.fallback: _PyStatic | None = None
        self.kind = "nginx"

    def start(self) -> None:
        binary = nginx_binary()
        if binary is None:
            self.kind = "python (nginx not installed)"
            self.fallback = _PyStatic(self)
            self.fallback.start()
            return
        conf = self.dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(d=self.dir, cert=self.cert, key=self.key,
                                          port=self.port, secret=SECRET))
        cmd = [binary, "-p", str(self.dir), "-c", str(conf), "-e", str(self.dir / "nginx.log")]
        if self.cpu is not None:
            cmd = ["taskset", "-c", str(self.cpu), *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        try:
            wait_port(self.port, proc=self.proc, what="nginx")
        except RuntimeError as exc:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            self.stop()
            raise RuntimeError(f"{exc}: {err[-800:]}") from None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        if self.fallback is not None:
            self.fallback.stop()
            self.fallback = None


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout``; never leaves the child behind."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


class _LoopThread:
    """An asyncio server on its own thread (used by the SSE server and the fallback)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.Server | None = None

    def serve(self, handler: object, port: int, ctx: ssl.SSLContext) -> None:
        self.thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(handler, "127.0.0.1", port, ssl=ctx, backlog=1024,  # type: ignore[arg-type]
                                 limit=1 << 20), self.loop)
        self.server = fut.result(10)

    def stop(self) -> None:
        async def shutdown() -> None:
            if self.server is not None:
                self.server.close()
                self.server.close_clients()
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        with contextlib.suppress(RuntimeError):
            self.loop.close()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    target = lines[0].split(" ")[1]
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    return target, headers


async def _drop(reader: asyncio.StreamReader, size: int) -> None:
    while size:
        data = await reader.read(min(size, 1 << 20))
        if not data:
            raise ConnectionError("body truncated")
        size -= len(data)


class _PyStatic:
    """Fallback static upstream when nginx is not installed (slower: rows become upstream-bound)."""

    def __init__(self, up: StaticUpstream) -> None:
        self.up = up
        self.big = (up.dir / "www" / "big.bin").read_bytes()
        self.lt = _LoopThread()

    def start(self) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.up.cert, self.up.key)
        ctx.set_alpn_protocols(["http/1.1"])
        self.lt.serve(self._handle, self.up.port, ctx)

    def stop(self) -> None:
        self.lt.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
            while (req := await _read_request(reader)) is not None:
                target, headers = req
                host = headers.get("host", "").split(":")[0]
                if host == "inject.bench.test" and headers.get("x-api-key") != SECRET:
                    status, body = "401 Unauthorized", b"unauthorized\n"
                elif target == "/big":
                    status, body = "200 OK", self.big
                elif target == "/small":
                    status, body = "200 OK", SMALL_BODY
                elif target == "/upload":  # (the body read and dropped)
                    await _drop(reader, int(headers.get("content-length", "0")))
                    status, body = "200 OK", b"ok\n"
                else:
                    status, body = "404 Not Found", b"not found\n"
                writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n"
                             .encode() + body)
                await writer.drain()
        writer.close()


class SSEServer:
    """``GET /events?n=N&interval_ms=M``: N events, M ms apart, chunked, keep-alive, TLS."""

    def __init__(self, workdir: Path, ca: LocalCA) -> None:
        d = workdir / "sse"
        d.mkdir(parents=True, exist_ok=True)
        self.ctx = ca.server_context(d, NAMES)
        self.port = free_port()
        self.lt = _LoopThread()

    def start(self) -> None:
        self.lt.serve(self._handle, self.port, self.ctx)

    def stop(self) -> None:
        self.lt.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
            while (req := await _read_request(reader)) is not None:
                target, _ = req
                query = parse_qs(urlsplit(target).query)
                n = min(int(query.get("n", ["10"])[0]), 10_000)
                interval = min(int(query.get("interval_ms", ["10"])[0]), 10_000) / 1000
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
                for i in range(n):
                    if i:
                        await asyncio.sleep(interval)
                    event = f"data: {time.monotonic_ns()}\n\n".encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        writer.close()
