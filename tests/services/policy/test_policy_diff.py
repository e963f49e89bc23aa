"""`policy diff`: the rule-level diff, the replay of audit lines, rendering, the CLI
(directory and real git ref bases) and the replay's speed."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from bench.policy_replay import narrow, write_audit
from gateway.cli import main
from gateway.core.policy import PolicySet
from gateway.services.policy import load_policy_dir, load_policy_texts
from gateway.services.policy.diff import diff_sets
from gateway.services.policy.replay import replay
from gateway.services.policy.report import diff_json, diff_markdown, diff_text

ROOT = Path(__file__).resolve().parents[3]

BASE = {
    "p/agent.yaml": """\
version: v1
name: agent
extends: [base]
egress:
  - host: api.github.com
    methods: [GET, HEAD]
    paths: ["/repos/**"]
  - host: api.github.com
    methods: [POST]
    paths: ["/repos/*/*/issues"]
  - host: api.openai.com
    credential: openai
  - host: other.test
credentials:
  openai: {preset: openai, secret: openai-api-key}
""",
    "p/base.yaml": """\
version: v1
name: base
egress:
  - host: pypi.org
  - host: github.com
    ports: [22]
    protocol: tcp
""",
    "p/old.yaml": "version: v1\nname: old\negress:\n  - host: old.test\n",
}
HEAD = {
    "q/agent.yaml": """\
version: v1
name: agent
mode: report
extends: [base, extra]
egress:
  # a comment moves every rule down a line: not a change
  - host: api.github.com
    methods: [GET]
    paths: ["/repos/**"]
  - host: api.github.com
    methods: [POST]
    paths: ["/repos/*/*/issues"]
  - host: api.openai.com
    credential: openai
  - host: api.anthropic.com
credentials:
  openai: {preset: openai, secret: openai-key-v2}
""",
    "q/base.yaml": """\
version: v1
name: base
egress:
  - host: pypi.org
    ports: [443]
""",
    "q/extra.yaml": "version: v1\nname: extra\negress:\n  - host: extra.test\n",
}


@pytest.fixture
def base() -> PolicySet:
    return load_policy_texts(BASE)


@pytest.fixture
def head() -> PolicySet:
    return load_policy_texts(HEAD)


def test_rule_level_diff(base: PolicySet, head: PolicySet) -> None:
    diff = diff_sets(base, head, base_root="p", head_root="q")
    by_name = {p.name: p for p in diff.policies}
    assert sorted(by_name) == ["agent", "base", "extra", "old"]
    assert by_name["old"].kind == "removed" and by_name["extra"].kind == "added"
    agent = by_name["agent"]
    assert agent.fields == (("mode", "enforce", "report"), ("extends", "base", "base, extra"))
    changes = [(c.kind, c.label, c.fields, c.old_source, c.new_source) for c in agent.rules]
    assert changes == [
        # two rules share the identity api.github.com/http: the identical one is unchanged
        ("changed", "api.github.com", (("methods", "GET, HEAD", "GET"),),
         "agent.yaml:5", "agent.yaml:7"),
        ("removed", "other.test", (), "agent.yaml:13", None),
        ("added", "api.anthropic.com", (), None, "agent.yaml:15"),
    ]
    base_changes = [(c.kind, c.label, c.fields) for c in by_name["base"].rules]
    assert base_changes == [("changed", "pypi.org", (("ports", "default (443, 80)", "443"),)),
                            ("removed", "github.com (tcp)", ())]
    assert by_name["base"].affects == ("agent",)
    assert [(c.name, c.kind, c.fields) for c in diff.credentials] == [
        ("openai", "changed", (("secret", "openai-api-key", "openai-key-v2"),))]
    assert diff_sets(base, base).empty


def audit(*records: dict[str, Any]) -> list[bytes]:
    return [json.dumps(r).encode() + b"\n" for r in records]


def req(method: str | None, host: str, path: str | None = "/", *, policy: str = "agent",
        port: int = 443, scheme: str | None = "https", **extra: Any) -> dict[str, Any]:
    return {"sandbox": "sbx-1", "policy": policy, "method": method, "scheme": scheme,
            "host": host, "port": port, "path": path, **extra}


def test_replay_groups_changes_newly_denied_first(base: PolicySet, head: PolicySet) -> None:
    lines = audit(
        *[req("HEAD", "api.github.com", f"/repos/a/b{i % 4}") for i in range(10)],
        req("GET", "api.github.com", "/repos/a/b"),  # allowed both ways, same rule
        req("CONNECT", "other.test", None, scheme=None),  # rule removed (tunnel level)
        req(None, "other.test", None, scheme=None),  # null method = tunnel level too
        req("GET", "other.test", "/x"),
        req("GET", "api.anthropic.com", "/v1/models", count=5),  # newly allowed, counted
        req("CONNECT", "github.com", None, port=22, scheme="tcp"),  # tcp rule removed
        req("GET", "pypi.org", "/simple/", port=80, scheme="http"),  # port narrowed
        req("GET", "evil.test", "/"),  # denied both ways
        req("GET", "old.test", "/", policy="old"),  # policy removed: newly denied
        req("GET", "extra.test", "/", policy="nobody"),  # in neither set: skipped
        req("GET", "bad host!", "/"), req("GET", "x.test", "/", port="443"),  # malformed
        {"policy": None, "host": "pypi.org"}, {"policy": "agent"},  # skipped
    )
    lines += [b"not json\n", b"\n", b"[1]\n"]
    report = replay(lines, base, head, base_root="p", head_root="q")
    assert report.lines == 26  # blank lines are not lines
    assert report.skipped == {"without policy or host": 2, "unreadable (not JSON)": 2,
                              "policy in neither set": 1, "malformed": 2}
    assert report.requests == 23 and report.distinct == 12
    summary = {c: [(g.policy, g.host, g.count, g.distinct) for g in report.groups(c)]
               for c in ("newly_denied", "newly_allowed", "changed")}
    # agent is in mode: report now, so its would-denies are allowed: "changed", not denied;
    # a request denied before (evil.test) goes through in report mode: newly allowed.
    assert summary == {
        "newly_denied": [("old", "old.test", 1, 1)],
        "newly_allowed": [("agent", "api.anthropic.com", 5, 1), ("agent", "evil.test", 1, 1)],
        "changed": [("agent", "api.github.com", 10, 4), ("agent", "other.test", 3, 2),
                    ("agent", "github.com", 1, 1), ("agent", "pypi.org", 1, 1)],
    }
    github = report.groups("changed")[0]
    assert [e.count for e in github.examples] == [3, 3, 2]  # at most three, largest first
    assert (github.examples[0].base.short(), github.examples[0].new.short()) == (
        "allow (agent.yaml:5)", "report (agent.yaml:7)")


def test_replay_enforced_narrowing(base: PolicySet) -> None:
    """The same narrowing without mode: report denies: examples, counts, reasons."""
    enforced = load_policy_texts({k: v.replace("mode: report\n", "") for k, v in HEAD.items()})
    lines = audit(
        *[req("HEAD", "api.github.com", f"/repos/a/b{i % 4}") for i in range(10)],
        req("CONNECT", "other.test", None, scheme=None),
        req("GET", "other.test", "/x"),
        req("CONNECT", "github.com", None, port=22, scheme="tcp"),
        req("GET", "pypi.org", "/simple/", port=80, scheme="http"),
        req("GET", "old.test", "/", policy="old"),
        req("POST", "api.openai.com", "/v1/chat/completions", model="gpt-4o"),
    )
    report = replay(lines, base, enforced, base_root="p", head_root="q")
    denied = {(g.policy, g.host): g for g in report.groups("newly_denied")}
    assert list(denied) == [("agent", "api.github.com"), ("agent", "other.test"),
                            ("agent", "github.com"), ("agent", "pypi.org"), ("old", "old.test")]
    github = denied[("agent", "api.github.com")]
    assert github.count == 10 and github.distinct == 4
    assert github.reason == ("method HEAD is not allowed for api.github.com by rule "
                             "agent.yaml:6 (methods: GET); add HEAD to its methods")
    assert github.examples[0].base.rule == "agent.yaml:5"
    assert denied[("agent", "github.com")].examples[0].describe() == "CONNECT github.com:22 (tcp)"
    assert "does not exist in the proposed set" in denied[("old", "old.test")].reason
    # the credential's secret changed, not which credential a request gets: no change
    assert report.groups("changed") == []

    text = diff_text(diff_sets(base, enforced, base_root="p", head_root="q"), report)
    assert "HEAD https://api.github.com/repos/a/b0 x3, sandbox sbx-1: " \
           "allow (agent.yaml:5) -> deny" in text
    md = diff_markdown(diff_sets(base, enforced), report)
    assert md.startswith("<!-- sandbox-gateway-policy-diff -->\n### Policy diff:")
    assert "#### Newly denied: 15 request(s), 5 group(s)" in md
    assert ("| `agent` | `api.github.com` | 10 | `HEAD https://api.github.com/repos/a/b0` "
            "\u00d73") in md
    data = json.loads(diff_json(diff_sets(base, enforced), report))
    assert data["replay"]["newly_denied"][0]["host"] == "api.github.com"
    assert data["replay"]["newly_denied"][0]["examples"][0]["base"]["decision"] == "allow"


def test_markdown_fits_a_comment(base: PolicySet) -> None:
    enforced = load_policy_texts({k: v.replace("mode: report\n", "") for k, v in HEAD.items()})
    lines = audit(*[req("GET", f"h{i}.other.test", f"/{'x' * 300}", policy="old")
                    for i in range(2000)], req("GET", "old.test", "/", policy="old"))
    report = replay(lines, base, enforced)
    assert len(report.groups("newly_denied")) == 1  # old.test; h*.other.test never allowed
    base2 = load_policy_texts({"a.yaml": "version: v1\nname: old\negress:\n"
                                         "  - host: '**.other.test'\n"})
    head2 = load_policy_texts({"a.yaml": "version: v1\nname: old\negress: []\n"})
    many = replay(lines, base2, head2)
    assert len(many.groups("newly_denied")) == 2000
    md = diff_markdown(diff_sets(base2, head2), many, limit=20_000)
    assert len(md) < 21_000
    assert "more row(s) left out to fit a comment" in md


# --- CLI ------------------------------------------------------------------------------


def write(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / Path(name).name).write_text(text)
    return directory


def run_git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", HOME=str(cwd))
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_cli_directories_formats_and_fail_on(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    old = write(tmp_path / "old", BASE)
    new = write(tmp_path / "new", {k: v.replace("mode: report\n", "") for k, v in HEAD.items()})
    audit_file = tmp_path / "audit.jsonl.gz"
    with gzip.open(audit_file, "wb") as handle:
        handle.writelines(audit(req("HEAD", "api.github.com", "/repos/a/b"),
                                req("GET", "api.anthropic.com", "/")))
    assert main(["policy", "diff", "--base", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert f"policy diff: {old} (sha256:" in out
    assert "~ api.github.com  methods: GET, HEAD -> GET  (agent.yaml:5 -> agent.yaml:6)" in out
    assert main(["policy", "diff", "--base", str(old), str(new), "--fail-on", "any"]) == 1
    capsys.readouterr()
    argv = ["policy", "diff", "--base", str(old), str(new), "--replay", str(audit_file)]
    assert main([*argv, "--fail-on", "newly-denied", "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["replay"]["newly_denied"][0]["host"] == "api.github.com"
    assert main([*argv, "--fail-on", "newly-allowed"]) == 1
    capsys.readouterr()
    # nothing newly denied: exit 0 even with --fail-on newly-denied
    assert main(["policy", "diff", "--base", str(new), str(new), "--replay", str(audit_file),
                 "--fail-on", "newly-denied"]) == 0
    # newly-* need recorded traffic; a missing audit file is an error, not a pass
    assert main(["policy", "diff", "--base", str(old), str(new), "--fail-on",
                 "newly-denied"]) == 2
    assert "needs --replay" in capsys.readouterr().err
    assert main([*argv[:-1], str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read audit lines" in capsys.readouterr().err


def test_cli_git_ref_base(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    run_git(repo, "init", "-q", "-b", "main")
    (repo / "README").write_text("policies come later\n")
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "before the policies")
    run_git(repo, "tag", "before")
    pdir = write(repo / "policies", BASE)
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-q", "-m", "policies")
    sha = run_git(repo, "rev-parse", "HEAD")
    # the proposed change, uncommitted in the working tree
    (pdir / "agent.yaml").write_text(BASE["p/agent.yaml"].replace("  - host: other.test\n", ""))
    assert main(["policy", "diff", "--base", "main", str(pdir), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["base"] == {"label": "main", "revision": sha}
    assert data["head"]["revision"] == f"{sha}-dirty"
    (rule,) = data["policies"][0]["rules"]
    assert (rule["change"], rule["rule"], rule["old_source"]) == ("removed", "other.test",
                                                                  "agent.yaml:13")
    # a ref from before the policies existed: everything is added
    assert main(["policy", "diff", "--base", "before", str(pdir), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {p["name"]: p["change"] for p in data["policies"]} == {
        "agent": "added", "base": "added", "old": "added"}
    assert main(["policy", "diff", "--base", "no-such-ref", str(pdir)]) == 2
    assert "unknown git ref 'no-such-ref'" in capsys.readouterr().err


# --- speed ----------------------------------------------------------------------------


def test_replay_speed_small_version_of_the_benchmark(tmp_path: Path) -> None:
    """bench/policy_replay.py at 50k lines (the benchmark runs 1M in a few seconds)."""
    narrowed = tmp_path / "narrowed"
    narrow(ROOT / "policies", narrowed)
    buffer = io.StringIO()
    write_audit(buffer, 50_000, 5_000)
    lines = buffer.getvalue().encode().splitlines(keepends=True)
    started = time.perf_counter()
    report = replay(lines, load_policy_dir(ROOT / "policies"), load_policy_dir(narrowed))
    elapsed = time.perf_counter() - started
    assert report.lines == 50_000
    assert report.requests + sum(report.skipped.values()) == 50_000
    assert report.groups("newly_denied")[0].host == "api.github.com"  # HEAD dropped
    assert elapsed < 15, f"50k lines took {elapsed:.1f}s (budget: 1M lines in 60s)"
