"""`sandbox-gateway presets update`: the GitHub presets' hosts from a local fake of
api.github.com/meta serving the published JSON shape (no internet)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from fakes.tls_http import Recorder, TLSServer, serve_handler
from helpers.tls import LocalCA

from gateway.cli import main as cli_main
from gateway.core.evaluate import request_for
from gateway.core.policy import decide
from gateway.services.policy import load_policy_text
from gateway.services.policy.services.update import MetaError, rewrite, website_hosts

SHIPPED = Path(__file__).parents[3] / "gateway" / "services" / "policy" / "services"
# The shape of GET https://api.github.com/meta (keys as published; values shortened).
META: dict[str, Any] = {
    "verifiable_password_authentication": False,
    "ssh_key_fingerprints": {"SHA256_ED25519": "+DiY3wvvV6TuJJhbpZisF/zLDA0zPMSvHdkr4UvCOqU"},
    "ssh_keys": ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0"],
    "hooks": ["192.30.252.0/22"], "web": ["192.30.252.0/22"], "api": ["192.30.252.0/22"],
    "git": ["192.30.252.0/22"], "packages": ["140.82.121.33/32"], "pages": ["185.199.108.0/22"],
    "importer": ["52.23.85.212/32"], "actions": ["4.148.0.0/16"],
    "actions_macos": ["13.105.117.0/31"], "dependabot": [], "copilot": ["140.82.112.0/20"],
    "domains": {
        "website": ["*.github.com", "*.github.dev", "*.github.io", "*.githubassets.com",
                    "*.githubusercontent.com", "*.githubnew.example"],
        "codespaces": ["*.github.com", "*.api.github.com"],
        "copilot": ["*.github.com", "*.githubcopilot.com"],
        "packages": ["*.pkg.github.com", "ghcr.io"],
        "actions": ["*.actions.githubusercontent.com"],
        "artifact_attestations": {"trust_domain": "",
                                  "services": ["*.actions.githubusercontent.com"]},
    },
}


class _Meta(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    body = json.dumps(META).encode()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.recorder.heads.append(self.path)  # type: ignore[attr-defined]
        found = self.path in ("/meta", "/empty")
        body = self.body if self.path == "/meta" else b"{}"
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def fake_meta(tmp_path: Path) -> Iterator[tuple[TLSServer, LocalCA]]:
    ca = LocalCA.create(tmp_path / "ca", name="meta CA")
    server = serve_handler(_Meta, ca.server_context(tmp_path, ["localhost"]), Recorder())
    try:
        yield server, ca
    finally:
        server.stop()


def test_update_rewrites_the_github_presets(tmp_path: Path,
                                            fake_meta: tuple[TLSServer, LocalCA]) -> None:
    server, ca = fake_meta
    work = tmp_path / "presets"
    shutil.copytree(SHIPPED, work, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    argv = ["presets", "update", "--meta-url", f"https://localhost:{server.port}/meta",
            "--ca-file", str(ca.cert_path), "--dir", str(work), "--date", "2026-12-01"]
    assert cli_main(argv) == 0
    for name in ("github-read", "github-write"):
        text = (work / f"{name}.yaml").read_text()
        assert "as published on 2026-12-01" in text
        assert '- host: "*.githubnew.example"' in text
        # the rewritten preset loads and allows a GET on the new host, nothing else there
        policy = load_policy_text("p.yaml", text.replace(f"name: service/{name}", "name: p"))
        assert decide(policy.policies["p"], request_for(
            "GET", "https://dl.githubnew.example/x")).result == "allow"
        assert decide(policy.policies["p"], request_for(
            "POST", "https://dl.githubnew.example/x")).result == "deny"
        # the rest of the file is as shipped
        shipped = (SHIPPED / f"{name}.yaml").read_text()
        assert text.split("# BEGIN hosts")[0] == shipped.split("# BEGIN hosts")[0]
    assert cli_main(argv) == 0  # again: nothing changes
    assert (work / "pypi.yaml").read_text() == (SHIPPED / "pypi.yaml").read_text()


def test_update_refuses_what_it_cannot_use(tmp_path: Path,
                                           fake_meta: tuple[TLSServer, LocalCA],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    server, ca = fake_meta
    work = tmp_path / "presets"
    shutil.copytree(SHIPPED, work, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    before = (work / "github-read.yaml").read_text()
    for path, why in (("/empty", "no domains.website"), ("/x", "HTTP Error 404")):
        assert cli_main(["presets", "update", "--meta-url",
                         f"https://localhost:{server.port}{path}",
                         "--ca-file", str(ca.cert_path), "--dir", str(work)]) == 1
        assert why in capsys.readouterr().err
    assert cli_main(["presets", "update", "--meta-url", f"https://localhost:{server.port}/meta",
                     "--dir", str(work)]) == 1  # the fake's certificate is not trusted
    assert "certificate" in capsys.readouterr().err.lower()
    assert (work / "github-read.yaml").read_text() == before


@pytest.mark.parametrize(("meta", "why"), [
    ({}, "no domains.website"),
    ({"domains": {"website": []}}, "no domains.website"),
    ({"domains": {"website": [7]}}, "not a host name"),
    ({"domains": {"website": ["*"]}}, "domains.website holds '*'"),
    ({"domains": {"website": [f"h{i}.example" for i in range(65)]}}, "more than 64"),
])
def test_meta_shapes_refused(meta: Any, why: str) -> None:
    with pytest.raises(MetaError, match=why):
        website_hosts(meta)


def test_shipped_block_is_what_rewrite_writes() -> None:
    text = (SHIPPED / "github-read.yaml").read_text()
    date = text.split("as published on ")[1].split()[0]
    hosts = [h for h in website_hosts(META) if h != "*.githubnew.example"]
    assert rewrite(text, hosts, date) == text
    with pytest.raises(MetaError, match="no '# BEGIN hosts:'"):
        rewrite("version: v1\n", hosts, date)
