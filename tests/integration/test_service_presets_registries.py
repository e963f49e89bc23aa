"""Service presets with their real clients, continued: `gem install` under
`service/rubygems`, `skopeo copy` (a registry client that needs no daemon) under
`service/docker-hub`, `huggingface_hub` downloads under `service/huggingface`; each
through the real gateway to local servers answering for the real names
(`network.resolve` maps them to 127.0.0.1, a local CA signs them), under a policy that
is the preset alone, with a write the preset leaves out refused (a `gem push`, an image
push, a Hub commit). No internet: the real hosts are never reached."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes.docker_registry import IMAGE, STORAGE, DockerHub
from fakes.huggingface_hub import LFS_FILE, REPO, SMALL_FILE, HubFiles
from fakes.rubygems_index import make_gem_source
from fakes.tls_http import Recorder, serve_wsgi
from helpers.gateway import GatewayThread
from helpers.nginx import Nginx
from helpers.python_clients import huggingface_python
from helpers.sandbox import Sandbox
from helpers.tls import LocalCA


@dataclass
class Run:
    gw: GatewayThread
    box: Sandbox
    token: str

    def lines(self, sandbox: str = "box") -> list[dict[str, Any]]:
        return self.gw.audit.wait_for(lambda r: r.get("sandbox") == sandbox)


@contextmanager
def _through_preset(tmp_path: Path, preset: str, ca: LocalCA, resolve: dict[str, int],
                    own: str = "", secrets: str = "") -> Iterator[Run]:
    """A gateway whose one policy is `extends: [service/<preset>]` (after `own`, the
    policy's own keys, when given), the names of `resolve` sent to those local ports, and
    a sandbox made from `env` alone."""
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "p.yaml").write_text(
        f"version: v1\nname: p\nextends: [service/{preset}]\n{own}")
    config: dict[str, Any] = {"network": {
        "upstream_ca": str(ca.cert_path),
        "resolve": {name: f"127.0.0.1:{port}" for name, port in resolve.items()}}}
    if secrets:
        (tmp_path / "secrets.yaml").write_text(secrets)
        (tmp_path / "secrets.yaml").chmod(0o600)
        config["secrets"] = {"store": "file", "path": str(tmp_path / "secrets.yaml")}
    gw = GatewayThread(tmp_path, config)
    try:
        token = gw.mint("p", sandbox="box")
        box = Sandbox.from_cli(tmp_path / "home", token=token, proxy=gw.proxy,
                               ca_bundle=gw.ca_cert, node_preload=Path("none"),
                               config=tmp_path / "gateway.yaml")
        yield Run(gw, box, token)
    finally:
        gw.stop()


def _all_from(lines: list[dict[str, Any]], preset: str) -> None:
    allowed = [r for r in lines if r["decision"] == "allow"]
    assert allowed and all(r["rule"].startswith(f"service/{preset}.yaml:") for r in allowed), \
        lines


# --------------------------------------------------------------------------- RubyGems

def test_rubygems_preset_gem_install_and_a_refused_push(tmp_path: Path) -> None:
    """`gem install` (RubyGems 3.3, Debian's) from the source https://rubygems.org/: a
    HEAD of index.rubygems.org's root, the compact index there (`info/<gem>`), then the
    spec and the .gem from that same host; `gem push` (POST /api/v1/gems) refused."""
    assert shutil.which("gem"), "gem is needed (scripts/test-tools.sh installs ruby)"
    ca = LocalCA.create(tmp_path / "ca", name="rubygems CA")
    nginx = Nginx(tmp_path / "nginx", ca, ["rubygems.org", "index.rubygems.org"])
    try:
        gem = make_gem_source(nginx.dir / "www", tmp_path / "work", "gwgem", "1.0.0",
                              "from-rubygems")
        with _through_preset(tmp_path, "rubygems", ca, {
                "rubygems.org": nginx.port, "index.rubygems.org": nginx.port}) as run:
            gems = {"GEM_HOME": str(run.box.home / "gems"),
                    "GEM_PATH": str(run.box.home / "gems")}
            out = run.box.run(["gem", "install", "gwgem", "--clear-sources", "--source",
                               "https://rubygems.org/", "--no-document"], timeout=120, **gems)
            assert out.returncode == 0, out.stdout + out.stderr
            got = run.box.run(["ruby", "-e", 'require "gwgem"; print Gwgem::VALUE'], **gems)
            installed = run.lines()
            pushed = run.box.run(["gem", "push", str(gem), "--host", "https://rubygems.org"],
                                 timeout=60, GEM_HOST_API_KEY="rubygems_0123456789abcdef",
                                 **gems)
            refused = run.gw.audit.wait_for(lambda r: r.get("decision") == "deny")
    finally:
        nginx.stop()
    assert got.stdout == "from-rubygems", got.stderr
    seen = {(r["host"], r["path"]) for r in installed}
    assert seen == {("index.rubygems.org", "/"), ("index.rubygems.org", "/info/gwgem"),
                    ("index.rubygems.org", "/quick/Marshal.4.8/gwgem-1.0.0.gemspec.rz"),
                    ("index.rubygems.org", "/gems/gwgem-1.0.0.gem")}, seen
    _all_from(installed, "rubygems")
    assert pushed.returncode != 0 and '"error": "policy_denied"' in pushed.stdout, pushed.stdout
    assert [(r["method"], r["host"], r["path"], r["error"]) for r in refused] == [
        ("POST", "rubygems.org", "/api/v1/gems", "policy_denied")], refused
    assert not [line for line in nginx.access_lines() if "/api/v1/gems" in line]


# -------------------------------------------------------------------------- Docker Hub

def test_docker_hub_preset_skopeo_pulls_and_a_refused_push(tmp_path: Path) -> None:
    """`skopeo copy docker://docker.io/library/...`: the registry's 401 sends it to
    auth.docker.io for a token, then the manifest, and each blob's GET is redirected to
    the storage host of anonymous pulls (Cloudflare R2); copying an image back (a push: POST
    /v2/.../blobs/uploads/) is refused."""
    skopeo = shutil.which("skopeo")
    assert skopeo, "skopeo is needed (scripts/test-tools.sh installs it)"
    ca = LocalCA.create(tmp_path / "ca", name="docker hub CA")
    hub = DockerHub()
    server = serve_wsgi(hub.app, ca.server_context(tmp_path, list(hub.HOSTS)), Recorder())
    try:
        with _through_preset(tmp_path, "docker-hub", ca,
                             dict.fromkeys(hub.HOSTS, server.port)) as run:
            pulled = run.box.home / "image"
            out = run.box.run([skopeo, "--insecure-policy", "copy", "--retry-times", "0",
                               f"docker://docker.io/{IMAGE}:1.0", f"dir:{pulled}"],
                              timeout=120)
            assert out.returncode == 0, out.stdout + out.stderr
            fetched = run.lines()
            push = run.box.run([skopeo, "--insecure-policy", "copy", "--retry-times", "0",
                                f"dir:{pulled}", f"docker://docker.io/{IMAGE}:pushed"],
                               timeout=120)
            refused = run.gw.audit.wait_for(lambda r: r.get("decision") == "deny")
    finally:
        server.stop()
    for digest, data in hub.blobs.items():
        assert (pulled / digest.split(":")[1]).read_bytes() == data
    seen = {(r["method"], r["host"], r["path"].split("?")[0], r["status"]) for r in fetched}
    assert ("GET", "auth.docker.io", "/token", 200) in seen, seen
    assert ("GET", "registry-1.docker.io", f"/v2/{IMAGE}/manifests/1.0", 200) in seen, seen
    redirected = {r["path"] for r in fetched if r["host"] == STORAGE}
    assert len(redirected) == len(hub.blobs), fetched
    _all_from(fetched, "docker-hub")
    assert push.returncode != 0 and "StatusCode: 403" in push.stderr, push.stderr
    assert refused and {(r["method"], r["host"], r["error"]) for r in refused} == {
        ("POST", "registry-1.docker.io", "policy_denied")}, refused
    assert refused[0]["path"].startswith(f"/v2/{IMAGE}/blobs/uploads"), refused
    assert not [h for h in server.recorder.heads if h.method not in ("GET", "HEAD")]
    assert run.token not in server.recorder.text()


# ------------------------------------------------------------------------ Hugging Face

HF_CLIENT = """\
import json, sys
from huggingface_hub import HfApi, hf_hub_download
out = {}
for name in sys.argv[1:]:
    out[name] = open(hf_hub_download(REPO, name), "rb").read().hex()
try:
    HfApi().upload_file(path_or_fileobj=b"x", path_in_repo="new.txt", repo_id=REPO)
    out["upload"] = "done"
except Exception as e:
    out["upload"] = type(e).__name__ + ": " + str(e)
print(json.dumps(out))
"""


HF_KEY = "hf_realkey0123456789abcdefghijklmnop"
#: A Hub token bound to huggingface.co, for reads only: the rule the preset's docs say
#: to put beside it (the preset itself is keyless). It names the paths: a host-wide
#: credential rule would not override the preset's rules with paths (those stay keyless).
HF_KEYED = """\
credentials:
  hf: {preset: huggingface, secret: hf-token}
egress:
  - host: huggingface.co
    credential: hf
    methods: [GET, HEAD]
    paths: ["/*/*/resolve/**", /api/models/**]
"""


def _hf_run(run: Run, **extra: str) -> tuple[int, dict[str, str], str]:
    script = HF_CLIENT.replace("REPO", repr(REPO))
    out = run.box.run([str(huggingface_python()), "-c", script, SMALL_FILE, LFS_FILE],
                      timeout=180, HF_HUB_DISABLE_TELEMETRY="1", **extra)
    got: dict[str, str] = json.loads(out.stdout) if out.returncode == 0 else {}
    return out.returncode, got, out.stderr


@pytest.mark.parametrize("how", ["keyless", "keyed", "keyless-with-token"])
def test_huggingface_preset_hf_hub_download_and_a_refused_upload(tmp_path: Path,
                                                                 how: str) -> None:
    """huggingface_hub (from PyPI): `hf_hub_download` of a small file (HEAD and GET of
    /<repo>/resolve/main/...) and of an LFS file (its /resolve/ redirects to
    cdn-lfs.hf.co); `upload_file` (the commit API, POST /api/models/.../preupload/...)
    refused. huggingface_hub sends HF_TOKEN to huggingface.co on every call: keyless,
    `env` leaves it out (no credential binds that host), and a sandbox that sets it to
    the gateway token itself is refused `exfiltration_blocked` (keyless-with-token);
    keyed, `env` sets it and a credential rule before the preset swaps it for the Hub
    token, which the CDN never gets."""
    ca = LocalCA.create(tmp_path / "ca", name="hf CA")
    hub = HubFiles()
    server = serve_wsgi(hub.app, ca.server_context(tmp_path, list(hub.HOSTS)), Recorder())
    keyed = how == "keyed"
    try:
        with _through_preset(tmp_path, "huggingface", ca, dict.fromkeys(hub.HOSTS, server.port),
                             own=HF_KEYED if keyed else "",
                             secrets=f"hf-token: {HF_KEY}\n" if keyed else "") as run:
            # env sets HF_TOKEN only where a credential takes its place (keyed); a
            # sandbox that sets it to the token itself is refused at the first call.
            assert ("HF_TOKEN" in run.box.variables) is keyed, run.box.variables
            code, got, err = _hf_run(run, **({"HF_TOKEN": run.token}
                                             if how == "keyless-with-token" else {}))
            lines = run.lines()
    finally:
        server.stop()
    assert run.token not in server.recorder.text()
    if how == "keyless-with-token":
        assert code != 0 and "403 exfiltration_blocked" in err, err[-2000:]
        assert [(r["method"], r["path"], r["error"]) for r in lines] == [
            ("HEAD", f"/{REPO}/resolve/main/{SMALL_FILE}", "exfiltration_blocked")], lines
        assert not server.recorder.heads
        return
    assert code == 0, err[-3000:]
    assert bytes.fromhex(got[SMALL_FILE]) == hub.files[SMALL_FILE]
    assert bytes.fromhex(got[LFS_FILE]) == hub.files[LFS_FILE]
    allowed = [r for r in lines if r["decision"] == "allow"]
    assert [(r["method"], r["host"], r["path"].split("?")[0], r["status"]) for r in allowed
            ] == [("HEAD", "huggingface.co", f"/{REPO}/resolve/main/{SMALL_FILE}", 200),
                  ("GET", "huggingface.co", f"/{REPO}/resolve/main/{SMALL_FILE}", 200),
                  ("HEAD", "huggingface.co", f"/{REPO}/resolve/main/{LFS_FILE}", 302),
                  ("GET", "cdn-lfs.hf.co", hub.lfs_path, 200)], allowed
    hub_rule = "policies/p.yaml:" if keyed else "service/huggingface.yaml:"
    assert all(r["rule"].startswith(hub_rule if r["host"] == "huggingface.co"
                                    else "service/huggingface.yaml:") for r in allowed)
    auth = {h.path: h.headers.get("authorization") for h in server.recorder.heads}
    assert auth[f"/{REPO}/resolve/main/{SMALL_FILE}"] == (f"Bearer {HF_KEY}" if keyed
                                                           else None)
    assert auth[hub.lfs_path] is None  # the CDN gets no key
    assert "403" in got["upload"], got
    refused = [r for r in lines if r["decision"] == "deny"]
    assert [(r["method"], r["host"], r["error"]) for r in refused] == [
        ("POST", "huggingface.co", "policy_denied")], refused
    assert not [h for h in server.recorder.heads if h.method == "POST"]
