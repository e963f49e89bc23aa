"""Degraded but never open: the state store goes away under `run --workers 2` (issue 46).

Real gateway processes (a supervisor and two workers), a real nginx behind passthrough
tunnels, the SQLite file on a real tiny tmpfs filled to its last block, or a real
redis-server stopped. Measured before: `POST /v1/tokens/revoke` answered `503
state_unavailable` and the revoked token still opened 5 of 10 new tunnels (SQLite; 2 of 6
with Redis) until the store came back, `/readyz` stayed 200 without a word of it, and a
token minted meanwhile was never listed.

Now a revocation goes to every worker through the supervisor's relay and is answered 200
once both hold it; no new tunnel of the revoked token opens on either worker, even after
both workers were killed and restarted (SQLite: the supervisor's copy; a worker cannot
start without Redis); its open tunnels end;
`/readyz` says `degraded: ["state store"]`; when the store is back the revocation and
the token minted meanwhile are in it (a fresh process sees them). With
`state.unavailable: refuse` new tunnels are refused `503 state_unavailable` meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.clients import ended_within, open_tunnel, raw_connect
from helpers.disk import fill, tiny_tmpfs
from helpers.nginx import Nginx
from helpers.process import GatewayProcess, start_gateway
from helpers.redis_server import RedisServer
from helpers.tls import LocalCA

from gateway.services.identity.issued import KIND
from gateway.services.state.base import StateStore
from gateway.services.state.redis import RedisState
from gateway.services.state.sqlite import SqliteState

pytestmark = pytest.mark.slow

TUNNELS = 12  # new tunnels tried with the revoked token (the issue measured 10)
NOTICED = 4.0  # seconds: every worker has noticed the outage (its probe, sqlite._PROBE + 1)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    yield from tiny_tmpfs(tmp_path / "disk", "2m")


def _connect(gw: GatewayProcess, token: str, sandbox: str) -> tuple[int, str | None]:
    """A new passthrough tunnel (the kernel picks the worker): its status and error."""
    status, _, body = raw_connect(("127.0.0.1", gw.proxy), "pass.test:443", token, sandbox)
    return status, (body or {}).get("error")


def _until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _all_answers(gw: GatewayProcess, check: Callable[[int, dict[str, Any]], bool],
                 n: int) -> bool:
    """`n` `/readyz` answers in a row pass `check` (whichever worker each reaches)."""
    for _ in range(n):
        status, body = gw.admin_call("GET", "/readyz")
        if not check(status, body):
            return False
    return True


def degraded(status: int, body: dict[str, Any]) -> bool:
    return status == 200 and body.get("degraded") == ["state store"]


def healthy(status: int, body: dict[str, Any]) -> bool:
    return status == 200 and "degraded" not in body


def _refused_everywhere(gw: GatewayProcess, token: str, sandbox: str, since: int
                        ) -> list[tuple[int, str | None]]:
    """At least `TUNNELS` new tunnels with `token`, and more until both workers have
    answered one (the kernel spreads them at random): every answer, and each worker's
    audit lines after line `since` name the revocation."""
    answers = [_connect(gw, token, sandbox) for _ in range(TUNNELS)]
    for _ in range(60):
        refused = {line.get("worker") for line in gw.audit_lines()[since:]
                   if line.get("sandbox") == sandbox and line.get("error") == "token_revoked"}
        if refused == {0, 1}:
            break
        answers.append(_connect(gw, token, sandbox))
        time.sleep(0.05)
    assert refused == {0, 1}, refused
    return answers


def _workers(gw: GatewayProcess) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(gw.proc.pid)], capture_output=True,
                          text=True).stdout.split()


def _restart_every_worker(gw: GatewayProcess) -> None:
    """SIGKILL each worker in turn, each restarted by the supervisor and serving before
    the next: afterwards no process that took or was relayed the revocation is left.
    (The supervisor removes `ready-<index>` before it starts a worker, which writes it
    once it serves.)"""
    runtime = gw.workdir / "runtime"
    for old in _workers(gw):
        os.kill(int(old), signal.SIGKILL)
        _until(lambda old=old: len(now := _workers(gw)) == 2 and old not in now, 20,
               "the supervisor did not restart the worker")
        _until(lambda: all((runtime / f"ready-{i}").exists() for i in (0, 1)), 30,
               "the restarted worker does not serve")


def _outage(gw: GatewayProcess, away: Callable[[], None], back: Callable[[], None],
            restart: bool) -> tuple[str, str, str]:
    """The scenario both stores share; (the revoked jti, the jti minted meanwhile, the
    jti of a token that kept working). `restart`: kill and restart both workers while
    the store is away (a worker cannot start without Redis: SQLite only)."""
    revoked, jti = gw.mint("sbx-revoked")
    kept, kept_jti = gw.mint("sbx-kept")
    assert _connect(gw, revoked, "sbx-revoked") == (200, None)
    tunnels = [open_tunnel(("127.0.0.1", gw.proxy), "pass.test:443", revoked, "sbx-revoked",
                           timeout=5) for _ in range(6)]
    try:
        away()
        _until(lambda: _all_answers(gw, degraded, 1), 15, "/readyz does not say degraded")
        time.sleep(NOTICED)  # (then both workers say so, whichever answers)
        assert _all_answers(gw, degraded, 20)
        status, body = gw.admin_call("GET", "/readyz")
        assert "degraded: state store" in body["reason"]

        since = len(gw.audit_lines())
        status, answer = gw.admin_call("POST", "/v1/tokens/revoke", {"jti": jti})
        assert status == 200, answer
        assert (answer["revoked"], answer["workers"], answer["stored"]) == (jti, 2, False)
        assert "pending" in answer
        answers = _refused_everywhere(gw, revoked, "sbx-revoked", since)
        assert answers == [(407, "token_revoked")] * len(answers)
        assert all(ended_within(sock, 1.5) is not None for sock in tunnels)
        assert _connect(gw, kept, "sbx-kept") == (200, None)  # (not a gateway refusing all)

        if restart:
            # Both workers killed and restarted while the store is away: the new ones
            # learn the revocation from the supervisor before they serve, and write it.
            _restart_every_worker(gw)
            since = len(gw.audit_lines())
            answers = _refused_everywhere(gw, revoked, "sbx-revoked", since)
            assert answers == [(407, "token_revoked")] * len(answers)
        # (held by the worker that minted it: one killed meanwhile would lose the record)
        _, minted_meanwhile = gw.mint("sbx-meanwhile")

        back()
        _until(lambda: _all_answers(gw, healthy, 20), 15, "/readyz still says degraded")
        # Recorded once the store is back: listed by every worker, revoked flag set.
        def listed() -> dict[str, bool]:
            status, body = gw.admin_call("GET", "/v1/tokens")
            return {t["jti"]: t["revoked"] for t in body["tokens"]} if status == 200 else {}

        _until(lambda: all(minted_meanwhile in listed() for _ in range(6)), 10,
               "the token minted meanwhile is not listed after the store came back")
        # (Redis without persistence came back empty: the records from before are gone)
        assert {j: r for j, r in listed().items() if j != minted_meanwhile} in (
            {jti: True, kept_jti: False}, {})
        assert listed()[minted_meanwhile] is False
        assert _connect(gw, revoked, "sbx-revoked") == (407, "token_revoked")
        return jti, minted_meanwhile, kept_jti
    finally:
        for sock in tunnels:
            sock.close()


async def _read_back(state: StateStore, jti: str, kept: str) -> tuple[bool, bool, set[str]]:
    """What a process started after the outage reads from the store: is `jti` revoked,
    is `kept`, and the jtis of the tokens it lists (`KIND` records)."""
    await state.start()
    try:
        return (state.is_revoked(jti), state.is_revoked(kept),
                {doc["jti"] for doc in await state.record_list(KIND)})
    finally:
        await state.close()


def test_a_full_state_disk_never_lets_a_revoked_token_through(
        tiny_disk: Path, tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    path = tiny_disk / "state" / "gateway.db"
    gw = start_gateway(tmp_path / "gw", {"pass.test": nginx.port}, test_ca, workers=2,
                       extra={"state": {"store": "sqlite", "path": str(path)},
                              "runtime_dir": str(tmp_path / "gw" / "runtime")})
    filler: list[Path] = []
    try:
        jti, meanwhile, kept = _outage(gw, lambda: filler.append(fill(tiny_disk)),
                                       lambda: filler.pop().unlink(), restart=True)
    finally:
        gw.terminate()
    # A fresh process reading the file: the revocation, the token minted meanwhile.
    is_revoked, kept_revoked, records = asyncio.run(_read_back(SqliteState(path), jti, kept))
    assert is_revoked and not kept_revoked
    assert {jti, meanwhile, kept} <= records


def test_redis_killed_never_lets_a_revoked_token_through(
        tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    gw = start_gateway(tmp_path / "gw", {"pass.test": nginx.port}, test_ca, workers=2,
                       extra={"state": {"store": "redis", "url": server.url}})
    try:
        def kill() -> None:  # (SIGKILL; no persistence: it comes back empty)
            assert server.process is not None
            server.process.kill()
            server.process.wait(5)
            server.process = None

        jti, meanwhile, kept = _outage(gw, kill, server.start, restart=False)
    finally:
        gw.terminate()
    try:
        is_revoked, kept_revoked, records = asyncio.run(
            _read_back(RedisState(server.url), jti, kept))
    finally:
        server.stop()
    assert is_revoked and not kept_revoked
    assert meanwhile in records


def test_refuse_turns_new_tunnels_away_while_the_store_is_away(
        tiny_disk: Path, tmp_path: Path, nginx: Nginx, test_ca: LocalCA) -> None:
    """`state.unavailable: refuse`: new tunnels `503 state_unavailable` and `/readyz`
    503 (the load balancer sends sandboxes elsewhere) until the store is back."""
    path = tiny_disk / "state" / "gateway.db"
    gw = start_gateway(tmp_path / "gw", {"pass.test": nginx.port}, test_ca, workers=2,
                       extra={"state": {"store": "sqlite", "path": str(path),
                                        "unavailable": "refuse"}})
    try:
        token, _ = gw.mint("sbx-1")
        assert _connect(gw, token, "sbx-1") == (200, None)
        filler = fill(tiny_disk)

        def refusing(status: int, body: dict[str, Any]) -> bool:
            return (status == 503 and body.get("degraded") == ["state store"]
                    and "state_unavailable" in body["reason"])

        _until(lambda: _all_answers(gw, refusing, 1), 15, "/readyz is not 503")
        time.sleep(NOTICED)  # (then both workers refuse, whichever answers)
        assert _all_answers(gw, refusing, 20)
        since = len(gw.audit_lines())
        answers = [_connect(gw, token, "sbx-1") for _ in range(TUNNELS)]
        assert answers == [(503, "state_unavailable")] * TUNNELS
        for _ in range(60):  # (more until both workers have answered one)
            if {line.get("worker") for line in gw.audit_lines()[since:]} == {0, 1}:
                break
            assert _connect(gw, token, "sbx-1") == (503, "state_unavailable")
        assert {line.get("worker") for line in gw.audit_lines()[since:]
                if line.get("error") == "state_unavailable"} == {0, 1}
        filler.unlink()
        _until(lambda: _all_answers(gw, healthy, 20), 15, "/readyz is still 503")
        assert [_connect(gw, token, "sbx-1") for _ in range(4)] == [(200, None)] * 4
    finally:
        gw.terminate()
