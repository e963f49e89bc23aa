"""Git LFS through the GitHub presets with the real `git lfs` (Debian git-lfs): a clone
whose LFS file is smudged from the batch API and the media host under
`service/github-read`, an LFS upload refused there, and a push with its LFS upload
(batch, PUT to the storage host, verify) under `service/github-write`; through the real
gateway to a local server answering for github.com and the LFS hosts
(`network.resolve`, a local CA). No internet."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes.git_lfs import MEDIA, NAMES, UPLOADS, VERIFY, LfsStore, pointer, start_lfs_server
from fakes.git_server import make_repo
from fakes.tls_http import TLSServer
from helpers.gateway import GatewayThread
from helpers.sandbox import Sandbox
from helpers.tls import LocalCA

MODEL = bytes(range(256)) * 16
POLICIES = {
    "gh-read.yaml": "version: v1\nname: gh-read\nextends: [service/github-read]\n",
    "gh-write.yaml": "version: v1\nname: gh-write\nextends: [service/github-write]\n",
}
BATCH = "/octo/lfs.git/info/lfs/objects/batch"
LOCKS_VERIFY = "/octo/lfs.git/info/lfs/locks/verify"


@dataclass
class Lab:
    gw: GatewayThread
    root: Path
    server: TLSServer
    store: LfsStore
    upstream_ca: Path

    def sandbox(self, policy: str, name: str) -> Sandbox:
        token = self.gw.mint(policy, sandbox=name)
        # The gateway CA (intercepted hosts) and the upstreams' (a host-wide rule's host,
        # lfs.github.com under github-write, is passed through: the real one has a public
        # certificate, this lab's is signed by its own CA).
        bundle = self.root / "sandbox-ca-bundle.pem"
        bundle.write_bytes(self.gw.ca_cert.read_bytes() + self.upstream_ca.read_bytes())
        box = Sandbox.from_cli(self.root / "homes" / name, token=token, proxy=self.gw.proxy,
                               ca_bundle=bundle, node_preload=Path("none"),
                               config=self.root / "gateway.yaml")
        out = box.run(["git", "lfs", "install", "--skip-repo"])  # once per user, as documented
        assert out.returncode == 0, out.stderr
        return box

    def lines(self, sandbox: str) -> list[dict[str, Any]]:
        return [r for r in self.gw.audit.records() if r.get("sandbox") == sandbox]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    assert shutil.which("git-lfs"), "git-lfs is needed (scripts/test-tools.sh installs it)"
    root = tmp_path_factory.mktemp("lfs")
    ca = LocalCA.create(root / "ca", name="lfs upstream CA")
    store = LfsStore()
    store.add(MODEL)
    bare = make_repo(root / "git", "octo/lfs", "lfs repo\n", files={
        ".gitattributes": "*.bin filter=lfs diff=lfs merge=lfs -text\n",
        "model.bin": pointer(MODEL)})
    subprocess.run(["git", "--git-dir", str(bare), "config", "http.receivepack", "true"],
                   check=True, timeout=30)  # the server would take a push
    server = start_lfs_server(root / "git", ca, store)
    try:
        (root / "policies").mkdir()
        for name, text in POLICIES.items():
            (root / "policies" / name).write_text(text)
        gw = GatewayThread(root, {"network": {
            "upstream_ca": str(ca.cert_path),
            "resolve": {name: f"127.0.0.1:{server.port}" for name in NAMES}}})
        try:
            yield Lab(gw, root, server, store, ca.cert_path)
        finally:
            gw.stop()
    finally:
        server.stop()


def _git(box: Sandbox, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return box.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                   timeout=90)


def _clone_and_add(box: Sandbox, data: bytes) -> Path:
    """Clone (the LFS file smudged), then commit a new LFS file holding `data`."""
    out = _git(box, "clone", "-q", "https://github.com/octo/lfs.git", "clone")
    assert out.returncode == 0, out.stdout + out.stderr
    work = box.home / "clone"
    assert (work / "model.bin").read_bytes() == MODEL
    (work / "new.bin").write_bytes(data)
    for args in (("lfs", "install"), ("add", "new.bin"), ("commit", "-q", "-m", "new")):
        out = _git(box, *args, cwd=work)
        assert out.returncode == 0, out.stdout + out.stderr
    assert _git(box, "show", "HEAD:new.bin", cwd=work).stdout == pointer(data)
    return work


def _seen(lines: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    """(method, host, path without its query, decision); a tunnel's path is ""."""
    return {(r["method"], r["host"], (r["path"] or "").split("?")[0], r["decision"])
            for r in lines}


def test_github_read_clones_lfs_files_and_refuses_an_lfs_upload(lab: Lab) -> None:
    box = lab.sandbox("gh-read", "lfs-read")
    new = b"new object from the read sandbox\n" * 64
    work = _clone_and_add(box, new)
    lab.gw.audit.wait_for(lambda r: r.get("sandbox") == "lfs-read" and r["host"] == MEDIA)
    lines = lab.lines("lfs-read")
    oid = pointer(MODEL).split("sha256:")[1].split()[0]
    assert {("POST", "github.com", BATCH, "allow"),
            ("GET", MEDIA, f"/alambic/media/{oid}", "allow")} <= _seen(lines), lines
    assert all(r["rule"].startswith("service/github-read.yaml:") for r in lines), lines
    # git lfs push: the lock check first (POST .../info/lfs/locks/verify), refused;
    # without it (lfs.locksverify=false) the batch answers an upload URL on the storage
    # host, which github-read does not name: its CONNECT is refused.
    pushed = _git(box, "lfs", "push", "origin", "main", cwd=work)
    assert pushed.returncode != 0 and "locks/verify" in pushed.stderr, pushed.stderr
    unverified = _git(box, "-c", "lfs.locksverify=false", "-c", "lfs.transfer.maxretries=1",
                      "lfs", "push", "origin", "main", cwd=work)
    assert unverified.returncode != 0, unverified.stdout + unverified.stderr
    lab.gw.audit.wait_for(lambda r: r.get("sandbox") == "lfs-read"
                          and r.get("decision") == "deny" and r["host"] == UPLOADS)
    refused = [r for r in lab.lines("lfs-read") if r["decision"] == "deny"]
    assert {(r["method"], r["host"], r["path"], r["error"]) for r in refused} == {
        ("POST", "github.com", LOCKS_VERIFY, "policy_denied"),
        ("CONNECT", UPLOADS, None, "policy_denied")}, refused
    assert not [h for h in lab.server.recorder.heads if h.method == "PUT"]
    assert new not in lab.store.objects.values()


def test_github_write_pushes_with_an_lfs_upload(lab: Lab) -> None:
    box = lab.sandbox("gh-write", "lfs-write")
    new = b"new object from the write sandbox\n" * 64
    work = _clone_and_add(box, new)
    out = _git(box, "push", "-q", "origin", "HEAD:pushed", cwd=work)
    assert out.returncode == 0, out.stdout + out.stderr
    assert new in lab.store.objects.values()
    lab.gw.audit.wait_for(lambda r: r.get("sandbox") == "lfs-write"
                          and r["path"] == "/octo/lfs.git/git-receive-pack")
    lines = lab.lines("lfs-write")
    assert {d for *_, d in _seen(lines)} == {"allow"}, lines
    assert all(r["rule"].startswith("service/github-write.yaml:") for r in lines), lines
    oid = pointer(new).split(":")[2].split()[0]
    assert {("POST", "github.com", BATCH), ("POST", "github.com", LOCKS_VERIFY),
            ("PUT", UPLOADS, f"/alambic/media/{oid}"),
            ("CONNECT", VERIFY, ""),  # a host-wide rule: passed through, not intercepted
            ("POST", "github.com", "/octo/lfs.git/git-receive-pack")} <= {
        (m, h, p) for m, h, p, _ in _seen(lines)}, lines
    assert f"/octo/lfs/objects/{oid}/verify" in {
        h.path for h in lab.server.recorder.heads if h.method == "POST"}

