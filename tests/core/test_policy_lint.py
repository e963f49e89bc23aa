"""`outranked_credentials`: a host-wide credential rule beside a service preset whose
keyless rules name paths on the same host (the trap docs/policies.md warns of)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from gateway.cli import main as cli_main
from gateway.core.policy.lint import outranked_credentials
from gateway.services.policy.loader import load_policy_text

CREDENTIAL = ("credentials:\n  gh:\n    secret: pat\n    hosts: [github.com, api.github.com]\n"
              "    inject: {basic: x-access-token}\n")

CASES = [
    # (what, the policy's extends and egress, warned rule lines)
    ("host-wide beside github-write", "extends: [service/github-write]\negress:\n"
     "  - host: github.com\n    credential: gh\n", ["policies/p.yaml:5"]),
    ("paths named: tried with the preset's", "extends: [service/github-write]\negress:\n"
     "  - host: github.com\n    credential: gh\n    paths: ['/*/*/git-upload-pack']\n", []),
    ("another host than the preset's path rules", "extends: [service/pypi]\negress:\n"
     "  - host: github.com\n    credential: gh\n", []),
    ("no preset: the author's own keyless path rule is meant", "egress:\n"
     "  - host: github.com\n    paths: [/login]\n"
     "  - host: github.com\n    credential: gh\n", []),
]


@pytest.mark.parametrize(("what", "body", "warned"), CASES, ids=[c[0] for c in CASES])
def test_outranked_credentials(what: str, body: str, warned: list[str]) -> None:
    policy_set = load_policy_text("policies/p.yaml",
                                  f"version: v1\nname: p\n{body}{CREDENTIAL}")
    warnings = outranked_credentials(policy_set.policies["p"])
    assert [w.split(": warning:")[0] for w in warnings] == warned
    for warning in warnings:
        assert "service/github-write" in warning and "list the paths" in warning


def test_policy_check_prints_the_warning_and_passes(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("version: v1\nname: p\nextends: [service/github-write]\n"
                                     "egress:\n  - host: github.com\n    credential: gh\n"
                                     + CREDENTIAL)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["policy", "check", str(tmp_path)]) == 0
    assert err.getvalue().count("warning: credential 'gh' on github.com is host-wide") == 1
