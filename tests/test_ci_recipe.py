"""examples/ci/policy-pr.yml: valid YAML, every `sandbox-gateway` command it runs parses
with the real CLI, and its steps, run as GitHub would (bash -eo pipefail), produce the
PR comment for a pull request that narrows a rule in a real git clone."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "examples" / "ci" / "policy-pr.yml"
EXPRESSION = re.compile(r"\$\{\{\s*([^}]*?)\s*\}\}")


def workflow() -> dict[Any, Any]:
    data = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(data, dict)
    return data


def steps() -> list[dict[str, Any]]:
    (job,) = workflow()["jobs"].values()
    return list(job["steps"])


def expand(text: str, base_ref: str = "main") -> str:
    """Replace the GitHub expressions the workflow uses (any other one fails the test)."""
    def one(match: re.Match[str]) -> str:
        known = {"github.base_ref": base_ref}
        assert match.group(1) in known, f"unexpected expression {match.group(0)}"
        return known[match.group(1)]

    return EXPRESSION.sub(one, text)


def gateway_commands() -> list[list[str]]:
    """Every `sandbox-gateway ...` command line of every run: block, split like a shell."""
    out = []
    for step in steps():
        script = expand(step.get("run", "")).replace("\\\n", " ")
        for line in script.splitlines():
            line = line.strip()
            if line.startswith("sandbox-gateway "):
                words = shlex.split(line)
                if ">" in words:
                    words = words[:words.index(">")]
                out.append(words)
    return out


def test_workflow_is_valid_yaml_with_the_expected_shape() -> None:
    data = workflow()
    trigger = data.get("on", data.get(True))  # YAML 1.1 reads a bare `on` as true
    assert trigger["pull_request"]["paths"] == ["policies/**"]
    assert data["permissions"]["pull-requests"] == "write"
    uses = [s.get("uses", "") for s in steps()]
    assert any(u.startswith("actions/checkout@") for u in uses)
    assert any(u.startswith("actions/github-script@") for u in uses)
    checkout = next(s for s in steps() if s.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0  # --base origin/<branch> needs history


def test_every_command_exists_in_the_cli() -> None:
    commands = gateway_commands()
    verbs = [tuple(c[1:3]) for c in commands]
    assert verbs == [("policy", "check"), ("policy", "test"), ("policy", "diff")]
    parser = build_parser()
    parsed = [parser.parse_args(c[1:]) for c in commands]  # SystemExit on any unknown flag
    diff = parsed[2]
    assert diff.base == "origin/main" and diff.dir == "policies"
    assert diff.replay == ["$AUDIT_SAMPLE"] and diff.format == "markdown"
    assert diff.fail_on == "newly-denied"
    assert parsed[1].junit == "policy-tests.xml"


def git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", HOME=str(cwd))
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_steps_comment_on_a_pr_that_narrows_a_rule(tmp_path: Path) -> None:
    upstream = tmp_path / "upstream"
    shutil.copytree(ROOT / "policies", upstream / "policies")
    sample = upstream / "policies-audit" / "sample.jsonl.gz"
    sample.parent.mkdir()
    lines = [{"policy": "coding-agent", "method": "HEAD", "scheme": "https", "port": 443,
              "host": "api.github.com", "path": "/repos/a/b", "count": 40},
             {"policy": "coding-agent", "method": "GET", "scheme": "https", "port": 443,
              "host": "api.github.com", "path": "/repos/a/b", "count": 60},
             {"policy": "coding-agent", "method": "CONNECT", "scheme": None, "port": 443,
              "host": "pypi.org", "path": None, "count": 900}]
    sample.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))
    git(upstream, "init", "-q", "-b", "main")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-q", "-m", "policies")
    git(tmp_path, "clone", "-q", str(upstream), "work")
    work = tmp_path / "work"
    git(work, "checkout", "-q", "-b", "narrow-github")
    agent = work / "policies" / "coding-agent.yaml"
    agent.write_text(agent.read_text().replace("methods: [GET, HEAD]", "methods: [GET]"))
    tests = work / "policies" / "tests" / "coding-agent.yaml"
    tests.write_text(tests.read_text().replace(
        "  - name: GitHub API HEAD is allowed\n    policy: coding-agent\n    method: HEAD\n"
        "    url: https://api.github.com/repos/psf/requests\n    expect: allow",
        "  - name: GitHub API HEAD is denied now\n    policy: coding-agent\n    method: HEAD\n"
        "    url: https://api.github.com/repos/psf/requests\n    expect: deny"))
    git(work, "commit", "-q", "-am", "narrow the GitHub API to GET")

    env = {**os.environ, **{k: str(v) for k, v in workflow()["env"].items()}}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["GITHUB_OUTPUT"] = str(tmp_path / "output")
    env["GITHUB_STEP_SUMMARY"] = str(tmp_path / "summary")
    for k in [k for k in env if k.startswith("GIT_")]:
        del env[k]
    ran = []
    for step in steps():
        if "run" not in step or "pip install" in step["run"] or "exit 1" in step["run"]:
            continue
        done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c",
                               expand(step["run"])], cwd=work, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, (step["name"], done.stdout, done.stderr)
        ran.append(step["name"])
    assert len(ran) == 3
    assert (tmp_path / "output").read_text().strip() == "exit_code=1"  # newly denied: fail
    comment = (work / "policy-diff.md").read_text()
    assert comment.startswith("<!-- sandbox-gateway-policy-diff -->")
    assert "`origin/main`" in comment
    assert "| `coding-agent` | rule changed | `api.github.com` | methods: `GET, HEAD` → `GET`" \
        in comment
    assert "#### Newly denied: 40 request(s), 1 group(s)" in comment
    assert "`HEAD https://api.github.com/repos/a/b` \u00d740" in comment
    assert (tmp_path / "summary").read_text() == comment
    junit = (work / "policy-tests.xml").read_text()
    assert 'failures="0"' in junit
