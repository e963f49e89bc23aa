"""A sandbox's process environment made only from `sandbox-gateway env` output, and
clients run in it as subprocesses (each with a timeout).

Besides the env output a client gets only PATH, a fresh HOME and LANG, plus switches that
make this machine's own tool configuration invisible (pip's /etc/xdg config with local
wheel directories, the system gitconfig), so nothing but the env output configures it.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gateway.cli import main as cli_main

ISOLATION = {"PIP_CONFIG_FILE": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def env_output(*args: str) -> tuple[int, str, str]:
    """Run `sandbox-gateway env ARGS` (the real CLI, in-process): (exit code, stdout,
    stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["env", *args])
    return code, out.getvalue(), err.getvalue()


def parse_dotenv(text: str) -> dict[str, str]:
    """`K=v` lines as docker --env-file reads them (values literal)."""
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, line
            env[key] = value
    return env


@dataclass
class Sandbox:
    """The environment of one sandbox (one token)."""

    variables: dict[str, str]
    home: Path

    @classmethod
    def from_cli(cls, home: Path, *, token: str, proxy: str, ca_bundle: Path,
                 node_preload: Path, config: Path, jvm_agent: Path | None = None) -> Sandbox:
        code, out, err = env_output("--token", token, "--proxy", proxy,
                                    "--ca-bundle", str(ca_bundle),
                                    "--node-preload", str(node_preload),
                                    "--jvm-agent", str(jvm_agent or "none"),
                                    "--config", str(config), "--format", "dotenv")
        assert code == 0, err
        home.mkdir(parents=True, exist_ok=True)
        return cls(parse_dotenv(out), home)

    def environ(self, **extra: str) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
                "LANG": "C.UTF-8", **ISOLATION, **self.variables, **extra}

    def run(self, argv: list[str], *, cwd: Path | None = None, timeout: float = 30,
            input: str | None = None, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=cwd or self.home, env=self.environ(**extra),
                              capture_output=True, text=True, timeout=timeout, input=input)
