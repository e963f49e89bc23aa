"""The record of issued tokens (`identity/issued.py`): what the admin API and the CLI
record when they issue a token (never the token), `GET /v1/tokens` listing the live
ones with their revocation, a store that cannot record not failing the mint."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from gateway.api.admin import AdminContext, build_admin_app
from gateway.cli import main
from gateway.observability import metrics
from gateway.services.identity.issued import KIND, Issued, IssuedTokens
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import MemoryState, StateUnavailable
from gateway.services.state.sqlite import SqliteState

ADMIN = "admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
POLICY = "version: v1\nname: agent\negress: []\n"


class _Ready:
    def ready(self) -> tuple[bool, str]:
        return True, "ready"

    def degraded(self) -> list[str]:
        return []


class Broken(MemoryState):
    """A store whose records cannot be written (an outage)."""

    async def record_put(self, kind: str, key: str, doc: dict[str, Any], expires_at: float,
                         rev: int | None) -> bool:
        raise StateUnavailable("the state file cannot be written (disk I/O error)")


def admin(tmp_path: Path, state: MemoryState) -> TestClient:
    policies = load_policy_texts({"agent.yaml": POLICY})
    tokens = TokenService(SigningKeys.load(tmp_path / "keys"), state,
                          lambda name: [] if name == "agent" else None)
    return TestClient(build_admin_app(AdminContext(
        admin_token=ADMIN, tokens=tokens, policies=lambda: policies, readiness=_Ready())))


def test_minted_tokens_are_listed_with_their_revocation(tmp_path: Path) -> None:
    state = MemoryState()
    client = admin(tmp_path, state)
    assert client.get("/v1/tokens").status_code == 401
    first = client.post("/v1/tokens", headers=AUTH,
                        json={"sandbox": "sb-1", "policy": "agent", "ttl": "10m"}).json()
    second = client.post("/v1/tokens", headers=AUTH,
                         json={"sandbox": "sb-2", "policy": "agent"}).json()
    listed = client.get("/v1/tokens", headers=AUTH)
    assert listed.status_code == 200
    assert "eyJ" not in listed.text and first["token"] not in listed.text
    tokens = {t["jti"]: t for t in listed.json()["tokens"]}
    assert set(tokens) == {first["jti"], second["jti"]}
    one = tokens[first["jti"]]
    assert (one["sandbox"], one["policy"], one["kind"], one["revoked"]) == (
        "sb-1", "agent", "mint", False)
    assert one["expires_at"] == first["expires_at"]
    assert one["expires_at"] - one["issued_at"] == pytest.approx(600, abs=1)
    client.post("/v1/tokens/revoke", headers=AUTH, json={"jti": first["jti"]})
    after = {t["jti"]: t["revoked"] for t in client.get("/v1/tokens", headers=AUTH).json()[
        "tokens"]}
    assert after == {first["jti"]: True, second["jti"]: False}


def test_an_expired_token_is_no_longer_listed() -> None:
    now = [time.time()]
    state = MemoryState(clock=lambda: now[0])
    issued = IssuedTokens(state)
    token = Issued("j1", "sb", "agent", "", now[0], now[0] + 60, "mint", "j1")
    asyncio.run(state.record_put(KIND, "j1", token.to_doc(), token.expires_at, None))
    assert asyncio.run(issued.live()) == [token]
    now[0] += 61
    assert asyncio.run(issued.live()) == []


def test_a_store_outage_does_not_fail_the_mint(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    labels = {"op": "record_token"}
    before = metrics.REGISTRY.get_sample_value(
        "sandbox_gateway_state_store_errors_total", labels) or 0
    client = admin(tmp_path, Broken())
    minted = client.post("/v1/tokens", headers=AUTH, json={"sandbox": "sb", "policy": "agent"})
    assert minted.status_code == 200 and minted.json()["token"].startswith("eyJ")
    assert metrics.REGISTRY.get_sample_value(
        "sandbox_gateway_state_store_errors_total", labels) == before + 1
    assert "not recorded" in caplog.text and minted.json()["token"] not in caplog.text


class Away(MemoryState):
    """A store whose records cannot be written while `down`."""

    down = True

    async def record_put(self, kind: str, key: str, doc: dict[str, Any], expires_at: float,
                         rev: int | None) -> bool:
        if self.down:
            raise StateUnavailable("the state file cannot be written (disk full)")
        return await super().record_put(kind, key, doc, expires_at, rev)


def test_a_token_minted_while_the_store_is_away_is_recorded_when_it_is_back(
        tmp_path: Path) -> None:
    """Held in the process that minted it (listed by it meanwhile), written by the retry
    once the store takes writes: then every process lists it."""
    state = Away()
    policies = load_policy_texts({"agent.yaml": POLICY})
    tokens = TokenService(SigningKeys.load(tmp_path / "keys"), state,
                          lambda name: [] if name == "agent" else None)
    issued = IssuedTokens(state, tokens.revocations.is_revoked)
    client = TestClient(build_admin_app(AdminContext(
        admin_token=ADMIN, tokens=tokens, policies=lambda: policies, readiness=_Ready(),
        issued_tokens=issued)))
    minted = client.post("/v1/tokens", headers=AUTH, json={"sandbox": "sb", "policy": "agent"})
    assert minted.status_code == 200
    jti = minted.json()["jti"]
    assert issued.held == 1
    listed = client.get("/v1/tokens", headers=AUTH).json()["tokens"]
    assert [(t["jti"], t["revoked"]) for t in listed] == [(jti, False)]
    assert asyncio.run(IssuedTokens(state).live()) == []  # (another process: not yet)
    assert asyncio.run(issued.write_held()) == 1  # still away
    state.down = False
    assert asyncio.run(issued.write_held()) == 0
    assert [t.jti for t in asyncio.run(IssuedTokens(state).live())] == [jti]


def test_the_held_records_are_retried_every_second(tmp_path: Path) -> None:
    state = Away()
    tokens = TokenService(SigningKeys.load(tmp_path / "keys"), state,
                          lambda name: [] if name == "agent" else None)
    issued = IssuedTokens(state)

    async def scenario() -> None:
        await issued.record(tokens.mint("sb", "agent"), "mint")
        issued.start()
        try:
            state.down = False
            deadline = time.monotonic() + 3
            while issued.held and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert issued.held == 0 and len(await IssuedTokens(state).live()) == 1
        finally:
            await issued.stop()

    asyncio.run(scenario())


def test_cli_mint_records_in_the_state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for var in [v for v in os.environ if v.startswith("SANDBOX_GATEWAY_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
    SigningKeys.load(tmp_path / "certs" / "signing")
    assert main(["token", "mint", "--sandbox", "sb-cli", "--policy", "agent", "--json"]) == 0
    jti = capsys.readouterr().out.split('"jti": "')[1].split('"')[0]

    async def listed() -> list[Issued]:
        state = SqliteState(tmp_path / "state" / "gateway.db")
        await state.start()
        try:
            return await IssuedTokens(state).live()
        finally:
            await state.close()

    found = asyncio.run(listed())
    assert [(t.jti, t.sandbox, t.kind) for t in found] == [(jti, "sb-cli", "mint")]
    assert main(["token", "mint", "--sandbox", "sb-cli", "--policy", "agent", "--user",
                 "alice", "--json"]) == 0
    named = capsys.readouterr().out.split('"jti": "')[1].split('"')[0]
    assert [t.user for t in asyncio.run(listed()) if t.jti == named] == ["alice"]
    # A state file that cannot be opened: the token is printed all the same, with why
    # it is not listed.
    (tmp_path / "gateway.yaml").write_text("state: {store: sqlite, path: /dev/null/x.db}\n")
    assert main(["token", "mint", "--config", "gateway.yaml", "--sandbox", "sb-cli",
                 "--policy", "agent"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("eyJ") and "not listed" in err
