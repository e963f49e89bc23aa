"""The console's sandboxes page (`/console/sandboxes`): the live tokens issued through the
admin API with Revoke (CSRF-checked, the same revocation as the API), registered
sandboxes with Unregister, the policies with the set's revision; on the memory store and
on a real SQLite state file."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.console import ADMIN, assert_no_secrets, console, csrf_of, sign_in
from starlette.testclient import TestClient

from gateway.api.context import AdminContext
from gateway.core.identity import TokenRefused
from gateway.core.policy import PolicySet
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import MemoryState, SandboxAddress, StateUnavailable
from gateway.services.state.sqlite import SqliteState

AUTH = {"Authorization": f"Bearer {ADMIN}"}
POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
  - host: pypi.org
credentials:
  openai: {preset: openai, secret: k1}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 1000}
"""

World = tuple[TestClient, AdminContext]


def policies() -> PolicySet:
    return load_policy_texts({"agent.yaml": POLICY})


@pytest.fixture(params=["memory", "sqlite"])
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[World]:
    state: Any = MemoryState() if request.param == "memory" else \
        SqliteState(tmp_path / "state.db")
    client, ctx = console(state, policies(), tmp_path / "keys", time.time)
    with client:
        if request.param == "sqlite":
            client.portal.call(state.start)
        sign_in(client)
        yield client, ctx
        if request.param == "sqlite":
            client.portal.call(state.close)


def mint(client: TestClient, sandbox: str) -> dict[str, Any]:
    answer = client.post("/v1/tokens", headers=AUTH, json={"sandbox": sandbox,
                                                           "policy": "agent"})
    assert answer.status_code == 200
    found: dict[str, Any] = answer.json()
    return found


def test_live_tokens_are_listed_and_revoked(world: World) -> None:
    client, ctx = world
    one, two = mint(client, "sb-1"), mint(client, "sb-2")
    page = client.get("/console/sandboxes")
    assert page.status_code == 200 and 'aria-current="page">Sandboxes<' in page.text
    assert_no_secrets(page.text, one["token"], two["token"])
    for minted, sandbox in ((one, "sb-1"), (two, "sb-2")):
        row = re.search(rf'<td class="id">{minted["jti"]}</td><td>{sandbox}</td>'
                        r"<td>agent.*?</tr>", page.text, re.S)
        assert row and "<td>mint</td>" in row.group(0) and "live" in row.group(0)
    action = f'/console/tokens/{one["jti"]}/revoke'
    assert action in page.text
    refused = client.post(action, data={})  # (no CSRF token)
    assert refused.status_code == 403 and not ctx.tokens.state.is_revoked(one["jti"])
    done = client.post(action, data={"csrf": csrf_of(page.text)})
    assert done.status_code == 303
    message = client.get(done.headers["location"]).text
    assert f"token {one['jti']} revoked" in message and "within a second" in message
    assert ctx.tokens.state.is_revoked(one["jti"])
    with pytest.raises(TokenRefused) as refusal:
        ctx.tokens.verify(one["token"])
    assert refusal.value.code == "token_revoked"
    after = client.get("/console/sandboxes").text
    assert after.count("<strong>revoked</strong>") == 1 and action not in after
    assert f'/console/tokens/{two["jti"]}/revoke' in after
    listed = {t["jti"]: t["revoked"] for t in client.get("/v1/tokens", headers=AUTH).json()[
        "tokens"]}
    assert listed == {one["jti"]: True, two["jti"]: False}


def test_registered_sandboxes_are_unregistered(world: World) -> None:
    client, ctx = world
    state = ctx.tokens.state
    client.portal.call(state.register_sandbox, SandboxAddress("box-4", "10.0.3.4", "agent"))
    client.portal.call(state.register_sandbox, SandboxAddress("box-6", "fd00::6", "agent"))
    page = client.get("/console/sandboxes").text
    assert "<td>box-4</td><td>10.0.3.4</td><td>agent</td>" in page
    action = "/console/sandboxes/fd00%3A%3A6/unregister"
    assert action in page
    assert client.post(action, data={"csrf": "x" * 43}).status_code == 403
    assert state.sandbox_for("fd00::6") is not None
    done = client.post(action, data={"csrf": csrf_of(page)})
    assert "unregistered" in client.get(done.headers["location"]).text
    assert state.sandbox_for("fd00::6") is None and state.sandbox_for("10.0.3.4") is not None
    again = client.post(action, data={"csrf": csrf_of(page)})
    assert "no sandbox is registered at fd00::6" in client.get(again.headers["location"]).text


def test_policies_show_their_revision(world: World) -> None:
    client, ctx = world
    page = client.get("/console/sandboxes").text
    current = ctx.policies()
    assert f"Revision <code>{current.revision}</code>" in page
    row = re.search(r"<tr><td>agent</td>.*?</tr>", page, re.S)
    assert row is not None
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(0), re.S)
    assert cells[1:5] == ["enforce", "agent.yaml", "2", "openai"]
    assert "daily" in cells[5] and "1000" in cells[5].replace(",", "")


class Down(MemoryState):
    """A store that cannot be reached."""

    async def record_list(self, kind: str) -> list[dict[str, Any]]:
        raise StateUnavailable("cannot reach Redis at redis://state:6379")

    async def revoke(self, jti: str, expires_at: float) -> None:
        raise StateUnavailable("cannot reach Redis at redis://state:6379")


def test_a_store_outage_is_said(tmp_path: Path) -> None:
    client, _ = console(Down(), policies(), tmp_path / "keys", time.time)
    with client:
        sign_in(client)
        page = client.get("/console/sandboxes")
        assert page.status_code == 503 and "cannot reach Redis" in page.text
        assert "Revision" in page.text  # (the rest of the page still shows)
        # Revoked all the same (this process holds it), and the page says the store waits.
        done = client.post("/console/tokens/abc123/revoke", data={"csrf": csrf_of(page.text)})
        said = client.get(done.headers["location"]).text
        assert "token abc123 revoked" in said and "cannot reach Redis" in said
        bad = client.post("/console/tokens/a%20b/revoke", data={"csrf": csrf_of(page.text)})
        assert "not a token id" in client.get(bad.headers["location"]).text
