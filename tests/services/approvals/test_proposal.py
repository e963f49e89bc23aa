"""`always` grants as policy changes: the rule inserted where it belongs in every shape
of `egress:` a file can have, and the result loads as a policy that allows what was
granted."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway.core.approvals import Asked, Grant
from gateway.core.policy import Request, decide
from gateway.services.approvals.proposal import propose, rule_snippet, with_rule
from gateway.services.policy import load_policy_texts

HOST = Asked("host", "new.test", 443)
REQUEST = Asked("request", "api.test", 8443, "POST", "/v1/things")


def _grant(asked: Asked = HOST, note: str | None = "for CI") -> Grant:
    return Grant(id="gr_1", approval="ap_1", scope="always", policy="agent", sandbox=None,
                 asked=asked, by="alice", note=note, created=0.0, expires=None)


FILES = {
    "block": "version: v1\nname: agent\negress:\n  - host: a.test\n    methods: [GET]\n",
    "block then a key": "version: v1\nname: agent\negress:\n  - host: a.test\n\n"
                        "budgets: []\n",
    "indented less": "version: v1\nname: agent\negress:\n- host: a.test\n- host: b.test\n",
    "egress first": "egress:\n  - host: a.test\nversion: v1\nname: agent\n",
    "comments inside": "version: v1\nname: agent\negress:\n  # the API\n  - host: a.test\n"
                       "  # more\n",
    "empty list": "version: v1\nname: agent\negress: []\n",
    "empty": "version: v1\nname: agent\negress:\n",
    "no egress": "version: v1\nname: agent\n",
    "no final newline": "version: v1\nname: agent\negress:\n  - host: a.test",
}


@pytest.mark.parametrize("text", FILES.values(), ids=list(FILES))
@pytest.mark.parametrize("asked", [HOST, REQUEST], ids=["host", "request"])
def test_the_rule_goes_in_and_allows_what_was_granted(text: str, asked: Asked) -> None:
    after = with_rule(text, _grant(asked))
    policy = load_policy_texts({"policies/agent.yaml": after}).policies["agent"]
    method = asked.method
    decision = decide(policy, Request(method, "https", asked.host, asked.port,
                                      asked.path + "?x=1" if asked.path else None))
    assert decision.allowed, after
    before = load_policy_texts({"policies/agent.yaml": text}).policies["agent"]
    assert len(policy.rules) == len(before.rules) + 1  # (nothing else changed)
    assert "granted by alice (approval ap_1, gr_1): for CI" in after


def test_a_request_grant_is_exactly_that_request() -> None:
    policy = load_policy_texts({"policies/agent.yaml": with_rule(
        FILES["empty"], _grant(REQUEST))}).policies["agent"]
    for method, path in (("GET", "/v1/things"), ("POST", "/v1/things/x")):
        assert not decide(policy, Request(method, "https", "api.test", 8443, path)).allowed


def test_a_note_cannot_break_out_of_its_comment() -> None:
    snippet = rule_snippet(_grant(note="x\n- host: evil.test"))
    assert snippet.count("\n") == 3 and "evil.test" in snippet.splitlines()[0]


def _git(directory: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(directory), *args], check=True,
                          capture_output=True, text=True).stdout


def test_in_a_git_checkout_a_branch_carries_the_change(tmp_path: Path) -> None:
    pdir = tmp_path / "repo" / "policies"
    pdir.mkdir(parents=True)
    (pdir / "agent.yaml").write_text(FILES["block"])
    _git(tmp_path / "repo", "init", "-q")
    _git(tmp_path / "repo", "add", ".")
    _git(tmp_path / "repo", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (pdir / "agent.yaml").write_text(FILES["block"] + "# a local edit\n")  # not committed
    got = propose(pdir, "policies/agent.yaml", _grant(), tmp_path / "out")
    assert got.branch == "sandbox-gateway/grant-gr_1" and got.problem is None
    shown = _git(pdir, "show", f"{got.branch}:policies/agent.yaml")
    assert shown == with_rule(FILES["block"], _grant())  # (from HEAD, not the local edit)
    assert "# a local edit" in (pdir / "agent.yaml").read_text()
    assert _git(pdir, "status", "--porcelain") == " M policies/agent.yaml\n"
    assert "new.test" in got.patch.read_text() and got.patch.name == "gr_1.patch"
    again = propose(pdir, "policies/agent.yaml", _grant(), tmp_path / "out")
    assert again.branch is None and again.problem is not None  # (the branch exists)


def test_outside_git_only_the_patch(tmp_path: Path) -> None:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(FILES["empty"])
    got = propose(tmp_path / "policies", "policies/agent.yaml", _grant(), tmp_path / "out")
    assert got.branch is None and got.problem is None
    assert got.patch.read_text().startswith("--- a/agent.yaml\n+++ b/agent.yaml\n")
