"""A stand-in for the Hugging Face Hub's download paths (a WSGI app for `serve_wsgi`),
with the headers `huggingface_hub` reads: `/<repo>/resolve/<revision>/<file>` on
huggingface.co answers a small file itself (`X-Repo-Commit`, `ETag`) and redirects an LFS
file to cdn-lfs.hf.co (302, `X-Linked-Etag` = its sha256, `X-Linked-Size`), where the
signed URL serves it. Anything else is 404; a POST (the commit API) would be answered
200, so a refusal seen by the client is the gateway's."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

REPO = "octo/tiny-model"
SMALL_FILE = "config.json"
LFS_FILE = "model.safetensors"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubFiles:
    """One model repository with a small file and an LFS file."""

    HOSTS = ("huggingface.co", "cdn-lfs.hf.co")

    def __init__(self) -> None:
        self.files = {SMALL_FILE: b'{"model_type": "gateway-test"}\n',
                      LFS_FILE: bytes(range(256)) * 64}
        self.lfs_sha = hashlib.sha256(self.files[LFS_FILE]).hexdigest()
        self.lfs_path = f"/repos/ab/cd/{self.lfs_sha}"

    def _resolve(self, name: str) -> tuple[str, list[tuple[str, str]], bytes]:
        data = self.files[name]
        head = [("X-Repo-Commit", COMMIT)]
        if name == LFS_FILE:
            return "302 Found", [*head, (
                "Location", f"https://cdn-lfs.hf.co{self.lfs_path}?X-Amz-Signature=fake"),
                ("X-Linked-Etag", f'"{self.lfs_sha}"'),
                ("X-Linked-Size", str(len(data))), ("Content-Length", "0")], b""
        etag = hashlib.sha1(data, usedforsecurity=False).hexdigest()
        return "200 OK", [*head, ("ETag", f'"{etag}"'), ("Content-Length", str(len(data)))], data

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]
            ) -> Iterable[bytes]:
        host = environ.get("HTTP_HOST", "").split(":")[0]
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        status, headers, body = "404 Not Found", [("Content-Length", "0")], b""
        prefix = f"/{REPO}/resolve/main/"
        if method == "POST":
            status, body = "200 OK", b"{}"
            headers = [("Content-Type", "application/json"), ("Content-Length", "2")]
        elif host == "huggingface.co" and path.startswith(prefix) and \
                path[len(prefix):] in self.files:
            status, headers, body = self._resolve(path[len(prefix):])
        elif host == "cdn-lfs.hf.co" and path == self.lfs_path:
            body = self.files[LFS_FILE]
            status, headers = "200 OK", [("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [b"" if method == "HEAD" else body]
