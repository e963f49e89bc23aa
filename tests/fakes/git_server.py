"""`git http-backend` (the real git CGI, smart HTTP) behind a small TLS server, serving
one bare repository with one commit."""

from __future__ import annotations

import os
import subprocess
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from helpers.tls import LocalCA

from fakes.tls_http import Head, Recorder, TLSServer, serve_handler

_GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def make_repo(root: Path, name: str, content: str,
              files: dict[str, str] | None = None) -> Path:
    """`root/<name>.git`, a bare repository whose README holds `content` (and `files`,
    by path: a crate's Cargo.toml and src/lib.rs, say)."""
    work = root / f"{name}-work"
    work.mkdir(parents=True)
    env = {**os.environ, **_GIT_ENV, "HOME": str(root)}

    def git(*args: str, cwd: Path = work) -> None:
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                       timeout=30)

    git("init", "-q", "-b", "main")
    (work / "README").write_text(content)
    for path, text in (files or {}).items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    git("add", ".")
    git("commit", "-q", "-m", "first")
    git("clone", "-q", "--bare", str(work), str(root / f"{name}.git"), cwd=root)
    return root / f"{name}.git"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    project_root: str

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._cgi()

    def do_POST(self) -> None:
        self._cgi()

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return out
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _cgi(self) -> None:
        recorder: Recorder = self.server.recorder  # type: ignore[attr-defined]
        recorder.add(Head(self.command, self.path,
                          {k.lower(): v for k, v in self.headers.items()}))
        body = self._body()
        url = urlsplit(self.path)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **_GIT_ENV,
               "GIT_PROJECT_ROOT": self.project_root, "GIT_HTTP_EXPORT_ALL": "1",
               "GATEWAY_INTERFACE": "CGI/1.1", "REQUEST_METHOD": self.command,
               "PATH_INFO": url.path, "QUERY_STRING": url.query,
               "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_ADDR": "127.0.0.1",
               "SERVER_PROTOCOL": "HTTP/1.1"}
        for name in ("Content-Encoding", "Git-Protocol"):
            if self.headers.get(name):
                env["HTTP_" + name.upper().replace("-", "_")] = self.headers[name]
        out = subprocess.run(["git", "http-backend"], input=body, env=env,
                             capture_output=True, timeout=30)
        head, _, payload = out.stdout.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = out.stdout.partition(b"\n\n")
        status = 200 if out.returncode == 0 else 500
        fields: list[tuple[str, str]] = []
        for line in head.decode("latin-1").splitlines():
            key, _, value = line.partition(":")
            if key.lower() == "status":
                status = int(value.split()[0])
            elif key:
                fields.append((key, value.strip()))
        self.send_response(status)
        for key, value in fields:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def start_git_server(directory: Path, ca: LocalCA, names: list[str]) -> TLSServer:
    """Serve the bare repositories under `directory` at https://<name>/<repo>.git."""
    handler = type("Handler", (_Handler,), {"project_root": str(directory)})
    return serve_handler(handler, ca.server_context(directory, names), Recorder())
