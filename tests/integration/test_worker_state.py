"""Exact across workers, kept across restarts: `sandbox-gateway run` with two worker
processes on the default SQLite state file (issue 21), the official OpenAI SDK's
transport (httpx) against the local fake provider.

Measured on the journal store before: with two workers the call after a budget was used
up passed (it landed on the other worker), `GET /v1/usage` right after three calls
showed two, right after `POST /v1/tokens/revoke` 5 of 8 new requests and 5 of 6 open
keep-alive tunnels still passed; a restart forgot revocations, budgets and registered
sandboxes.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path
from typing import Any

import httpx
from fakes.inference import FakeInference
from helpers.clients import ended_within, open_tunnel
from helpers.process import GatewayProcess, start_with_provider
from helpers.tls import LocalCA

KEY = "sk-fake-provider-key"
POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
budgets:
  - {name: per-sandbox, per: sandbox, window: 24h, requests: 4}
credentials:
  openai: {preset: openai, secret: provider-key}
"""
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def _start(workdir: Path, fake: FakeInference, test_ca: LocalCA, workers: int = 2
           ) -> GatewayProcess:
    return start_with_provider(workdir, fake, test_ca, key=KEY, policy=POLICY,
                               workers=workers)


def _call(gw: GatewayProcess, sandbox: str, token: str) -> int:
    """One chat completion on a new connection (the kernel picks the worker)."""
    with httpx.Client(proxy=f"http://{sandbox}:{token}@127.0.0.1:{gw.proxy}", timeout=20,
                      verify=ssl.create_default_context(
                          cafile=str(gw.workdir / "certs" / "ca.crt"))) as http:
        try:
            return http.post("https://api.openai.com/v1/chat/completions", json=CHAT,
                             headers={"Authorization": f"Bearer {token}"}).status_code
        except httpx.ProxyError as exc:
            return int(str(exc).split()[0]) if str(exc)[:3].isdigit() else 407


# Seconds between calls that must be exact: each worker's record of its share of a
# budget's room follows the other's writes within ~10 ms (a coalesced refresh on the
# file's change, services/state/sqlite_counters.py); a call right behind another may still
# find the other worker's share held and be refused one call early, never admitted past
# the ceiling (docs/metering.md, "shares").
SETTLED = 0.1


def _calls(gw: GatewayProcess, sandbox: str, token: str, n: int) -> list[int]:
    """`n` calls one after another, `SETTLED` apart."""
    out = []
    for _ in range(n):
        out.append(_call(gw, sandbox, token))
        time.sleep(SETTLED)
    return out


async def _burst(gw: GatewayProcess, sandbox: str, token: str, n: int) -> list[int]:
    ctx = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))

    async def one() -> int:
        async with httpx.AsyncClient(proxy=f"http://{sandbox}:{token}@127.0.0.1:{gw.proxy}",
                                     timeout=30, verify=ctx) as http:
            answer = await http.post("https://api.openai.com/v1/chat/completions",
                                     json=CHAT, headers={"Authorization": f"Bearer {token}"})
            return answer.status_code

    return list(await asyncio.gather(*(one() for _ in range(n))))


def _workers_that_answered(gw: GatewayProcess, sandbox: str) -> set[int]:
    return {line.get("worker") for line in gw.audit_lines() if line.get("sandbox") == sandbox}


def _tunnel(gw: GatewayProcess, sandbox: str, token: str) -> ssl.SSLSocket:
    sock = open_tunnel(("127.0.0.1", gw.proxy), "api.openai.com:443", token, sandbox, timeout=5)
    ctx = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))
    return ctx.wrap_socket(sock, server_hostname="api.openai.com")


def test_two_workers_agree_exactly(tmp_path: Path, fake: FakeInference,
                                   test_ca: LocalCA) -> None:
    gw = _start(tmp_path / "gw", fake, test_ca)
    try:
        # A budget of 4 requests, one call at a time on new connections: exactly 4.
        token, _ = gw.mint("sbx-seq")
        answers = _calls(gw, "sbx-seq", token, 8)
        assert answers == [200] * 4 + [429] * 4, answers
        # Both workers took part (the kernel spreads connections at random: a few more
        # calls, all refused, until the audit lines show both).
        for _ in range(30):
            if _workers_that_answered(gw, "sbx-seq") == {0, 1}:
                break
            assert _call(gw, "sbx-seq", token) == 429
            time.sleep(0.05)
        assert _workers_that_answered(gw, "sbx-seq") == {0, 1}
        # Ten at once on ten connections: never more than 4 reach the provider (a worker
        # may have refused while the other's share was held: at most its 1/2 of the
        # room), and calls after them are admitted up to exactly 4, then refused.
        token, _ = gw.mint("sbx-burst")
        burst = asyncio.run(_burst(gw, "sbx-burst", token, 10))
        assert 2 <= burst.count(200) <= 4 and burst.count(200) + burst.count(429) == 10, burst
        rest = _calls(gw, "sbx-burst", token, 4 - burst.count(200) + 2)
        assert rest == [200] * (4 - burst.count(200)) + [429] * 2, (burst, rest)
        # /v1/usage right after three calls shows three, on whichever worker answers.
        token, _ = gw.mint("sbx-usage")
        assert [_call(gw, "sbx-usage", token) for _ in range(3)] == [200] * 3
        for _ in range(6):
            status, usage = gw.admin_call("GET", "/v1/usage?sandbox=sbx-usage")
            assert status == 200 and usage["totals"]["requests"] == 3, usage
        # A revocation holds on both workers before the admin API answers: new requests
        # refused at once, open keep-alive tunnels ended within a second.
        token, jti = gw.mint("sbx-revoke")
        tunnels = [_tunnel(gw, "sbx-revoke", token) for _ in range(6)]
        assert gw.admin_call("POST", "/v1/tokens/revoke", {"jti": jti})[0] == 200
        after = [_call(gw, "sbx-revoke", token) for _ in range(8)]
        assert after == [407] * 8, after
        assert all(ended_within(tls, 1.0) is not None for tls in tunnels)
        for tls in tunnels:
            tls.close()
    finally:
        gw.terminate()


def test_revocations_budgets_and_sandboxes_survive_a_restart(
        tmp_path: Path, fake: FakeInference, test_ca: LocalCA) -> None:
    workdir = tmp_path / "gw"
    gw = _start(workdir, fake, test_ca)
    try:
        revoked, jti = gw.mint("sbx-revoked")
        assert gw.admin_call("POST", "/v1/tokens/revoke", {"jti": jti})[0] == 200
        spent, _ = gw.mint("sbx-spent")
        assert _calls(gw, "sbx-spent", spent, 4) == [200] * 4
        status, _ = gw.admin_call("POST", "/v1/sandboxes",
                           {"id": "sbx-t", "ip": "10.9.8.7", "policy": "agent"})
        assert status == 200
    finally:
        assert gw.terminate() == 0
    assert (workdir / "state" / "gateway.db").exists()
    again = _start(workdir, fake, test_ca)
    try:
        assert _call(again, "sbx-revoked", revoked) == 407
        assert _call(again, "sbx-spent", spent) == 429
        status, listed = again.admin_call("GET", "/v1/sandboxes")
        assert {"id": "sbx-t", "ip": "10.9.8.7", "policy": "agent"} in listed["sandboxes"]
        status, usage = again.admin_call("GET", "/v1/usage?sandbox=sbx-spent")
        assert usage["totals"]["requests"] == 4
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(errors := {
                line["sandbox"]: line["error"] for line in again.audit_lines()
                if line.get("sandbox") in ("sbx-revoked", "sbx-spent")}) < 2:
            time.sleep(0.05)
        assert errors == {"sbx-revoked": "token_revoked", "sbx-spent": "budget_exceeded"}
    finally:
        again.stop()


MINTING = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    allow_minted_secrets: true
credentials:
  openai: {preset: openai, secret: provider-key}
"""


def test_an_alias_minted_on_one_worker_works_on_the_other(tmp_path: Path, fake: FakeInference,
                                                          test_ca: LocalCA) -> None:
    """A provider-minted secret's alias, given to the sandbox by one worker, is swapped
    for the secret by the other (the state file shares them), is a leak marker there,
    and is refused there for another sandbox."""
    gw = start_with_provider(tmp_path / "gw", fake, test_ca, key=KEY, policy=MINTING,
                             workers=2)
    ctx = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))

    def post(sandbox: str, token: str, path: str, auth: str, body: Any) -> httpx.Response:
        with httpx.Client(proxy=f"http://{sandbox}:{token}@127.0.0.1:{gw.proxy}",
                          timeout=20, verify=ctx) as http:  # (a new connection each)
            return http.post(f"https://api.openai.com{path}", json=body,
                             headers={"Authorization": f"Bearer {auth}"})

    def worker_of(sandbox: str, path: str, error: str | None = None) -> list[int]:
        return [line["worker"] for line in gw.audit_lines()
                if line.get("sandbox") == sandbox and line.get("path") == path
                and line.get("error") == error]

    try:
        token, _ = gw.mint("sbx-a")
        minted = post("sbx-a", token, "/v1/realtime/client_secrets", token,
                      {"session": {"type": "realtime", "model": "gpt-realtime"}})
        assert minted.status_code == 200, minted.text
        alias, [secret] = minted.json()["value"], fake.minted
        assert alias != secret and secret not in minted.text
        deadline = time.monotonic() + 5
        while not (minting := worker_of("sbx-a", "/v1/realtime/client_secrets")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # New connections until one lands on the other worker: each works.
        for _ in range(40):
            used = post("sbx-a", token, "/v1/responses", alias,
                        {"model": "gpt-4o-mini", "input": "hi"})
            assert used.status_code == 200, used.text
            assert fake.requests[-1].headers["authorization"] == f"Bearer {secret}"
            time.sleep(0.05)
            if set(worker_of("sbx-a", "/v1/responses")) - set(minting):
                break
        assert set(worker_of("sbx-a", "/v1/responses")) - set(minting), "one worker only"
        # On both workers: another sandbox's use refused, the alias in a body refused.
        other, _ = gw.mint("sbx-b")
        before = len(fake.requests)
        for _ in range(40):
            stolen = post("sbx-b", other, "/v1/responses", alias,
                          {"model": "gpt-4o-mini", "input": "hi"})
            leaked = post("sbx-a", token, "/v1/responses", token,
                          {"model": "gpt-4o-mini", "input": alias})
            for refused in (stolen, leaked):
                assert refused.status_code == 403 and "exfiltration_blocked" in refused.text
            time.sleep(0.05)
            if all({*worker_of(sandbox, "/v1/responses", "exfiltration_blocked")} == {0, 1}
                   for sandbox in ("sbx-a", "sbx-b")):
                break
        assert {*worker_of("sbx-b", "/v1/responses", "exfiltration_blocked")} == {0, 1}
        assert {*worker_of("sbx-a", "/v1/responses", "exfiltration_blocked")} == {0, 1}
        assert len(fake.requests) == before
    finally:
        gw.stop()
    audit = (gw.workdir / "audit.jsonl").read_text()
    assert secret not in audit and alias not in audit
