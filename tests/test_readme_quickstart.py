"""The README's quick start runs as written, against a real gateway process.

`sandbox-gateway run` on the embedded defaults (the repository's policies copied into a
fresh directory; a config only for what this machine needs: free ports instead of 8080,
and pypi.org mapped to a local nginx by `network.resolve`, the internet being out of
reach), then the README's commands in one bash, each output compared with the `# …`
lines under it. Only the proxy address and the `.venv/bin/` prefix are substituted; curl's
default trust (`CURL_CA_BUNDLE`) is the local CA that stands for pypi's public chain, so
`--cacert certs/ca.crt` is what makes the refused HTTPS request readable. `make run` binds
where the quick start connects.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers.nginx import Nginx
from helpers.tls import LocalCA

REPO = Path(__file__).resolve().parent.parent
README_ADDRESS = "127.0.0.1:8080"


def quick_start() -> list[tuple[str, str]]:
    """(command, expected output) of the README's quick start block, `make run` aside;
    the expected output is the `# ` lines under the command, joined ("" when none)."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start\n", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("#"):
            steps[-1][1].append(line[1:].strip())
        elif line.strip():
            steps.append((line, []))
    assert steps[0][0].startswith("make run")
    return [(command, " ".join(out)) for command, out in steps[1:]]


def _matches(expected: str, got: str) -> bool:
    """`got` says what `expected` shows: up to its first "…", with JSON-escaped quotes
    and line breaks as the README wraps them."""
    head = expected.split("…", 1)[0]
    return " ".join(got.split()).startswith(" ".join(head.split()))


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[Path, str, str, Path]]:
    """(directory, proxy address, banner, upstream CA) of a started `sandbox-gateway run`."""
    ca = LocalCA.create(tmp_path / "upstream-ca", name="stands for pypi's public chain")
    nginx = Nginx(tmp_path / "nginx", ca, ["pypi.org"])
    (nginx.dir / "www" / "simple").mkdir()
    (nginx.dir / "www" / "simple" / "index.html").write_text("<html>simple</html>\n")
    work = tmp_path / "clone"
    work.mkdir()
    shutil.copytree(REPO / "policies", work / "policies")
    (work / "gw.yaml").write_text(yaml.safe_dump({
        "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0"},
        "network": {"resolve": {"pypi.org": f"127.0.0.1:{nginx.port}"},
                    "upstream_ca": str(ca.cert_path)}}))
    err = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "sandbox-gateway"), "run",
                             "--workers", "1", "--config", "gw.yaml"], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                            env=_environ(tmp_path))
    try:
        deadline = time.monotonic() + 60
        banner = ""
        while "admin token" not in banner:
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, (tmp_path / "stderr").read_text()
            time.sleep(0.1)
            banner = (tmp_path / "stderr").read_text()
        found = re.search(r"proxy\s+http://(127\.0\.0\.1:\d+)", banner)
        assert found, banner
        yield work, found.group(1), banner, ca.cert_path
    finally:
        proc.terminate()
        proc.wait(30)
        err.close()
        nginx.stop()


def _environ(tmp_path: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
            "LANG": "C.UTF-8"}


def test_the_quick_start_runs_as_written(gateway: tuple[Path, str, str, Path],
                                         tmp_path: Path) -> None:
    work, proxy, banner, ca = gateway
    assert "(HTTPS_PROXY for sandboxes; this host only: loopback)" in banner
    steps = quick_start()
    assert len(steps) == 4 and all(README_ADDRESS in c for c, _ in steps[1:])
    venv = str(Path(sys.executable).parent) + "/"
    script = "".join(f"{command.replace(README_ADDRESS, proxy).replace('.venv/bin/', venv)}"
                     f" 2>&1; echo; echo '@@@ step {i}'\n"
                     for i, (command, _) in enumerate(steps))
    out = subprocess.run(["bash", "-c", script], cwd=work, capture_output=True, text=True,
                         timeout=120, check=False,
                         env={**_environ(tmp_path),
                              "CURL_CA_BUNDLE": str(ca)})
    outputs = [part.strip() for part in re.split(r"@@@ step \d+\n?", out.stdout)[:len(steps)]]
    assert len(outputs) == len(steps), out.stdout + out.stderr
    assert outputs[0] == "", outputs[0]  # the token, minted into T
    for (command, expected), got in zip(steps[1:], outputs[1:], strict=True):
        assert expected and _matches(expected, got), (command, expected, got)
        if got.startswith("{"):  # a refusal: whole JSON, its code the one shown
            assert f'"error": "{json.loads(got)["error"]}"' in expected


def test_make_run_binds_where_the_readme_connects() -> None:
    """`make run` (no CONFIG) puts the proxy on the address the quick start's curl lines
    use; LISTEN moves it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_GATEWAY_")}
    make = subprocess.run(["make", "-n", "run"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True, env=env).stdout
    assert f"SANDBOX_GATEWAY_LISTEN__PROXY={README_ADDRESS} " in make
    moved = subprocess.run(["make", "-n", "run", "LISTEN=0.0.0.0:8080"], cwd=REPO,
                           capture_output=True, text=True, timeout=60, check=True,
                           env=env).stdout
    assert "SANDBOX_GATEWAY_LISTEN__PROXY=0.0.0.0:8080 " in moved
    assert all(README_ADDRESS in command for command, _ in quick_start()[1:])


def test_the_quickstart_config_leaves_nothing_untracked() -> None:
    """Issue 42, item 6: docs/quickstart.md's config keeps its state (the SQLite file, the
    audit spill journal next to it) where git ignores it, and its CA and keys in the
    repository's ignored certs/."""
    from gateway.config import load_config

    cfg = load_config(REPO / "examples" / "quickstart" / "gateway.yaml", env={})
    state = Path(cfg.state["path"])
    for path in (state, state.parent / "audit-spill" / "journal", cfg.certs / "ca.key"):
        out = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO,
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, f"{path} is not ignored by git"
