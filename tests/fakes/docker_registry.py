"""A stand-in for Docker Hub's pull path (a WSGI app for `serve_wsgi`), the way a
registry client meets it: `registry-1.docker.io/v2/` answers 401 with a Bearer challenge
naming `https://auth.docker.io/token`; the token service hands out a token; the
registry serves one image's manifest (Docker schema 2) to that token and redirects each
blob's GET (307) to a signed URL on the storage host anonymous pulls are sent to
(`STORAGE`, Cloudflare R2: Docker's allowlist lists it for "Personal plan / Anonymous"
pulls; paid plans go to production.cloudflare.docker.com), which serves it. A
blob HEAD is 404 (so a push would upload); a write (POST/PUT/PATCH) would be answered
202, so a refusal seen by the client is the gateway's."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Callable, Iterable
from typing import Any

IMAGE = "library/gwimage"
TOKEN = "dockerhub-fake-registry-token"
CHALLENGE = ('Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
             f'scope="repository:{IMAGE}:pull"')
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
STORAGE = "docker-images-prod.6aa30f8b08e16409b46e0173d6de2f56.r2.cloudflarestorage.com"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class DockerHub:
    """One image, `IMAGE:1.0`: a config blob and one gzipped tar layer."""

    HOSTS = ("registry-1.docker.io", "auth.docker.io", STORAGE)

    def __init__(self) -> None:
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as tf:
            data = b"from-docker-hub\n"
            info = tarfile.TarInfo("hello.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        layer = gzip.compress(tar.getvalue(), mtime=0)
        config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                             "rootfs": {"type": "layers",
                                        "diff_ids": [_digest(tar.getvalue())]}}).encode()
        self.blobs = {_digest(config): config, _digest(layer): layer}
        self.manifest = json.dumps({
            "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "size": len(config), "digest": _digest(config)},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                        "size": len(layer), "digest": _digest(layer)}]}).encode()

    def _registry(self, method: str, path: str, auth: str
                  ) -> tuple[str, list[tuple[str, str]], bytes]:
        if auth != f"Bearer {TOKEN}":
            return "401 Unauthorized", [("WWW-Authenticate", CHALLENGE)], b"{}"
        if method not in ("GET", "HEAD"):
            return "202 Accepted", [("Location", f"/v2/{IMAGE}/blobs/uploads/1")], b""
        if path == "/v2/":
            return "200 OK", [], b"{}"
        if path in (f"/v2/{IMAGE}/manifests/1.0",
                    f"/v2/{IMAGE}/manifests/{_digest(self.manifest)}"):
            return "200 OK", [("Content-Type", MANIFEST_TYPE),
                              ("Docker-Content-Digest", _digest(self.manifest))], self.manifest
        digest = path.removeprefix(f"/v2/{IMAGE}/blobs/")
        if method == "GET" and digest in self.blobs:
            hexd = digest.split(":")[1]
            return "307 Temporary Redirect", [(
                "Location", f"https://{STORAGE}/registry-v2/docker/registry/v2/blobs/"
                f"sha256/{hexd[:2]}/{hexd}/data?X-Amz-Signature=fake")], b""
        return "404 Not Found", [], b""

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]
            ) -> Iterable[bytes]:
        host = environ.get("HTTP_HOST", "").split(":")[0]
        path, method = environ.get("PATH_INFO", ""), environ["REQUEST_METHOD"]
        status, headers, body = "404 Not Found", [], b""
        if host == "registry-1.docker.io":
            status, headers, body = self._registry(method, path,
                                                   environ.get("HTTP_AUTHORIZATION", ""))
        elif host == "auth.docker.io" and path == "/token":
            status = "200 OK"
            body = json.dumps({"token": TOKEN, "access_token": TOKEN, "expires_in": 300,
                               "issued_at": "2026-11-29T00:00:00Z"}).encode()
        elif host == STORAGE:
            blob = {f"/registry-v2/docker/registry/v2/blobs/sha256/{d[7:9]}/{d[7:]}/data": b
                    for d, b in self.blobs.items()}.get(path)
            if blob is not None:
                status, body = "200 OK", blob
        start_response(status, [*headers, ("Content-Length", str(len(body)))])
        return [b"" if method == "HEAD" else body]
