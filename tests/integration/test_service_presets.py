"""Service presets with real clients: `git clone` and a refused `git push` under
`service/github-read`, a push under `service/github-write`, `pip install` under
`service/pypi`, `npm install` under `service/npm`, `cargo fetch` under
`service/crates-io`, `go mod download` under `service/go-proxy`, Maven under
`service/maven-central`, each through the real gateway to local servers that answer for
the real names (github.com, pypi.org, files.pythonhosted.org, registry.npmjs.org,
index.crates.io...: `network.resolve` maps them to 127.0.0.1, a local CA signs them). No
internet: the real hosts are never reached."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes.git_server import make_repo, start_git_server
from fakes.npm_registry import npm_pack, start_npm_registry
from fakes.pypi_index import make_wheel
from fakes.tls_http import Recorder, TLSServer, serve_wsgi
from helpers.gateway import GatewayThread
from helpers.nginx import Nginx
from helpers.sandbox import Sandbox
from helpers.tls import LocalCA

PKG = "sgw_preset_pkg"
NPM_PKG = "sgw-preset-pkg"
POLICIES = {
    "gh-read.yaml": "version: v1\nname: gh-read\nextends: [service/github-read]\n",
    "gh-write.yaml": "version: v1\nname: gh-write\nextends: [service/github-write]\n",
    "pkgs.yaml": "version: v1\nname: pkgs\nextends: [service/pypi, service/npm]\n",
}


def _pypi_app(wheel: Path) -> Callable[..., Iterable[bytes]]:
    """PyPI's shape: the simple page on pypi.org links the file on
    files.pythonhosted.org, by its absolute URL (pip follows it to that host)."""
    data = wheel.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    link = f"https://files.pythonhosted.org/packages/ab/cd/{wheel.name}#sha256={digest}"
    page = (f'<!DOCTYPE html><html><body><a href="{link}">{wheel.name}</a></body></html>'
            ).encode()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        host = environ.get("HTTP_HOST", "").split(":")[0]
        path = environ.get("PATH_INFO", "")
        if host == "pypi.org" and path.rstrip("/") == f"/simple/{PKG.replace('_', '-')}":
            body, kind = page, "text/html"
        elif host == "files.pythonhosted.org" and path == f"/packages/ab/cd/{wheel.name}":
            body, kind = data, "application/octet-stream"
        else:
            start_response("404 Not Found", [("Content-Length", "0")])
            return [b""]
        start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body)))])
        return [body]

    return app


@dataclass
class Lab:
    gw: GatewayThread
    root: Path
    git: TLSServer
    pypi: TLSServer
    npm: TLSServer

    def sandbox(self, policy: str, name: str) -> Sandbox:
        token = self.gw.mint(policy, sandbox=name)
        return Sandbox.from_cli(self.root / "homes" / name, token=token, proxy=self.gw.proxy,
                                ca_bundle=self.gw.ca_cert, node_preload=Path("none"),
                                config=self.root / "gateway.yaml")

    def lines(self, sandbox: str, timeout: float = 5.0) -> list[dict[str, Any]]:
        return self.gw.audit.wait_for(lambda r: r.get("sandbox") == sandbox, timeout)


def _git_config(bare: Path, *args: str) -> None:
    subprocess.run(["git", "--git-dir", str(bare), "config", *args], check=True, timeout=30)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("presets")
    ca = LocalCA.create(root / "ca", name="presets upstream CA")
    git_dir = root / "git"
    bare = make_repo(git_dir, "octo/hello", "from-github\n")
    _git_config(bare, "http.receivepack", "true")  # the server would take a push
    wheel = make_wheel(root / "wheels", PKG, "1.0.0", "from-pypi")
    npm_dir = root / "npm"
    npm_dir.mkdir()
    tarball = npm_pack(npm_dir, NPM_PKG, "1.0.0", "from-npm")
    git = start_git_server(git_dir, ca, ["github.com"])
    pypi = serve_wsgi(_pypi_app(wheel), ca.server_context(root / "wheels",
                      ["pypi.org", "files.pythonhosted.org"]), Recorder())
    npm = start_npm_registry(npm_dir, ca, ["registry.npmjs.org"], [tarball])
    try:
        (root / "policies").mkdir()
        for name, text in POLICIES.items():
            (root / "policies" / name).write_text(text)
        resolve = {"github.com": f"127.0.0.1:{git.port}",
                   "pypi.org": f"127.0.0.1:{pypi.port}",
                   "files.pythonhosted.org": f"127.0.0.1:{pypi.port}",
                   "registry.npmjs.org": f"127.0.0.1:{npm.port}"}
        gw = GatewayThread(root, {"network": {"upstream_ca": str(ca.cert_path),
                                              "resolve": resolve}})
        try:
            yield Lab(gw, root, git, pypi, npm)
        finally:
            gw.stop()
    finally:
        for server in (git, pypi, npm):
            server.stop()


def _git(box: Sandbox, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return box.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                   timeout=60)


def _clone_and_commit(box: Sandbox) -> Path:
    out = _git(box, "clone", "-q", "https://github.com/octo/hello.git", "clone")
    assert out.returncode == 0, out.stdout + out.stderr
    work = box.home / "clone"
    assert (work / "README").read_text() == "from-github\n"
    (work / "NEW").write_text("pushed\n")
    assert _git(box, "add", "NEW", cwd=work).returncode == 0
    assert _git(box, "commit", "-q", "-m", "new", cwd=work).returncode == 0
    return work


def test_github_read_clones_and_refuses_a_push(lab: Lab) -> None:
    box = lab.sandbox("gh-read", "gh-read-1")
    work = _clone_and_commit(box)
    lines = lab.lines("gh-read-1")
    upload = [r for r in lines if r["path"] == "/octo/hello.git/git-upload-pack"]
    assert upload and upload[0]["decision"] == "allow", lines
    assert upload[0]["rule"].startswith("service/github-read.yaml:"), upload
    out = _git(box, "push", "-q", "origin", "HEAD:main", cwd=work)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "403" in out.stderr, out.stderr
    refused = lab.gw.audit.wait_for(
        lambda r: r.get("sandbox") == "gh-read-1" and r.get("decision") == "deny")
    assert [(r["method"], r["path"], r["error"]) for r in refused] == [
        ("POST", "/octo/hello.git/git-receive-pack", "policy_denied")], refused
    assert not [h for h in lab.git.recorder.heads if h.path.endswith("/git-receive-pack")]


def test_github_write_pushes(lab: Lab) -> None:
    box = lab.sandbox("gh-write", "gh-write-1")
    work = _clone_and_commit(box)
    out = _git(box, "push", "-q", "origin", "HEAD:pushed", cwd=work)
    assert out.returncode == 0, out.stdout + out.stderr
    pushed = [r for r in lab.lines("gh-write-1")
              if r["path"] == "/octo/hello.git/git-receive-pack"]
    assert pushed and pushed[0]["decision"] == "allow", pushed
    assert pushed[0]["rule"].startswith("service/github-write.yaml:")


def test_pypi_preset_pip_install(lab: Lab) -> None:
    box = lab.sandbox("pkgs", "pip-1")
    target = box.home / "site"
    out = box.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--retries", "0",
                   "--timeout", "10", "--disable-pip-version-check", "--target", str(target),
                   "--index-url", "https://pypi.org/simple/", PKG], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (target / PKG / "__init__.py").read_text() == "VALUE = 'from-pypi'\n"
    lines = lab.lines("pip-1")
    hosts = {(r["host"], r["decision"]) for r in lines}
    assert hosts == {("pypi.org", "allow"), ("files.pythonhosted.org", "allow")}, hosts
    assert all(r["rule"].startswith("service/pypi.yaml:") for r in lines), lines


def test_npm_preset_npm_install(lab: Lab) -> None:
    box = lab.sandbox("pkgs", "npm-1")
    project = box.home / "project"
    project.mkdir()
    (project / "package.json").write_text('{"name": "p", "private": true}')
    out = box.run(["npm", "install", "--no-fund", "--no-package-lock", "--loglevel=error",
                   "--fetch-retries=0", "--registry=https://registry.npmjs.org/", NPM_PKG],
                  cwd=project, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    got = box.run(["node", "-p", f"require({NPM_PKG!r})"], cwd=project)
    assert got.stdout.strip() == "from-npm", got.stderr
    lines = lab.lines("npm-1")
    assert any(r["path"].endswith(".tgz") and r["decision"] == "allow" for r in lines), lines
    assert all(r["rule"].startswith("service/npm.yaml:") for r in lines
               if r["decision"] == "allow"), lines


def _crates_io(www: Path, work: Path) -> None:
    """crates.io's shape in nginx's root: the sparse index of index.crates.io (its
    config.json sends downloads to static.crates.io) and the crate's download."""
    from integration.test_client_matrix import CARGO, CRATE

    crate = work / "gwcrate"
    for rel, text in CRATE.items():
        (crate / rel).parent.mkdir(parents=True, exist_ok=True)
        (crate / rel).write_text(text)
    out = subprocess.run([CARGO, "package", "--no-verify", "--allow-dirty", "--offline"],
                         cwd=crate, capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "CARGO_HOME": str(work / "cargo-home")})
    assert out.returncode == 0, out.stderr
    data = (crate / "target" / "package" / "gwcrate-0.1.0.crate").read_bytes()
    (www / "config.json").write_text(json.dumps({"dl": "https://static.crates.io/crates",
                                                 "api": "https://crates.io"}))
    (www / "gw" / "cr").mkdir(parents=True)
    (www / "gw" / "cr" / "gwcrate").write_text(json.dumps({
        "name": "gwcrate", "vers": "0.1.0", "deps": [], "features": {}, "yanked": False,
        "cksum": hashlib.sha256(data).hexdigest()}) + "\n")
    (www / "crates" / "gwcrate" / "0.1.0").mkdir(parents=True)
    (www / "crates" / "gwcrate" / "0.1.0" / "download").write_bytes(data)


def test_crates_io_preset_cargo_fetch(tmp_path: Path) -> None:
    """cargo's default source (crates.io, sparse) through `service/crates-io`."""
    from integration.test_client_matrix import CARGO

    if not Path(CARGO).exists():
        pytest.skip("cargo is not installed")
    ca = LocalCA.create(tmp_path / "ca", name="crates CA")
    nginx = Nginx(tmp_path / "nginx", ca, ["index.crates.io", "static.crates.io"])
    try:
        _crates_io(nginx.dir / "www", tmp_path / "work")
        (tmp_path / "policies").mkdir()
        (tmp_path / "policies" / "cargo.yaml").write_text(
            "version: v1\nname: cargo\nextends: [service/crates-io]\n")
        gw = GatewayThread(tmp_path, {"network": {"upstream_ca": str(ca.cert_path), "resolve": {
            "index.crates.io": f"127.0.0.1:{nginx.port}",
            "static.crates.io": f"127.0.0.1:{nginx.port}"}}})
        try:
            token = gw.mint("cargo", sandbox="cargo-1")
            box = Sandbox.from_cli(tmp_path / "home", token=token, proxy=gw.proxy,
                                   ca_bundle=gw.ca_cert, node_preload=Path("none"),
                                   config=tmp_path / "gateway.yaml")
            app = box.home / "app"
            (app / "src").mkdir(parents=True)
            (app / "Cargo.toml").write_text(
                '[package]\nname = "app"\nversion = "0.1.0"\nedition = "2021"\n'
                '[dependencies]\ngwcrate = "0.1.0"\n')
            (app / "src" / "main.rs").write_text("fn main() {}\n")
            out = box.run([CARGO, "fetch"], cwd=app, timeout=180,
                          CARGO_HOME=str(box.home / "cargo"),
                          RUSTUP_HOME=os.environ.get("RUSTUP_HOME",
                                                     str(Path.home() / ".rustup")))
            assert out.returncode == 0, out.stdout + out.stderr
            lines = gw.audit.wait_for(lambda r: r.get("sandbox") == "cargo-1")
        finally:
            gw.stop()
    finally:
        nginx.stop()
    assert 'name = "gwcrate"' in (app / "Cargo.lock").read_text()
    seen = {(r["host"], r["path"], r["decision"]) for r in lines}
    assert ("static.crates.io", "/crates/gwcrate/0.1.0/download", "allow") in seen, seen
    assert ("index.crates.io", "/gw/cr/gwcrate", "allow") in seen, seen
    assert all(r["rule"].startswith("service/crates-io.yaml:") for r in lines), lines


GO_MOD = "example.com/gwmod"


def _go_proxy(www: Path) -> None:
    """The module proxy protocol (`$GOPROXY/<module>/@v/...`) for one module, as
    proxy.golang.org serves it: list, .info, .mod, .zip."""
    base = www / GO_MOD / "@v"
    base.mkdir(parents=True)
    mod = f"module {GO_MOD}\n\ngo 1.21\n"
    (base / "list").write_text("v1.0.0\n")
    (base / "v1.0.0.info").write_text('{"Version": "v1.0.0", "Time": "2026-01-01T00:00:00Z"}')
    (base / "v1.0.0.mod").write_text(mod)
    with zipfile.ZipFile(base / "v1.0.0.zip", "w") as zf:
        zf.writestr(f"{GO_MOD}@v1.0.0/go.mod", mod)
        zf.writestr(f"{GO_MOD}@v1.0.0/gwmod.go", "package gwmod\n\nconst Value = 7\n")


def test_go_proxy_preset_go_mod_download(tmp_path: Path) -> None:
    """`go mod download` with the default GOPROXY (proxy.golang.org) through
    `service/go-proxy` (GOSUMDB off: the checksum database is not served here)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed")
    ca = LocalCA.create(tmp_path / "ca", name="go CA")
    nginx = Nginx(tmp_path / "nginx", ca, ["proxy.golang.org"])
    try:
        _go_proxy(nginx.dir / "www")
        (tmp_path / "policies").mkdir()
        (tmp_path / "policies" / "go.yaml").write_text(
            "version: v1\nname: go\nextends: [service/go-proxy]\n")
        gw = GatewayThread(tmp_path, {"network": {"upstream_ca": str(ca.cert_path), "resolve": {
            "proxy.golang.org": f"127.0.0.1:{nginx.port}"}}})
        try:
            token = gw.mint("go", sandbox="go-1")
            box = Sandbox.from_cli(tmp_path / "home", token=token, proxy=gw.proxy,
                                   ca_bundle=gw.ca_cert, node_preload=Path("none"),
                                   config=tmp_path / "gateway.yaml")
            out = box.run([go, "mod", "download", "-json", f"{GO_MOD}@v1.0.0"], timeout=180,
                          GOPATH=str(box.home / "go"), GOMODCACHE=str(box.home / "modcache"),
                          GOCACHE=str(box.home / "cache"), GOSUMDB="off",
                          GOTOOLCHAIN="local", GOFLAGS="-modcacherw")
            assert out.returncode == 0, out.stdout + out.stderr
            lines = gw.audit.wait_for(lambda r: r.get("sandbox") == "go-1")
        finally:
            gw.stop()
    finally:
        nginx.stop()
    assert json.loads(out.stdout)["Version"] == "v1.0.0", out.stdout
    seen = {(r["host"], r["path"], r["decision"]) for r in lines}
    assert ("proxy.golang.org", f"/{GO_MOD}/@v/v1.0.0.zip", "allow") in seen, seen
    assert all(r["rule"].startswith("service/go-proxy.yaml:") for r in lines), lines


@pytest.mark.parametrize("preset", ["gitlab-read", "gitlab-write"])
def test_gitlab_clones_a_nested_project_and_a_push_by_preset(tmp_path: Path,
                                                               preset: str) -> None:
    """GitLab's projects sit in nested groups: `/**/info/refs` and `/**/git-upload-pack`
    let a clone through; `git-receive-pack` is refused under gitlab-read and reaches the
    server (the push lands) under gitlab-write."""
    ca = LocalCA.create(tmp_path / "ca", name="gitlab CA")
    bare = make_repo(tmp_path / "git", "group/sub/proj", "from-gitlab\n")
    _git_config(bare, "http.receivepack", "true")
    server = start_git_server(tmp_path / "git", ca, ["gitlab.com"])
    try:
        (tmp_path / "policies").mkdir()
        (tmp_path / "policies" / "gl.yaml").write_text(
            f"version: v1\nname: gl\nextends: [service/{preset}]\n")
        gw = GatewayThread(tmp_path, {"network": {"upstream_ca": str(ca.cert_path),
                                                  "resolve": {"gitlab.com":
                                                              f"127.0.0.1:{server.port}"}}})
        try:
            token = gw.mint("gl", sandbox="gl-1")
            box = Sandbox.from_cli(tmp_path / "home", token=token, proxy=gw.proxy,
                                   ca_bundle=gw.ca_cert, node_preload=Path("none"),
                                   config=tmp_path / "gateway.yaml")
            out = _git(box, "clone", "-q", "https://gitlab.com/group/sub/proj.git", "clone")
            assert out.returncode == 0, out.stdout + out.stderr
            work = box.home / "clone"
            assert (work / "README").read_text() == "from-gitlab\n"
            (work / "NEW").write_text("x\n")
            assert _git(box, "add", "NEW", cwd=work).returncode == 0
            assert _git(box, "commit", "-q", "-m", "new", cwd=work).returncode == 0
            pushed = _git(box, "push", "-q", "origin", "HEAD:pushed", cwd=work)
            receive = gw.audit.wait_for(
                lambda r: r.get("sandbox") == "gl-1"
                and r.get("path") == "/group/sub/proj.git/git-receive-pack")
        finally:
            gw.stop()
    finally:
        server.stop()
    reached = [h for h in server.recorder.heads if h.path.endswith("/git-receive-pack")]
    if preset == "gitlab-read":
        assert pushed.returncode != 0 and "403" in pushed.stderr, pushed.stderr
        assert [(r["method"], r["decision"]) for r in receive] == [("POST", "deny")], receive
        assert not reached
    else:
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        assert receive and all(r["decision"] == "allow" for r in receive), receive
        assert receive[0]["rule"].startswith("service/gitlab-write.yaml:"), receive
        assert reached
        pushed_ref = subprocess.run(["git", "-C", str(bare), "rev-parse", "refs/heads/pushed"],
                                    capture_output=True, text=True, timeout=30, check=False)
        assert pushed_ref.returncode == 0, pushed_ref.stderr


def test_maven_central_preset_mvn(tmp_path: Path) -> None:
    """Maven (its wagon transport, the JVM agent from `env` for the proxy and the trust
    store) resolving a core extension from repo.maven.apache.org/maven2 through
    `service/maven-central`."""
    from integration.test_client_matrix import _maven_repository, _maven_validate

    from gateway.cli import main as cli_main

    if shutil.which("mvn") is None:
        pytest.skip("mvn is not installed")
    ca = LocalCA.create(tmp_path / "ca", name="maven CA")
    nginx = Nginx(tmp_path / "nginx", ca, ["repo.maven.apache.org"])
    try:
        _maven_repository(nginx.dir / "www")
        (nginx.dir / "www" / "maven2").symlink_to(nginx.dir / "www" / "maven")
        (tmp_path / "policies").mkdir()
        (tmp_path / "policies" / "mvn.yaml").write_text(
            "version: v1\nname: mvn\nextends: [service/maven-central]\n")
        gw = GatewayThread(tmp_path, {"network": {"upstream_ca": str(ca.cert_path), "resolve": {
            "repo.maven.apache.org": f"127.0.0.1:{nginx.port}"}}})
        try:
            agent = tmp_path / "jvm-proxy-agent.jar"
            assert cli_main(["jvm-agent", "-o", str(agent)]) == 0
            token = gw.mint("mvn", sandbox="mvn-1")
            box = Sandbox.from_cli(tmp_path / "home", token=token, proxy=gw.proxy,
                                   ca_bundle=gw.ca_cert, node_preload=Path("none"),
                                   config=tmp_path / "gateway.yaml", jvm_agent=agent)
            out = _maven_validate(box, "https://repo.maven.apache.org/maven2")
            lines = gw.audit.wait_for(lambda r: r.get("sandbox") == "mvn-1")
        finally:
            gw.stop()
    finally:
        nginx.stop()
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    jar = box.home / "m2" / "org" / "example" / "gw-ext" / "1.0" / "gw-ext-1.0.jar"
    assert jar.is_file()
    assert ("/maven2/org/example/gw-ext/1.0/gw-ext-1.0.jar", "allow") in {
        (r["path"], r["decision"]) for r in lines}, lines
    assert all(r["rule"].startswith("service/maven-central.yaml:") for r in lines), lines
