"""GitHub's Git LFS shapes beside `git http-backend` (fakes/git_server.py), on one TLS
server answering for several names: the batch API (`POST
github.com/<owner>/<repo>.git/info/lfs/objects/batch`, `application/vnd.git-lfs+json`)
sends downloads to `github-cloud.githubusercontent.com/alambic/media/<oid>`, uploads to
a PUT on `github-cloud.s3.amazonaws.com/alambic/media/<oid>` (the hosts seen in GitHub's
answers in git-lfs traces; the paths are this fake's) and their verification to a POST
on `lfs.github.com/<owner>/<repo>/objects/<oid>/verify` (host and path this fake's).
Lock requests are 404 (git-lfs carries on without the locking API). Every request head
is recorded."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from urllib.parse import urlsplit

from helpers.tls import LocalCA

from fakes.git_server import _Handler
from fakes.tls_http import Head, Recorder, TLSServer, serve_handler

MEDIA = "github-cloud.githubusercontent.com"
UPLOADS = "github-cloud.s3.amazonaws.com"
VERIFY = "lfs.github.com"
NAMES = ["github.com", MEDIA, UPLOADS, VERIFY]
LFS_TYPE = "application/vnd.git-lfs+json"


def pointer(data: bytes) -> str:
    """The LFS pointer file git stores for `data`."""
    return (f"version https://git-lfs.github.com/spec/v1\n"
            f"oid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n")


class LfsStore:
    """The objects, by sha256."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def add(self, data: bytes) -> str:
        oid = hashlib.sha256(data).hexdigest()
        with self.lock:
            self.objects[oid] = data
        return oid


class _LfsHandler(_Handler):
    store: LfsStore

    def _host(self) -> str:
        return (self.headers.get("Host") or "").split(":")[0]

    def _send(self, status: int, body: bytes = b"", kind: str = LFS_TYPE) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _record(self) -> None:
        self.server.recorder.add(Head(  # type: ignore[attr-defined]
            self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

    def _batch(self, repo: str) -> None:
        self._record()
        request = json.loads(self._body())
        objects = []
        for obj in request["objects"]:
            oid, size = obj["oid"], obj["size"]
            entry: dict[str, object] = {"oid": oid, "size": size, "authenticated": True}
            if request["operation"] == "download":
                entry["actions"] = {"download": {
                    "href": f"https://{MEDIA}/alambic/media/{oid}?token=signed",
                    "expires_in": 3600}}
            elif oid not in self.store.objects:
                entry["actions"] = {
                    "upload": {"href": f"https://{UPLOADS}/alambic/media/{oid}?X-Amz=signed",
                               "expires_in": 3600},
                    "verify": {"href": f"https://{VERIFY}/{repo}/objects/{oid}/verify",
                               "expires_in": 3600}}
            objects.append(entry)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode())

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if self._host() == MEDIA and path.startswith("/alambic/media/"):
            self._record()
            data = self.store.objects.get(path.rsplit("/", 1)[1])
            self._send(200 if data is not None else 404, data or b"",
                       "application/octet-stream")
        elif "/info/lfs/" in path:
            self._record()
            self._send(404, b'{"message": "Not Found"}')
        else:
            self._cgi()

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if self._host() == "github.com" and path.endswith("/info/lfs/objects/batch"):
            self._batch(path.removeprefix("/").removesuffix(".git/info/lfs/objects/batch"))
        elif self._host() == VERIFY and path.endswith("/verify"):
            self._record()
            self._body()
            self._send(200, b"{}")
        elif "/info/lfs/" in path:
            self._record()
            self._body()
            self._send(404, b'{"message": "Not Found"}')
        else:
            self._cgi()

    def do_PUT(self) -> None:
        self._record()
        data = self._body()
        path = urlsplit(self.path).path
        if self._host() == UPLOADS and path.startswith("/alambic/media/"):
            oid = self.store.add(data)
            self._send(200 if path.endswith(oid) else 400, b"", "text/plain")
        else:
            self._send(404, b"", "text/plain")


def start_lfs_server(directory: Path, ca: LocalCA, store: LfsStore) -> TLSServer:
    """Serve the bare repositories under `directory` at https://github.com/<repo>.git
    with LFS objects from `store`, and the LFS storage hosts."""
    handler = type("Handler", (_LfsHandler,), {"project_root": str(directory),
                                                "store": store})
    return serve_handler(handler, ca.server_context(directory, NAMES), Recorder())
