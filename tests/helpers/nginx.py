"""A real nginx (Debian `nginx-light`) TLS upstream on 127.0.0.1 for lifecycle tests.

Single process, generated config in a temporary directory. `extra` goes into the
`http {}` block (e.g. `keepalive_requests 3;`), `locations` into the server block.
`/small` answers 100 bytes, `/big` a file of `big` bytes, `/slow` is proxied to a
port that never answers when `slow_port` is given.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

from helpers.tls import LocalCA

CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log {d}/access.log;
  client_body_temp_path {d}/tmp-body;
  proxy_temp_path {d}/tmp-proxy;
  fastcgi_temp_path {d}/tmp-fastcgi;
  uwsgi_temp_path {d}/tmp-uwsgi;
  scgi_temp_path {d}/tmp-scgi;
  default_type application/octet-stream;
  ssl_certificate {cert};
  ssl_certificate_key {key};
  {extra}
  server {{
    listen 127.0.0.1:{port} ssl default_server;
    server_name _;
    root {d}/www;
    location = /small {{ try_files /small.txt =404; }}
    location = /big {{ try_files /big.bin =404; }}
    {locations}
  }}
}}
"""


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                      else None)
    if found is None:
        raise RuntimeError("nginx is not installed (scripts/test-tools.sh installs nginx-light)")
    return found


class Nginx:
    """A started nginx; `port`, `access_lines()`, `stop()`."""

    def __init__(self, workdir: Path, ca: LocalCA, names: list[str], *, extra: str = "",
                 locations: str = "", big: int = 1024 * 1024) -> None:
        self.dir = workdir
        (workdir / "www").mkdir(parents=True, exist_ok=True)
        (workdir / "www" / "small.txt").write_bytes(b"s" * 99 + b"\n")
        (workdir / "www" / "big.bin").write_bytes(bytes(range(256)) * (big // 256))
        cert, key = ca.issue(workdir, names)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        conf = workdir / "nginx.conf"
        conf.write_text(CONF.format(d=workdir, cert=cert, key=key, port=self.port,
                                    extra=extra, locations=locations))
        self.proc = subprocess.Popen(
            [nginx_binary(), "-p", str(workdir), "-c", str(conf), "-e",
             str(workdir / "error.log")],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"nginx exited: {err[-500:]}")
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("nginx did not listen within 10 s")

    def access_lines(self) -> list[str]:
        path = self.dir / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
