"""The client matrix: real clients, configured only by `sandbox-gateway env` output, reach
real local servers through the real gateway, on a passthrough rule and an intercepted one.

Servers (all on 127.0.0.1, reached by name only through the gateway's `network.resolve`):
pypiserver (PyPI index), a static npm registry with an `npm pack` tarball, `git
http-backend`, nginx, the fake OpenAI/Anthropic (SSE), a WebSocket echo, a gRPC server.
Each client runs as a subprocess of its own sandbox (its own token and sandbox id, so
the audit lines of one run are told apart) and must succeed; its audit line must name the
path taken; the token must never reach an upstream; on credential rules the real key
must. The sandbox's CA bundle holds the gateway CA and the upstreams' CA (passthrough
hosts present their own certificate).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fakes.git_server import make_repo, start_git_server
from fakes.grpc_echo import METHOD, GrpcEcho
from fakes.inference import FakeInference
from fakes.npm_registry import npm_pack, start_npm_registry
from fakes.pypi_index import make_wheel, start_pypi
from fakes.tls_http import Recorder, TLSServer
from fakes.ws_echo import WsEcho
from helpers.cache_lock import built_once
from helpers.dlp_corpus import fake
from helpers.gateway import GatewayThread
from helpers.nginx import Nginx
from helpers.node_clients import cache_root, env_proxy_node, js_runtimes, node_clients
from helpers.sandbox import Sandbox
from helpers.tls import LocalCA

from gateway.cli import main as cli_main

PROVIDER_KEY = "sk-matrix-provider-key-0123456789"
LOCAL_KEY = "sk-matrix-local-key-9876543210"
PKG = "sgw_matrix_pkg"
NPM_PKG = "sgw-matrix-pkg"
KINDS = ("web", "pypi", "npm", "git", "ws", "grpc")
POLICY = """\
version: v1
name: matrix
egress:
  - host: web.test          # passthrough: host only
  - host: pypi.test
  - host: npm.test
  - host: git.test
  - host: ws.test
  - host: grpc.test
  - host: web-i.test        # intercepted, the key swapped into X-Api-Key
    credential: local
    dlp: {action: refuse}
  - host: ws-i.test
    credential: local
    dlp: {action: refuse}
  - host: grpc-i.test
    credential: local
    dlp: {action: refuse}
  - host: pypi-i.test       # intercepted, no credential
    inspect: true
    dlp: {action: refuse}
  - host: npm-i.test
    inspect: true
    dlp: {action: refuse}
  - host: git-i.test
    inspect: true
    dlp: {action: refuse}
  - host: maven.test        # nginx again, a Maven repository: passthrough and inspected
  - host: maven-i.test
    inspect: true
    dlp: {action: refuse}
  - host: http.test         # nginx's plain-HTTP server (http://: a Maven repository, /echo)
  - host: crates.test       # nginx again, a cargo (sparse) registry
  - host: crates-i.test
    inspect: true
    dlp: {action: refuse}
  - host: api.openai.com
    credential: openai
    dlp: {action: refuse}
  - host: api.anthropic.com
    credential: anthropic
    dlp: {action: refuse}
credentials:
  openai: {preset: openai, secret: provider-key}
  anthropic: {preset: anthropic, secret: provider-key}
  local:
    hosts: [web-i.test, ws-i.test, grpc-i.test]
    inject: {header: X-Api-Key}
    secret: local-key
"""


@dataclass
class Matrix:
    gw: GatewayThread
    root: Path
    bundle: Path
    preload: Path
    recorders: dict[str, Recorder]
    nginx: Nginx
    fake: FakeInference
    jvm_agent: Path

    def sandbox(self, name: str, *, preload: bool = True) -> tuple[Sandbox, str]:
        """A fresh sandbox (token minted for sandbox id `name`), its env from `env`;
        without `preload`, from `env --node-preload none` (no NODE_OPTIONS)."""
        token = self.gw.mint("matrix", sandbox=name)
        box = Sandbox.from_cli(self.root / "homes" / name, token=token, proxy=self.gw.proxy,
                               ca_bundle=self.bundle,
                               node_preload=self.preload if preload else Path("none"),
                               config=self.root / "gateway.yaml", jvm_agent=self.jvm_agent)
        return box, token

    def lines(self, sandbox: str, host: str, timeout: float = 5.0) -> list[dict[str, Any]]:
        """This sandbox's audit lines for `host` (passthrough lines come at tunnel end)."""
        return self.gw.audit.wait_for(
            lambda r: r.get("sandbox") == sandbox and r.get("host") == host, timeout)

    def unauthenticated(self) -> int:
        return sum(1 for r in self.gw.audit.records() if r.get("error") == "auth_required")


def _servers(root: Path, ca: LocalCA) -> tuple[dict[str, TLSServer | WsEcho | GrpcEcho],
                                               Nginx, int]:
    pkgs = root / "pypi"
    make_wheel(pkgs, PKG, "1.0.0", "from-pypi")
    npm_dir = root / "npm"
    npm_dir.mkdir()
    tarball = npm_pack(npm_dir, NPM_PKG, "1.0.0", "from-npm")
    git_dir = root / "git"
    git_dir.mkdir()
    make_repo(git_dir, "repo", "from-git\n")
    make_repo(git_dir, "crate", "a crate\n", CRATE)
    pushed = make_repo(git_dir, "push", "to push to\n")
    subprocess.run(["git", "config", "http.receivepack", "true"], cwd=pushed, check=True)
    (root / "ws").mkdir()
    (root / "grpc").mkdir()
    servers: dict[str, TLSServer | WsEcho | GrpcEcho] = {
        "pypi": start_pypi(pkgs, ca, ["pypi.test", "pypi-i.test"]),
        "npm": start_npm_registry(npm_dir, ca, ["npm.test", "npm-i.test"], [tarball]),
        "git": start_git_server(git_dir, ca, ["git.test", "git-i.test"]),
        "ws": WsEcho(root / "ws", ca, ["ws.test", "ws-i.test"]),
        "grpc": GrpcEcho(root / "grpc", ca, ["grpc.test", "grpc-i.test"]),
    }
    with socket.socket() as s:  # nginx's plain-HTTP server (http.test)
        s.bind(("127.0.0.1", 0))
        plain = int(s.getsockname()[1])
    nginx = Nginx(root / "nginx", ca, ["web.test", "web-i.test", "maven.test", "maven-i.test",
                                       "crates.test", "crates-i.test"],
                  extra="log_format hdrs '$host|$request|$status|$http_authorization|"
                        "$http_x_api_key|$http_proxy_authorization';"
                        f"server {{ listen 127.0.0.1:{plain}; root {root / 'nginx'}/www; "
                        f"access_log {root / 'nginx'}/hdrs.log hdrs; "
                        "location = /echo { return 200 'ok'; } }",
                  locations=f"access_log {root / 'nginx'}/hdrs.log hdrs;")
    return servers, nginx, plain


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    root = tmp_path_factory.mktemp("matrix")
    ca = LocalCA.create(root / "ca", name="matrix upstream CA")
    fake = FakeInference(root / "fake", api_key=PROVIDER_KEY).start()
    servers, nginx, plain = _servers(root, ca)
    try:
        upstream_ca = root / "upstream-ca.pem"
        upstream_ca.write_bytes(ca.cert_path.read_bytes() + fake.ca_path.read_bytes())
        resolve = {f"{kind}{suffix}.test": f"127.0.0.1:{servers[kind].port}"
                   for kind in KINDS if kind != "web" for suffix in ("", "-i")}
        resolve |= {"web.test": f"127.0.0.1:{nginx.port}",
                    "web-i.test": f"127.0.0.1:{nginx.port}",
                    "maven.test": f"127.0.0.1:{nginx.port}",
                    "maven-i.test": f"127.0.0.1:{nginx.port}",
                    "crates.test": f"127.0.0.1:{nginx.port}",
                    "crates-i.test": f"127.0.0.1:{nginx.port}",
                    "http.test": f"127.0.0.1:{plain}",
                    "api.openai.com": f"127.0.0.1:{fake.port}",
                    "api.anthropic.com": f"127.0.0.1:{fake.port}"}
        (root / "policies").mkdir()
        (root / "policies" / "matrix.yaml").write_text(POLICY)
        secrets = root / "secrets.yaml"
        secrets.write_text(f"provider-key: {PROVIDER_KEY}\nlocal-key: {LOCAL_KEY}\n")
        secrets.chmod(0o600)
        gw = GatewayThread(root, {"network": {"upstream_ca": str(upstream_ca),
                                              "resolve": resolve},
                                  "secrets": {"store": "file", "path": str(secrets)},
                                  "refusals": {"inside_tls": True}})  # the default
        try:
            # The sandbox's bundle: the gateway CA (intercepted hosts) + the upstreams'
            # CA (passthrough hosts show their own certificate).
            bundle = root / "sandbox-ca-bundle.pem"
            bundle.write_bytes(gw.ca_cert.read_bytes() + upstream_ca.read_bytes())
            preload = root / "node-proxy-preload.mjs"
            assert cli_main(["node-preload", "-o", str(preload)]) == 0
            jvm_agent = root / "jvm-proxy-agent.jar"
            assert cli_main(["jvm-agent", "-o", str(jvm_agent)]) == 0
            recorders = {k: s.recorder for k, s in servers.items()}
            yield Matrix(gw, root, bundle, preload, recorders, nginx, fake, jvm_agent)
        finally:
            gw.stop()
    finally:
        for server in servers.values():
            server.stop()
        nginx.stop()
        fake.stop()


RULES = [("passthrough", ""), ("intercept", "-i")]


def _check(m: Matrix, name: str, host: str, path_taken: str, token: str, upstream: str,
           before_407: int) -> list[dict[str, Any]]:
    """The audit says how the run went; the upstream never saw the token."""
    lines = m.lines(name, host)
    assert lines, f"no audit line for {name} -> {host}"
    assert {r["path_taken"] for r in lines} == {path_taken}, lines
    assert all(r["decision"] == "allow" and r["error"] is None for r in lines), lines
    assert not [r for r in m.gw.audit.records() if r.get("sandbox") == name and r.get("error")]
    assert m.unauthenticated() == before_407, "a client's first CONNECT went without the token"
    assert token not in upstream
    return lines


# --------------------------------------------------------------------------- package managers


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_pip_install(matrix: Matrix, rule: str, suffix: str) -> None:
    name, host = f"pip-{rule}", f"pypi{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    target = box.home / "site"
    out = box.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--retries", "0",
                   "--timeout", "10", "--disable-pip-version-check", "--target", str(target),
                   "--index-url", f"https://{host}/simple/", PKG], timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (target / PKG / "__init__.py").read_text() == "VALUE = 'from-pypi'\n"
    lines = _check(matrix, name, host, rule, token, matrix.recorders["pypi"].text(), before)
    if rule == "intercept":
        assert {r["path"] for r in lines} >= {f"/simple/{PKG.replace('_', '-')}/"}


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_uv_pip_install(matrix: Matrix, rule: str, suffix: str) -> None:
    name, host = f"uv-{rule}", f"pypi{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    target = box.home / "site"
    uv = str(Path(sys.executable).parent / "uv")
    out = box.run([uv, "pip", "install", "--no-cache", "--python", sys.executable,
                   "--target", str(target), "--index-url", f"https://{host}/simple/", PKG],
                  timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (target / PKG / "__init__.py").read_text() == "VALUE = 'from-pypi'\n"
    _check(matrix, name, host, rule, token, matrix.recorders["pypi"].text(), before)


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_npm_install(matrix: Matrix, rule: str, suffix: str) -> None:
    name, host = f"npm-{rule}", f"npm{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    project = box.home / "project"
    project.mkdir()
    (project / "package.json").write_text('{"name": "p", "private": true}')
    out = box.run(["npm", "install", "--no-audit", "--no-fund", "--no-package-lock",
                   "--loglevel=error", "--fetch-retries=0", f"--registry=https://{host}/",
                   NPM_PKG], cwd=project, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    got = box.run(["node", "-p", f"require({NPM_PKG!r})"], cwd=project)
    assert got.stdout.strip() == "from-npm", got.stderr
    lines = _check(matrix, name, host, rule, token, matrix.recorders["npm"].text(), before)
    if rule == "intercept":
        assert any(r["path"].endswith(".tgz") for r in lines), lines


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_git_clone(matrix: Matrix, rule: str, suffix: str) -> None:
    name, host = f"git-{rule}", f"git{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    out = box.run(["git", "clone", "-q", f"https://{host}/repo.git", "clone"], timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (box.home / "clone" / "README").read_text() == "from-git\n"
    lines = _check(matrix, name, host, rule, token, matrix.recorders["git"].text(), before)
    if rule == "intercept":
        assert any(r["path"].endswith("/git-upload-pack") for r in lines), lines


def _words(count: int, seed: int) -> str:
    """Prose-like text of lowercase words (no run a detector reads: it is what a
    repository's ordinary files look like to them), `count` words."""
    import random

    rng = random.Random(seed)
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz")
                            for _ in range(rng.randint(2, 9))) for _ in range(count))


def test_git_push_of_a_committed_credential_is_refused(matrix: Matrix) -> None:
    """`git push` through an inspected rule with `dlp:` (issue 43): the pack's objects are
    read inflated, so a commit holding a credential is refused (`secret_detected`, where
    `body git object N`), pushed small (held) or past the hold limit (streamed, 2 MB of
    a file beside it), and the server's repository never gets it; ordinary commits,
    small and large, push."""
    name, host = "git-push", "git-i.test"
    box, token = matrix.sandbox(name)
    work = box.home / "push"
    out = box.run(["git", "clone", "-q", f"https://{host}/push.git", str(work)], timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    ident = {"GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@a", "GIT_COMMITTER_NAME": "a",
             "GIT_COMMITTER_EMAIL": "a@a"}
    server = matrix.root / "git" / "push.git"

    def commit_and_push(files: dict[str, str]) -> subprocess.CompletedProcess[str]:
        for path, text in files.items():
            (work / path).write_text(text)
        for argv in (["git", "add", *files], ["git", "commit", "-q", "-m", f"add {path}"]):
            done = box.run(argv, cwd=work, **ident)
            assert done.returncode == 0, done.stdout + done.stderr
        return box.run(["git", "push", "-q", "origin", "HEAD:main"], cwd=work, timeout=90)

    secret = fake("github").text
    for size, label in ((20, "small"), (400_000, "large")):
        before = len(matrix.gw.audit.records())
        ordinary = commit_and_push({f"notes-{label}.md": _words(size, size) + "\n"})
        assert ordinary.returncode == 0, ordinary.stdout + ordinary.stderr
        refused = commit_and_push({f"more-{label}.md": _words(size, size + 1) + "\n",
                                   f"zz-{label}.env": f"GITHUB_TOKEN={secret}\n"})
        assert refused.returncode != 0 and "403" in refused.stderr, refused.stderr
        lines = [r for r in matrix.gw.audit.records()[before:]
                 if r.get("path", "").endswith("/git-receive-pack")]
        pushes = [r for r in lines if r["bytes_out"] != 4]  # (git's probe of a large push)
        assert [r["error"] for r in pushes] == [None, "secret_detected"], lines
        assert pushes[0]["bytes_out"] > (1 << 20 if label == "large" else 0)  # (streamed)
        [found] = pushes[1]["dlp"]
        assert found["detector"] == "github" and found["where"].startswith(
            "body git object" if label == "small" else "body at offset"), found  # (streamed)
        assert secret not in json.dumps(lines) and token not in matrix.recorders["git"].text()
        log = subprocess.run(["git", "log", "--format=%s", "main"], cwd=server,
                             capture_output=True, text=True, check=True).stdout
        assert f"add notes-{label}.md" in log and f"zz-{label}" not in log, log
        box.run(["git", "reset", "-q", "--hard", "HEAD~1"], cwd=work)  # (drop the refused)


CRATE = {"Cargo.toml": '[package]\nname = "gwcrate"\nversion = "0.1.0"\nedition = "2021"\n',
         "src/lib.rs": "pub fn value() -> u8 { 7 }\n"}
CARGO = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_cargo_fetch_git_dependency(matrix: Matrix, rule: str, suffix: str) -> None:
    """cargo (its libgit2) with `env` output only: HTTPS_PROXY and SSL_CERT_FILE."""
    if not Path(CARGO).exists():
        pytest.skip("cargo is not installed")
    name, host = f"cargo-{rule}", f"git{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    app = box.home / "app"
    (app / "src").mkdir(parents=True)
    (app / "Cargo.toml").write_text(
        '[package]\nname = "app"\nversion = "0.1.0"\nedition = "2021"\n[dependencies]\n'
        f'gwcrate = {{ git = "https://{host}/crate.git" }}\n')
    (app / "src" / "main.rs").write_text("fn main() { println!(\"{}\", gwcrate::value()); }\n")
    out = box.run([CARGO, "fetch"], cwd=app, timeout=120, CARGO_HOME=str(box.home / "cargo"),
                  RUSTUP_HOME=os.environ.get("RUSTUP_HOME", str(Path.home() / ".rustup")))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gwcrate" in (app / "Cargo.lock").read_text()
    lines = _check(matrix, name, host, rule, token, matrix.recorders["git"].text(), before)
    if rule == "intercept":
        assert any(r["path"].endswith("/crate.git/git-upload-pack") for r in lines), lines


def _cargo_registry(www: Path, work: Path, host: str) -> None:
    """A sparse cargo registry under nginx's /crates/<host>: config.json, the index file of
    one crate (CRATE, packaged by `cargo package`) and its download."""
    crate = work / "gwcrate"
    for rel, text in CRATE.items():
        (crate / rel).parent.mkdir(parents=True, exist_ok=True)
        (crate / rel).write_text(text)
    out = subprocess.run([CARGO, "package", "--no-verify", "--allow-dirty", "--offline"],
                         cwd=crate, capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "CARGO_HOME": str(work / "cargo-home")})
    assert out.returncode == 0, out.stderr
    data = (crate / "target" / "package" / "gwcrate-0.1.0.crate").read_bytes()
    base = www / "crates" / host
    (base / "index" / "gw" / "cr").mkdir(parents=True, exist_ok=True)
    (base / "index" / "config.json").write_text(json.dumps({"dl": f"https://{host}/crates/{host}/dl"}))
    entry = {"name": "gwcrate", "vers": "0.1.0", "deps": [], "features": {}, "yanked": False,
             "cksum": hashlib.sha256(data).hexdigest()}
    (base / "index" / "gw" / "cr" / "gwcrate").write_text(json.dumps(entry) + "\n")
    (base / "dl" / "gwcrate" / "0.1.0").mkdir(parents=True, exist_ok=True)
    (base / "dl" / "gwcrate" / "0.1.0" / "download").write_bytes(data)


def _cargo_fetch(box: Sandbox, app: Path, index: str) -> subprocess.CompletedProcess[str]:
    """`cargo fetch` of an app that depends on gwcrate from the sparse registry `index`
    (the user's own .cargo/config.toml entry, nothing of the gateway)."""
    (app / "src").mkdir(parents=True)
    (app / ".cargo").mkdir()
    (app / ".cargo" / "config.toml").write_text(
        f'[registries.local]\nindex = "sparse+{index}"\n')
    (app / "Cargo.toml").write_text(
        '[package]\nname = "app"\nversion = "0.1.0"\nedition = "2021"\n[dependencies]\n'
        'gwcrate = { version = "0.1.0", registry = "local" }\n')
    (app / "src" / "main.rs").write_text("fn main() { println!(\"{}\", gwcrate::value()); }\n")
    return box.run([CARGO, "fetch"], cwd=app, timeout=120, CARGO_HOME=str(box.home / "cargo"),
                   RUSTUP_HOME=os.environ.get("RUSTUP_HOME", str(Path.home() / ".rustup")))


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_cargo_fetch_from_a_registry(matrix: Matrix, rule: str, suffix: str) -> None:
    """cargo's own HTTP client (sparse index and crate download) with `env` output only;
    the registry is the user's own .cargo/config.toml entry, nothing of the gateway."""
    if not Path(CARGO).exists():
        pytest.skip("cargo is not installed")
    name, host = f"cargo-registry-{rule}", f"crates{suffix}.test"
    box, token = matrix.sandbox(name)
    _cargo_registry(matrix.nginx.dir / "www", box.home / "registry-work", host)
    before = matrix.unauthenticated()
    app = box.home / "app"
    out = _cargo_fetch(box, app, f"https://{host}/crates/{host}/index/")
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'name = "gwcrate"' in (app / "Cargo.lock").read_text()
    log = _hdrs(matrix, lambda ln: f"/crates/{host}/" in ln and ln.startswith(host + "|"),
                last="/dl/gwcrate/0.1.0/download")
    assert any("/dl/gwcrate/0.1.0/download" in ln for ln in log), log
    _check(matrix, name, host, rule, token, "\n".join(log), before)


# --------------------------------------------------------------------------- HTTP clients

HTTP_CLIENTS = {
    "curl": None,
    "requests": """
import os, requests
r = requests.get(URL, headers=HEADERS, timeout=10)
print(r.status_code, r.text.strip())
""",
    "httpx": """
import os, httpx
r = httpx.get(URL, headers=HEADERS, timeout=10)
print(r.status_code, r.text.strip())
""",
    "aiohttp": """
import asyncio, os, aiohttp
async def main():
    async with aiohttp.ClientSession(trust_env=True) as s:  # trust_env: read the proxy vars
        async with s.get(URL, headers=HEADERS) as r:
            print(r.status, (await r.text()).strip())
asyncio.run(main())
""",
}


@pytest.mark.parametrize(("rule", "suffix"), RULES)
@pytest.mark.parametrize("client", list(HTTP_CLIENTS))
def test_http_client(matrix: Matrix, client: str, rule: str, suffix: str) -> None:
    name, host = f"{client}-{rule}", f"web{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    url = f"https://{host}/small?client={client}"
    # On the credential rule the client sends its token where the key goes (any
    # *_API_KEY variable holds it); the gateway puts the real key there.
    send_key = rule == "intercept"
    script = HTTP_CLIENTS[client]
    if script is None:
        argv = ["curl", "-sS", "--max-time", "10", "-w", "%{http_code}", url]
        if send_key:
            argv[1:1] = ["-H", f"X-Api-Key: {box.variables['OPENAI_API_KEY']}"]
        out = box.run(argv)
        assert out.returncode == 0 and out.stdout == "s" * 99 + "\n200", out.stderr
    else:
        headers = '{"X-Api-Key": os.environ["OPENAI_API_KEY"]}' if send_key else "{}"
        code = f"URL = {url!r}\nimport os\nHEADERS = {headers}\n{script}"
        out = box.run([sys.executable, "-c", code])
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == "200 " + "s" * 99
    _nginx_saw(matrix, name, host, rule, token, before, client)


def _hdrs(m: Matrix, keep: Callable[[str], bool], enough: int = 1, last: str = "") -> list[str]:
    """nginx's header log lines that `keep` keeps, once there are `enough` of them and one
    holds `last` (or after 5 s): nginx writes a request's access-log line after the
    response's last byte went out, so a client may finish before its line is there."""
    deadline = time.monotonic() + 5
    while True:
        lines = [ln for ln in (m.nginx.dir / "hdrs.log").read_text().splitlines() if keep(ln)]
        done = len(lines) >= enough and any(last in ln for ln in lines)
        if done or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


def _nginx_saw(m: Matrix, name: str, host: str, rule: str, token: str, before: int,
               client: str) -> None:
    """nginx served /small?client=CLIENT through the gateway (with the real key on the
    credential rule), and the audit lines say how."""
    log = _hdrs(m, lambda ln: f"client={client} " in ln and ln.startswith(host + "|"))
    assert log, "nginx saw no request"
    _check(m, name, host, rule, token, "\n".join(log), before)
    if rule == "intercept":
        assert all(ln.split("|")[4] == LOCAL_KEY for ln in log), log


def _web_client_ran(m: Matrix, out: subprocess.CompletedProcess[str], name: str, host: str,
                    rule: str, token: str, before: int, client: str) -> None:
    """A client printed `200 <body>` of nginx's /small, and nginx saw it (`_nginx_saw`)."""
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "200 " + "s" * 99
    _nginx_saw(m, name, host, rule, token, before, client)


# --------------------------------------------------------------------------- the JVM

JAVA_CLIENT = """
import java.io.InputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

public class MatrixClient {
    public static void main(String[] args) throws Exception {
        URI uri = URI.create(args[1]);
        String key = args.length > 2 ? System.getenv("OPENAI_API_KEY") : null;
        if (args[0].equals("urlconnection")) {
            HttpURLConnection c = (HttpURLConnection) uri.toURL().openConnection();
            if (key != null) c.setRequestProperty("X-Api-Key", key);
            int code = c.getResponseCode();
            InputStream in = code < 400 ? c.getInputStream() : c.getErrorStream();
            System.out.println(code + " " + new String(in.readAllBytes()).strip());
        } else {
            HttpRequest.Builder request = HttpRequest.newBuilder(uri);
            if (key != null) request.header("X-Api-Key", key);
            HttpResponse<String> r = HttpClient.newHttpClient().send(request.build(),
                HttpResponse.BodyHandlers.ofString());
            System.out.println(r.statusCode() + " " + String.valueOf(r.body()).strip());
        }
    }
}
"""


@pytest.fixture(scope="module")
def java_client() -> Path:
    """MatrixClient and KeepAliveClient compiled (the JDK's javac; test-tools.sh installs
    it) once a machine, cached outside the repo like the Node and Python clients (javac
    takes seconds of both cores)."""
    javac = shutil.which("javac")
    assert javac, "javac is missing: run scripts/test-tools.sh"
    sources = {"MatrixClient.java": JAVA_CLIENT, "KeepAliveClient.java": KEEPALIVE_CLIENT}

    def build(directory: Path) -> None:
        for name, text in sources.items():
            (directory / name).write_text(text)
        out = subprocess.run([javac, "-d", str(directory),
                              *(str(directory / name) for name in sources)],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr

    return built_once(cache_root(), "java-clients", [os.path.realpath(javac), sources], build)


@pytest.mark.parametrize(("rule", "suffix"), RULES)
@pytest.mark.parametrize("client", ["urlconnection", "httpclient"])
def test_java_clients(matrix: Matrix, java_client: Path, client: str, rule: str,
                      suffix: str) -> None:
    """HttpURLConnection and java.net.http's HttpClient with nothing but `env` output:
    JAVA_TOOL_OPTIONS loads the JVM agent, which relays the JVM's proxy connections with
    the credentials of HTTPS_PROXY (the JDK sends none) and trusts SSL_CERT_FILE; on the
    credential rule HttpClient's own X-Api-Key header (the token) reaches the gateway."""
    name, host = f"java-{client}-{rule}", f"web{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    url = f"https://{host}/small?client=java-{client}"
    argv = ["java", "-cp", str(java_client), "MatrixClient", client, url]
    out = box.run([*argv, "key"] if rule == "intercept" else argv, timeout=60)
    assert token not in out.stderr  # the JVM echoes JAVA_TOOL_OPTIONS: no token there
    _web_client_ran(matrix, out, name, host, rule, token, before, f"java-{client}")


KEEPALIVE_CLIENT = """
import java.io.InputStream;
import java.io.OutputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;

public class KeepAliveClient {
    public static void main(String[] args) throws Exception {
        String base = args[1];
        String[] bodies = {null, "a body of known length", "a chunked body", null};
        HttpClient shared = HttpClient.newHttpClient();
        for (int i = 0; i < bodies.length; i++) {
            URI uri = URI.create(base + "-" + i);
            if (args[0].equals("urlconnection")) {
                HttpURLConnection c = (HttpURLConnection) uri.toURL().openConnection();
                if (bodies[i] != null) {
                    c.setRequestMethod("POST");
                    c.setDoOutput(true);
                    if (i == 2) c.setChunkedStreamingMode(4);
                    try (OutputStream out = c.getOutputStream()) {
                        out.write(bodies[i].getBytes());
                    }
                }
                int code = c.getResponseCode();
                InputStream in = code < 400 ? c.getInputStream() : c.getErrorStream();
                System.out.println(code + " " + new String(in.readAllBytes()).strip());
                in.close();
            } else {
                HttpRequest.Builder request = HttpRequest.newBuilder(uri);
                if (bodies[i] != null) {
                    request.POST(i == 2
                        ? HttpRequest.BodyPublishers.ofInputStream(
                            () -> new java.io.ByteArrayInputStream("a chunked body".getBytes()))
                        : HttpRequest.BodyPublishers.ofString(bodies[i]));
                }
                HttpResponse<String> r = shared.send(request.build(),
                    HttpResponse.BodyHandlers.ofString());
                System.out.println(r.statusCode() + " " + String.valueOf(r.body()).strip());
            }
        }
    }
}
"""


@pytest.mark.parametrize("client", ["urlconnection", "httpclient"])
def test_java_keeps_the_credentials_on_a_kept_alive_http_connection(
        matrix: Matrix, java_client: Path, client: str) -> None:
    """Four plain http:// requests (GET, POST with a Content-Length, POST chunked, GET) on
    one kept-alive connection from a real JVM client with `env` output only: the agent's
    relay adds the credentials to every request head (the gateway wants them on each), so
    none is refused 407; the audit lines share one client address (one connection)."""
    name = f"java-keepalive-{client}"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    out = box.run(["java", "-cp", str(java_client), "KeepAliveClient", client,
                   f"http://http.test/echo?c={name}"], timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:4] == ["200 ok"] * 4, out.stdout + out.stderr[-2000:]
    deadline = time.monotonic() + 5  # (a line is written a moment after the response)
    while len(lines := matrix.lines(name, "http.test")) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["path"] for r in lines] == ["/echo"] * 4, lines  # (lines keep no query)
    assert [r["method"] for r in lines] == ["GET", "POST", "POST", "GET"]
    assert all(r["decision"] == "allow" and r["error"] is None for r in lines), lines
    assert len({r["client"] for r in lines}) == 1, "the requests took several connections"
    assert matrix.unauthenticated() == before
    log = _hdrs(matrix, lambda ln: f"c={name}-" in ln, enough=4)
    assert [ln.split("|")[1].split()[0] for ln in log] == ["GET", "POST", "POST", "GET"], log
    assert token not in "\n".join(log)


GO_CLIENT = """package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
)

func main() {
	req, err := http.NewRequest("GET", os.Args[1], nil)
	if err != nil {
		panic(err)
	}
	if len(os.Args) > 2 {
		req.Header.Set("X-Api-Key", os.Getenv("OPENAI_API_KEY"))
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Println(resp.StatusCode, strings.TrimSpace(string(body)))
}
"""


@pytest.fixture(scope="module")
def go_client() -> Path:
    """GO_CLIENT built with the system Go (test-tools.sh installs golang-go) once a
    machine, cached outside the repo like the Java clients."""
    go = shutil.which("go")
    assert go, "go is needed (scripts/test-tools.sh installs golang-go)"

    def build(directory: Path) -> None:
        (directory / "main.go").write_text(GO_CLIENT)
        out = subprocess.run(
            [go, "build", "-o", str(directory / "client"), "main.go"], cwd=directory,
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "GOCACHE": str(directory / "cache"),
                 "GOPATH": str(directory / "gopath"), "GOFLAGS": "-mod=mod",
                 "GO111MODULE": "off"})
        assert out.returncode == 0, out.stderr
        shutil.rmtree(directory / "cache", ignore_errors=True)  # (the binary is kept)

    return built_once(cache_root(), "go-client", [os.path.realpath(go), GO_CLIENT],
                      build) / "client"


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_go_net_http(matrix: Matrix, go_client: Path, rule: str, suffix: str) -> None:
    """Go's net/http with `env` output only: HTTPS_PROXY (its credentials on the CONNECT)
    and SSL_CERT_FILE."""
    name, host = f"go-{rule}", f"web{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    argv = [str(go_client), f"https://{host}/small?client=go"]
    out = box.run([*argv, "key"] if rule == "intercept" else argv)
    _web_client_ran(matrix, out, name, host, rule, token, before, "go")


JS_FETCH = """
const deno = typeof Deno !== "undefined";
const args = deno ? Deno.args : process.argv.slice(2);
const headers = args[1] ? { "X-Api-Key": deno ? Deno.env.get("OPENAI_API_KEY")
                                              : process.env.OPENAI_API_KEY } : {};
const r = await fetch(args[0], { headers });
console.log(r.status, (await r.text()).trim());
"""


@pytest.mark.parametrize(("rule", "suffix"), RULES)
@pytest.mark.parametrize("runtime", ["bun", "deno"])
def test_bun_and_deno_fetch(matrix: Matrix, runtime: str, rule: str, suffix: str) -> None:
    """fetch() in Bun and Deno with `env` output only (HTTPS_PROXY with its credentials;
    NODE_EXTRA_CA_CERTS for Bun, DENO_CERT for Deno)."""
    binary = js_runtimes()[runtime]
    name, host = f"{runtime}-{rule}", f"web{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    script = box.home / "fetch.mjs"
    script.write_text(JS_FETCH)
    argv = [str(binary), "run", *(["-A"] if runtime == "deno" else []), str(script),
            f"https://{host}/small?client={runtime}"]
    out = box.run([*argv, "key"] if rule == "intercept" else argv, timeout=60)
    _web_client_ran(matrix, out, name, host, rule, token, before, runtime)


RUBY_CLIENT = """
require "net/http"
uri = URI(ARGV[0])
request = Net::HTTP::Get.new(uri)
request["X-Api-Key"] = ENV["OPENAI_API_KEY"] if ARGV[1]
response = Net::HTTP.start(uri.host, uri.port, use_ssl: true) { |http| http.request(request) }
puts "#{response.code} #{response.body.strip}"
"""


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_ruby_net_http(matrix: Matrix, rule: str, suffix: str) -> None:
    """Ruby's Net::HTTP with `env` output only: https_proxy (its credentials included)
    and SSL_CERT_FILE."""
    ruby = shutil.which("ruby")
    assert ruby, "ruby is needed (scripts/test-tools.sh installs it)"
    name, host = f"ruby-{rule}", f"web{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    argv = [ruby, "-e", RUBY_CLIENT, f"https://{host}/small?client=ruby"]
    out = box.run([*argv, "key"] if rule == "intercept" else argv)
    _web_client_ran(matrix, out, name, host, rule, token, before, "ruby")


def _composer_repository(www: Path, host: str) -> None:
    """A Composer repository under nginx's /composer/<host>: packages.json naming one
    package, gw/pkg 1.0.0, and its zip."""
    base = www / "composer" / host
    base.mkdir(parents=True, exist_ok=True)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("composer.json", json.dumps({"name": "gw/pkg", "version": "1.0.0"}))
        zf.writestr("src/Pkg.php", "<?php\nnamespace Gw;\nclass Pkg {}\n")
    (base / "gw-pkg-1.0.0.zip").write_bytes(archive.getvalue())
    package = {"name": "gw/pkg", "version": "1.0.0",
               "dist": {"type": "zip", "url": f"https://{host}/composer/{host}/gw-pkg-1.0.0.zip",
                        "shasum": hashlib.sha1(archive.getvalue()).hexdigest()}}
    (base / "packages.json").write_text(json.dumps({"packages": {"gw/pkg": {"1.0.0": package}}}))


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_composer(matrix: Matrix, rule: str, suffix: str) -> None:
    """Composer (Debian's 2.5) installing a package from a Composer repository with `env`
    output only: HTTPS_PROXY with its credentials, and its CA from SSL_CERT_FILE (through
    composer/ca-bundle); the repository is the project's own composer.json entry."""
    composer = shutil.which("composer")
    assert composer, "composer is needed (scripts/test-tools.sh installs it)"
    name, host = f"composer-{rule}", f"crates{suffix}.test"
    _composer_repository(matrix.nginx.dir / "www", host)
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    project = box.home / "project"
    project.mkdir()
    (project / "composer.json").write_text(json.dumps({
        "repositories": [{"type": "composer", "url": f"https://{host}/composer/{host}"},
                         {"packagist.org": False}],
        "require": {"gw/pkg": "1.0.0"}}))
    out = box.run([composer, "install", "--no-interaction", "--no-progress"], cwd=project,
                  timeout=120, COMPOSER_HOME=str(box.home / "composer"))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (project / "vendor" / "gw" / "pkg" / "src" / "Pkg.php").is_file()
    log = _hdrs(matrix, lambda ln: f"/composer/{host}/" in ln and ln.startswith(host + "|"),
                last="gw-pkg-1.0.0.zip")
    assert any("gw-pkg-1.0.0.zip" in ln for ln in log), log
    _check(matrix, name, host, rule, token, "\n".join(log), before)


MAVEN_SETTINGS = """<settings>
  <mirrors><mirror><id>team</id><mirrorOf>*</mirrorOf><url>{url}</url></mirror>
  </mirrors>
</settings>
"""
MAVEN_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>1.0</version>
  <packaging>pom</packaging>
</project>
"""


def _maven_repository(www: Path) -> None:
    """A Maven repository under nginx's /maven: one artifact (a pom and an empty jar,
    with their sha1 files), what a project's core extension resolves."""
    base = www / "maven" / "org" / "example" / "gw-ext" / "1.0"
    base.mkdir(parents=True, exist_ok=True)
    jar = io.BytesIO()
    with zipfile.ZipFile(jar, "w") as archive:
        archive.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
    pom = MAVEN_POM.format(group="org.example", artifact="gw-ext").replace(
        "<packaging>pom</packaging>", "<packaging>jar</packaging>")
    for file, data in (("gw-ext-1.0.pom", pom.encode()), ("gw-ext-1.0.jar", jar.getvalue())):
        (base / file).write_bytes(data)
        (base / f"{file}.sha1").write_text(hashlib.sha1(data).hexdigest())


def _maven_validate(box: Sandbox, url: str) -> subprocess.CompletedProcess[str]:
    """`mvn validate` of a project whose core extension comes from the repository at
    `url` (a mirror in the user's settings.xml; no proxy there)."""
    project = box.home / "project"
    (project / ".mvn").mkdir(parents=True)
    (project / "pom.xml").write_text(MAVEN_POM.format(group="org.example", artifact="app"))
    (project / ".mvn" / "extensions.xml").write_text(
        "<extensions><extension><groupId>org.example</groupId><artifactId>gw-ext</artifactId>"
        "<version>1.0</version></extension></extensions>\n")
    (box.home / "settings.xml").write_text(MAVEN_SETTINGS.format(url=url))
    return box.run(["mvn", "-B", "-s", str(box.home / "settings.xml"),
                    f"-Dmaven.repo.local={box.home / 'm2'}", "validate"], cwd=project,
                   timeout=120)


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_maven(matrix: Matrix, rule: str, suffix: str) -> None:
    """Maven (Debian's 3.8, its wagon transport) resolving a project's core extension from
    a repository behind the gateway, with `env` output only: the JVM agent gives Maven's
    JVM the proxy (with credentials) and the trust store; settings.xml holds only the
    user's own mirror, no proxy."""
    name, host = f"maven-{rule}", f"maven{suffix}.test"
    _maven_repository(matrix.nginx.dir / "www")
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    out = _maven_validate(box, f"https://{host}/maven")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (box.home / "m2" / "org" / "example" / "gw-ext" / "1.0" / "gw-ext-1.0.jar").is_file()
    log = _hdrs(matrix, lambda ln: "/maven/org/example/gw-ext/" in ln
                and ln.startswith(host + "|"), last=".jar")
    assert log, "nginx saw no request"
    _check(matrix, name, host, rule, token, "\n".join(log), before)


def test_maven_from_an_http_repository(matrix: Matrix) -> None:
    """Maven resolving from a plain http:// repository (nginx on 127.0.0.1, reached as
    http.test) through the gateway, `env` output only: its wagon transport sends several
    requests on one kept-alive connection, and every one reaches the repository (before
    the agent put the credentials on each: `proxy authentication failed`, 407)."""
    name = "maven-http"
    _maven_repository(matrix.nginx.dir / "www")
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    out = _maven_validate(box, "http://http.test/maven")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert (box.home / "m2" / "org" / "example" / "gw-ext" / "1.0" / "gw-ext-1.0.jar").is_file()
    log = _hdrs(matrix, lambda ln: "/maven/org/example/gw-ext/" in ln
                and ln.startswith("http.test|"), enough=2, last=".jar")
    assert len(log) >= 2, log  # (at least the pom and the jar)
    assert token not in "\n".join(log)
    lines = matrix.lines(name, "http.test")
    assert lines and all(r["decision"] == "allow" and r["error"] is None for r in lines), lines
    assert matrix.unauthenticated() == before
    assert len({r["client"] for r in lines}) < len(lines), "no connection carried two requests"


def test_java_without_the_agent_gets_no_further_than_the_proxy(matrix: Matrix,
                                                              java_client: Path) -> None:
    """The control: the JDK's own proxy settings without the agent send no credentials,
    so HttpClient's CONNECT is refused 407 and nothing reaches the upstream."""
    name = "java-no-agent"
    box, _ = matrix.sandbox(name)
    del box.variables["JAVA_TOOL_OPTIONS"]
    port = matrix.gw.proxy.rsplit(":", 1)[1]
    out = box.run(["java", "-Dhttps.proxyHost=127.0.0.1", f"-Dhttps.proxyPort={port}",
                   "-cp", str(java_client), "MatrixClient", "httpclient",
                   "https://web.test/small?client=java-no-agent"], timeout=60)
    assert "407" in out.stdout + out.stderr
    assert "client=java-no-agent" not in (matrix.nginx.dir / "hdrs.log").read_text()


# --------------------------------------------------------------------------- WebSocket, gRPC

WS_SCRIPT = """
import os, sys
from websockets.sync.client import connect
headers = {"X-Api-Key": os.environ["OPENAI_API_KEY"]} if sys.argv[2] == "key" else {}
with connect(sys.argv[1], additional_headers=headers, open_timeout=10) as ws:
    ws.send("hello through the gateway")
    print(ws.recv(timeout=10))
"""


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_websockets(matrix: Matrix, rule: str, suffix: str) -> None:
    name, host = f"websockets-{rule}", f"ws{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    out = box.run([sys.executable, "-c", WS_SCRIPT, f"wss://{host}/echo?c={name}",
                   "key" if rule == "intercept" else "none"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "hello through the gateway"
    heads = [h for h in matrix.recorders["ws"].heads if h.path.endswith(f"c={name}")]
    assert len(heads) == 1
    _check(matrix, name, host, rule, token, matrix.recorders["ws"].text(), before)
    if rule == "intercept":
        assert heads[0].headers["x-api-key"] == LOCAL_KEY


GRPC_SCRIPT = f"""
import os, sys, grpc
creds = grpc.ssl_channel_credentials()  # roots: GRPC_DEFAULT_SSL_ROOTS_FILE_PATH
metadata = [("x-api-key", os.environ["OPENAI_API_KEY"])] if sys.argv[2] == "key" else []
metadata.append(("x-run", sys.argv[3]))
with grpc.secure_channel(sys.argv[1], creds) as channel:
    say = channel.unary_unary({METHOD!r})
    print(say(b"hello", timeout=10, metadata=metadata).decode())
"""


@pytest.mark.parametrize(("rule", "suffix"), RULES)
def test_grpcio(matrix: Matrix, rule: str, suffix: str) -> None:
    name, host = f"grpcio-{rule}", f"grpc{suffix}.test"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    out = box.run([sys.executable, "-c", GRPC_SCRIPT, f"{host}:443",
                   "key" if rule == "intercept" else "none", name])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "echo:hello"
    calls = [h for h in matrix.recorders["grpc"].heads if h.headers.get("x-run") == name]
    assert len(calls) == 1
    _check(matrix, name, host, rule, token, matrix.recorders["grpc"].text(), before)
    if rule == "intercept":
        assert calls[0].headers["x-api-key"] == LOCAL_KEY


# --------------------------------------------------------------------------- inference SDKs

PY_SDKS = """
import json, openai, anthropic
out = {}
oai = openai.OpenAI(max_retries=0)
out["openai"] = oai.chat.completions.create(
    model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]).choices[0].message.content
stream = oai.chat.completions.create(model="gpt-4o-mini", stream=True,
                                     messages=[{"role": "user", "content": "hi"}])
out["openai_stream"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
claude = anthropic.Anthropic(max_retries=0)
out["anthropic"] = claude.messages.create(
    model="claude-test", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
).content[0].text
with claude.messages.stream(model="claude-test", max_tokens=10,
                            messages=[{"role": "user", "content": "hi"}]) as s:
    out["anthropic_stream"] = "".join(s.text_stream)
print(json.dumps(out))
"""

NODE_SDKS = """
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
const out = {};
const oai = new OpenAI({ maxRetries: 0 });
out.openai = (await oai.chat.completions.create({
  model: 'gpt-4o-mini', messages: [{ role: 'user', content: 'hi' }] })).choices[0].message.content;
const stream = await oai.chat.completions.create({
  model: 'gpt-4o-mini', stream: true, messages: [{ role: 'user', content: 'hi' }] });
out.openai_stream = '';
for await (const c of stream) out.openai_stream += c.choices[0]?.delta?.content ?? '';
const claude = new Anthropic({ maxRetries: 0 });
const message = await claude.messages.create({
  model: 'claude-test', max_tokens: 10, messages: [{ role: 'user', content: 'hi' }] });
out.anthropic = message.content[0].text;
out.anthropic_stream = '';
const s = claude.messages.stream({
  model: 'claude-test', max_tokens: 10, messages: [{ role: 'user', content: 'hi' }] });
for await (const e of s) if (e.type === 'content_block_delta') out.anthropic_stream += e.delta.text;
console.log(JSON.stringify(out));
"""

REPLY = "The fake provider answers."


def _check_sdk_run(m: Matrix, name: str, token: str, stdout: str, before_407: int) -> None:
    assert json.loads(stdout) == {"openai": REPLY, "openai_stream": REPLY,
                                  "anthropic": REPLY, "anthropic_stream": REPLY}
    for host in ("api.openai.com", "api.anthropic.com"):
        lines = _check(m, name, host, "intercept", token,
                       json.dumps([r.headers for r in m.fake.requests]), before_407)
        assert len(lines) == 2 and all(r["credential"] for r in lines), lines
    # The fake answers only the real key: every request of this run carried it.
    seen = [r for r in m.fake.requests if r.status == 200]
    assert seen and all(PROVIDER_KEY in json.dumps(r.headers) for r in seen)


def test_python_sdks(matrix: Matrix) -> None:
    name = "python-sdks"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    out = box.run([sys.executable, "-c", PY_SDKS], timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    _check_sdk_run(matrix, name, token, out.stdout, before)


@pytest.fixture(scope="module")
def node_dir() -> Path:
    return node_clients()


@pytest.mark.parametrize("mode", ["builtin", "undici"])
def test_node_sdks(matrix: Matrix, node_dir: Path, mode: str) -> None:
    """Node 20's fetch ignores HTTPS_PROXY: the preload in NODE_OPTIONS (from `env`) makes
    the SDKs use the gateway, with Node's own undici Agent or the undici package's
    EnvHttpProxyAgent."""
    name = f"node-sdks-{mode}"
    box, token = matrix.sandbox(name)
    before = matrix.unauthenticated()
    script = node_dir / "matrix-sdks.mjs"
    script.write_text(NODE_SDKS)
    out = box.run(["node", str(script)], cwd=node_dir, timeout=60,
                  SANDBOX_GATEWAY_NODE_PROXY=mode)
    assert out.returncode == 0, out.stderr[-3000:]
    _check_sdk_run(matrix, name, token, out.stdout, before)


# The sandbox has no resolver (the gateway resolves the upstreams' names): a connection
# that skips the proxy fails here as it would there, whatever this machine's DNS.
NO_RESOLVER = """
import dns from 'node:dns';
dns.lookup = (host, ...args) => process.nextTick(args.at(-1), Object.assign(
  new Error(`getaddrinfo ENOTFOUND ${host} (the sandbox has no resolver)`),
  { code: 'ENOTFOUND', hostname: host }));
"""


@pytest.fixture(scope="module")
def node24() -> Path:
    return env_proxy_node()


def _node24_sdks(m: Matrix, node_dir: Path, node24: Path, name: str,
                 use_env_proxy: bool) -> tuple[subprocess.CompletedProcess[str], str]:
    """The Node SDKs on Node 24 in a sandbox made by `env --node-preload none` (what a
    Node 24 or 22.21+ image uses: no NODE_OPTIONS), with or without NODE_USE_ENV_PROXY."""
    box, token = m.sandbox(name, preload=False)
    assert "NODE_OPTIONS" not in box.variables
    assert box.variables["NODE_USE_ENV_PROXY"] == "1"
    assert box.variables["NODE_EXTRA_CA_CERTS"] == str(m.bundle)
    if not use_env_proxy:
        del box.variables["NODE_USE_ENV_PROXY"]
    script = node_dir / "matrix-sdks-no-resolver.mjs"
    script.write_text(NO_RESOLVER + NODE_SDKS)
    return box.run([str(node24), str(script)], cwd=node_dir, timeout=60), token


def test_node_sdks_env_proxy(matrix: Matrix, node_dir: Path, node24: Path) -> None:
    """Node 24's fetch proxies itself with NODE_USE_ENV_PROXY=1 (credentials from the proxy
    URL) and trusts the gateway CA through NODE_EXTRA_CA_CERTS: no preload needed."""
    name = "node-sdks-env-proxy"
    before = matrix.unauthenticated()
    out, token = _node24_sdks(matrix, node_dir, node24, name, use_env_proxy=True)
    assert out.returncode == 0, out.stderr[-3000:]
    _check_sdk_run(matrix, name, token, out.stdout, before)


# --------------------------------------------------------------------------- why each variable


def test_npm_config_cafile_beats_an_npmrc_cafile(matrix: Matrix) -> None:
    """An npmrc `cafile` (common in images) replaces NODE_EXTRA_CA_CERTS for npm; the env's
    NPM_CONFIG_CAFILE overrides it."""
    box, _ = matrix.sandbox("npm-cafile")
    only_gateway = box.home / "gateway-only.pem"
    only_gateway.write_bytes(matrix.gw.ca_cert.read_bytes())
    (box.home / ".npmrc").write_text(f"cafile={only_gateway}\n")
    argv = ["npm", "view", "--fetch-retries=0", "--registry=https://npm.test/", NPM_PKG,
            "version"]
    cafile = box.variables.pop("NPM_CONFIG_CAFILE")
    out = box.run(argv)  # (first: npm would answer the second run from its cache)
    assert out.returncode != 0 and "certificate" in out.stderr.lower(), out.stderr
    box.variables["NPM_CONFIG_CAFILE"] = cafile
    assert box.run(argv).stdout.strip() == "1.0.0"


def test_node_use_env_proxy_makes_node24_use_the_gateway(matrix: Matrix, node_dir: Path,
                                                         node24: Path) -> None:
    """The control for test_node_sdks_env_proxy: without NODE_USE_ENV_PROXY (and no
    preload) Node 24's fetch ignores HTTPS_PROXY, so the SDKs connect directly and fail."""
    name = "node-sdks-no-env-proxy"
    seen = len(matrix.fake.requests)
    out, _ = _node24_sdks(matrix, node_dir, node24, name, use_env_proxy=False)
    assert out.returncode != 0 and "Connection error." in out.stderr, out.stderr[-3000:]
    assert "ENOTFOUND api.openai.com (the sandbox has no resolver)" in out.stderr
    assert len(matrix.fake.requests) == seen
    assert not [r for r in matrix.gw.audit.records() if r.get("sandbox") == name]


def test_git_proxy_authmethod_saves_a_refused_connect(matrix: Matrix) -> None:
    """Without GIT_HTTP_PROXY_AUTHMETHOD=basic git's first CONNECT carries no credentials:
    the clone still works, after a 407 auth_required on the audit log."""
    box, _ = matrix.sandbox("git-authmethod")
    box.variables.pop("GIT_HTTP_PROXY_AUTHMETHOD")
    before = matrix.unauthenticated()
    out = box.run(["git", "clone", "-q", "https://git.test/repo.git", "clone"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert matrix.gw.audit.wait_for(lambda r: r.get("error") == "auth_required")
    assert matrix.unauthenticated() > before


def test_grpc_needs_its_own_roots_variable(matrix: Matrix) -> None:
    """gRPC ignores SSL_CERT_FILE: without GRPC_DEFAULT_SSL_ROOTS_FILE_PATH the upstream's
    certificate is not trusted."""
    box, _ = matrix.sandbox("grpc-roots")
    box.variables.pop("GRPC_DEFAULT_SSL_ROOTS_FILE_PATH")
    assert box.variables["SSL_CERT_FILE"]
    out = box.run([sys.executable, "-c", GRPC_SCRIPT.replace("timeout=10", "timeout=3"),
                   "grpc.test:443", "none", "grpc-roots"])
    assert out.returncode != 0 and "UNAVAILABLE" in out.stderr, out.stderr[-2000:]


# ------------------------------------------------------------ outbound credential detection

# Every inspected rule above has `dlp: {action: refuse}` (issue 43): the clients' ordinary
# traffic passes it untouched (each test above asserts its client succeeded and no line
# of its sandbox has an error). The control: a credential the gateway did not issue is
# refused on the same rules.


def test_a_pypi_token_in_an_index_url_is_refused(matrix: Matrix) -> None:
    """pip sends the index URL's credentials as Basic auth: the token inside the base64
    is found, the request refused before the index sees it, the audit line names the
    detector and not the value."""
    name, host = "dlp-pip", "pypi-i.test"
    box, _ = matrix.sandbox(name)
    secret = fake("pypi").text
    out = box.run([sys.executable, "-m", "pip", "download", "--no-cache-dir", "--retries",
                   "0", "--timeout", "10", "--disable-pip-version-check", "-d", "dl",
                   "--index-url", f"https://__token__:{secret}@{host}/simple/", PKG],
                  timeout=60)
    assert out.returncode != 0, out.stdout
    lines = [r for r in matrix.lines(name, host) if r.get("error")]
    assert lines and {r["error"] for r in lines} == {"secret_detected"}, lines
    assert {f["detector"] for r in lines for f in r["dlp"]} == {"pypi"}
    assert secret not in json.dumps(lines)
    assert secret not in matrix.recorders["pypi"].text()


# --------------------------------------------------------------------------- refusals shown

REFUSED = 'policy_denied: no rule in policy "matrix" allows host "nope.test"'


@pytest.mark.parametrize("client", ["pip", "npm", "cargo", "maven"])
def test_the_client_prints_a_refusal(matrix: Matrix, client: str) -> None:
    """A host no rule allows, with the default refusals inside TLS: each package manager
    prints the gateway's reason itself (pip for a direct URL: for an index page it says why
    only with -vv), nothing is dialled, and the one audit line is the CONNECT's."""
    name = f"refused-{client}"
    box, _ = matrix.sandbox(name)
    if client == "pip":
        out = box.run([sys.executable, "-m", "pip", "download", "--no-cache-dir", "-d", "dl",
                       "--disable-pip-version-check",
                       "https://nope.test/somepkg-1.0-py3-none-any.whl"], timeout=60)
        shown = REFUSED
    elif client == "npm":
        out = box.run(["npm", "view", "--fetch-retries=0", "--registry=https://nope.test/",
                       "somepkg", "version"], timeout=60)
        shown = f"npm error 403 403 {REFUSED}"
    elif client == "cargo":
        if not Path(CARGO).exists():
            pytest.skip("cargo is not installed")
        out = _cargo_fetch(box, box.home / "app", "https://nope.test/index/")
        shown = 'got 403\n  body:\n  {"error": "policy_denied", "reason": "no rule in policy'
    else:
        out = _maven_validate(box, "https://nope.test/maven")
        shown = f"status: 403 {REFUSED}"
    assert out.returncode != 0
    assert shown in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
    lines = [r for r in matrix.gw.audit.records() if r.get("sandbox") == name]
    assert lines and {(r["host"], r["method"], r["error"]) for r in lines} == {
        ("nope.test", "CONNECT", "policy_denied")}
