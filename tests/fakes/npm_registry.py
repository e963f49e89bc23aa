"""A minimal npm registry over TLS: packuments and tarballs of packages made by `npm pack`.

`GET /<name>` answers the package document (versions, dist-tags, `dist.tarball` on the
host the client asked, `dist.integrity`), `GET /<name>/-/<file>.tgz` the tarball. That is
all `npm install` needs from a registry.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from helpers.tls import LocalCA

from fakes.tls_http import Head, Recorder, TLSServer, serve_handler


@dataclass(frozen=True)
class Tarball:
    name: str
    version: str
    path: Path

    @property
    def integrity(self) -> str:
        return "sha512-" + base64.b64encode(hashlib.sha512(self.path.read_bytes()).digest()
                                            ).decode()

    @property
    def shasum(self) -> str:
        return hashlib.sha1(self.path.read_bytes(), usedforsecurity=False).hexdigest()


def npm_pack(directory: Path, name: str, version: str, value: str) -> Tarball:
    """Make a package whose `index.js` exports `value`, packed by the real `npm pack`."""
    src = directory / f"src-{name}"
    src.mkdir(parents=True, exist_ok=True)
    (src / "package.json").write_text(json.dumps(
        {"name": name, "version": version, "main": "index.js", "license": "MIT"}))
    (src / "index.js").write_text(f"module.exports = {json.dumps(value)};\n")
    out = subprocess.run(["npm", "pack", "--json", "--pack-destination", str(directory)],
                         cwd=src, capture_output=True, text=True, timeout=60, check=True,
                         env={"PATH": _path(), "HOME": str(directory),
                              "NPM_CONFIG_UPDATE_NOTIFIER": "false"})
    filename = json.loads(out.stdout)[0]["filename"]
    return Tarball(name, version, directory / filename)


def _path() -> str:
    import os

    return os.environ.get("PATH", "/usr/bin:/bin")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    tarballs: dict[str, Tarball]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        recorder: Recorder = self.server.recorder  # type: ignore[attr-defined]
        recorder.add(Head("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
        path = unquote(self.path.split("?")[0]).lstrip("/")
        name, sep, file = path.partition("/-/")
        pkg = self.tarballs.get(name)
        if pkg is None:
            return self._send(404, b'{"error": "not found"}', "application/json")
        if sep:
            if file != pkg.path.name:
                return self._send(404, b'{"error": "no such tarball"}', "application/json")
            return self._send(200, pkg.path.read_bytes(), "application/octet-stream")
        host = self.headers.get("Host", "registry.invalid")
        doc = {
            "name": pkg.name, "dist-tags": {"latest": pkg.version},
            "versions": {pkg.version: {
                "name": pkg.name, "version": pkg.version, "main": "index.js",
                "dist": {"tarball": f"https://{host}/{pkg.name}/-/{pkg.path.name}",
                         "integrity": pkg.integrity, "shasum": pkg.shasum}}},
        }
        return self._send(200, json.dumps(doc).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def start_npm_registry(directory: Path, ca: LocalCA, names: list[str],
                       packages: list[Tarball]) -> TLSServer:
    handler = type("Handler", (_Handler,), {"tarballs": {p.name: p for p in packages}})
    return serve_handler(handler, ca.server_context(directory, names), Recorder())
