"""The console's learn page (`/console/learn?policy=NAME`): the policy learned from the
request log's lines (a real SQLite log and the memory one), its replay proof and diffs,
read-only; without a request log or for an unknown policy it says why."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.console import console, sign_in
from starlette.testclient import TestClient

from gateway.services.policy import load_policy_dir
from gateway.services.state.base import MemoryState
from gateway.services.state.log import LogEntry
from gateway.services.state.sqlite import SqliteState

POLICY = """\
version: v1
name: agent
mode: learn
egress:
  - host: pypi.org
credentials:
  openai: {preset: openai, secret: k1}
"""


def _record(method: str, host: str, path: str, **extra: Any) -> dict[str, Any]:
    return {"sandbox": "s", "policy": "agent", "method": method, "scheme": "https",
            "host": host, "port": 443, "path": path, "decision": "report", "error": None,
            "engine": "h1", "credential": None, **extra}


RECORDS = [
    _record("GET", "api.internal.example", "/v1/items/17"),
    _record("POST", "api.openai.com", "/v1/chat/completions", credential="openai",
            models=["gpt-4o-mini"]),
    _record("GET", "github.com", "/octo/hello.git/info/refs"),
    _record("GET", "169.254.169.254", "/", decision="deny", error="forbidden_destination"),
]


@pytest.fixture(params=["memory", "sqlite"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TestClient]:
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
    policies = load_policy_dir(tmp_path / "policies")
    state: Any = MemoryState() if request.param == "memory" else \
        SqliteState(tmp_path / "state.db")
    client, _ = console(state, policies, tmp_path / "keys", time.time, request_log=state,
                        policies_dir=tmp_path / "policies")
    with client:
        if request.param == "sqlite":
            client.portal.call(state.start)
        client.portal.call(state.log_append, [LogEntry.of(r, 1.0 + i, json.dumps(r))
                                              for i, r in enumerate(RECORDS)])
        sign_in(client)
        yield client
        if request.param == "sqlite":
            client.portal.call(state.close)


def test_the_learned_policy_its_proof_and_diffs(client: TestClient) -> None:
    page = client.get("/console/learn", params={"policy": "agent"})
    assert page.status_code == 200, page.text
    assert 'aria-current="page">Learn<' in page.text
    assert "3 learned,\n1 refused" in page.text, page.text
    assert "extends: [service/github-read]" in page.text
    assert "host: api.internal.example" in page.text and "/v1/items/*" in page.text
    assert "credential: openai" in page.text and "models: [gpt-4o-mini]" in page.text
    assert "replay proof: 3 of 3 learned requests allowed" in page.text
    assert "Rule-level diff from the policies in force" in page.text
    assert "-mode: learn" in page.text  # the file diff
    assert "policy learn --from-state --policy agent --replay --propose" in page.text


@pytest.mark.parametrize(("query", "shown"), [
    ({}, "Learn</button>"),
    ({"policy": "nope"}, "No policy of that name is in force."),
    ({"policy": "agent/codex"}, "No policy of that name is in force."),
    ({"policy": "\x00<x>"}, "No policy of that name is in force."),
])
def test_without_a_policy_to_learn(client: TestClient, query: dict[str, str],
                                   shown: str) -> None:
    page = client.get("/console/learn", params=query)
    assert page.status_code == 200 and shown in page.text
    assert "replay proof" not in page.text and "<x>" not in page.text


def test_without_a_request_log(tmp_path: Path) -> None:
    client, _ = console(MemoryState(), load_policy_dir(_dir(tmp_path)), tmp_path / "keys",
                        time.time)
    with client:
        sign_in(client)
        page = client.get("/console/learn", params={"policy": "agent"})
    assert page.status_code == 200 and "The request log is off" in page.text


def test_signed_out_is_sent_to_sign_in(client: TestClient) -> None:
    client.cookies.clear()
    page = client.get("/console/learn", params={"policy": "agent"})
    assert page.status_code in (302, 303) and "/console/login" in page.headers["location"]


def _dir(tmp_path: Path) -> Path:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "agent.yaml").write_text(POLICY)
    return tmp_path / "p"
