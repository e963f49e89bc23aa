"""The Redis state store against a real redis-server on 127.0.0.1 (no mocks).

Replicas are separate `RedisState` instances (and, at the end, separate gateway
processes) sharing one Redis: what one changes, the others must see.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import yaml
from helpers.clients import raw_connect
from helpers.redis_server import RedisServer, free_port, running_redis

from gateway.core.addresses import AddressPolicy
from gateway.net.resolver import install_backstop, new_event_loop, uninstall_backstop
from gateway.observability import metrics
from gateway.services.state.base import SandboxAddress
from gateway.services.state.redis import RedisState, StateUnavailable

PREFIX = "t"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path / "redis")


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    """Run on the gateway's own event loop class (the backstop lives there)."""
    asyncio.run(scenario(), loop_factory=new_event_loop)  # type: ignore[arg-type]


async def eventually(check: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.02)


def store(server: RedisServer, **kw: Any) -> RedisState:
    kw.setdefault("backoff", (0.05, 0.3))
    kw.setdefault("resync_interval", 300.0)  # propagation below must come from pub/sub
    return RedisState(server.url, prefix=PREFIX, **kw)


def up_gauge() -> float | None:
    return metrics.REGISTRY.get_sample_value("sandbox_gateway_state_store_up",
                                             {"store": "redis"})


def test_changes_propagate_between_replicas(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        a, b = store(redis_server), store(redis_server)
        await a.start()
        await b.start()
        try:
            assert a.healthy and b.healthy and up_gauge() == 1
            await a.revoke("jti-1", time.time() + 600)
            assert a.is_revoked("jti-1")  # applied locally at once
            await eventually(lambda: b.is_revoked("jti-1"), 1.0)
            assert not b.is_revoked("jti-2")

            entry = SandboxAddress(sandbox="sb-1", ip="10.1.2.3", policy="agent")
            await a.register_sandbox(entry)
            assert a.sandbox_for("10.1.2.3") == entry
            await eventually(lambda: b.sandbox_for("10.1.2.3") == entry, 1.0)
            assert b.sandboxes() == [entry]

            assert await b.unregister_sandbox("10.1.2.3") is True
            assert b.sandbox_for("10.1.2.3") is None
            await eventually(lambda: a.sandbox_for("10.1.2.3") is None, 1.0)
            assert await a.unregister_sandbox("10.1.2.3") is False

            # What Redis holds: a key expiring with the token, a hash of sandboxes.
            raw = aioredis.from_url(redis_server.url, decode_responses=True)
            try:
                ttl = await raw.ttl(f"{PREFIX}:revoked:jti-1")
                assert 590 < ttl <= 601
                await raw.hset(f"{PREFIX}:sandboxes", "10.9.9.9",
                               json.dumps({"sandbox": "late", "policy": "agent"}))
            finally:
                await raw.aclose()

            # A replica started later loads the current state at start().
            c = store(redis_server)
            await c.start()
            try:
                assert c.is_revoked("jti-1")
                assert c.sandbox_for("10.9.9.9") == SandboxAddress("late", "10.9.9.9", "agent")
            finally:
                await c.close()
        finally:
            await a.close()
            await b.close()

    run(scenario)


def test_revocations_expire_in_redis_and_in_the_mirror(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        a, b = store(redis_server), store(redis_server)
        await a.start()
        await b.start()
        raw = aioredis.from_url(redis_server.url, decode_responses=True)
        try:
            expires_at = math.floor(time.time()) + 2.0
            await a.revoke("short", expires_at)
            await a.revoke("long", time.time() + 600)
            await eventually(lambda: b.is_revoked("short") and b.is_revoked("long"), 1.0)
            assert await raw.exists(f"{PREFIX}:revoked:short") == 1
            await eventually(lambda: not b.is_revoked("short"), 3.5)
            assert not a.is_revoked("short")
            # Redis expires the key at the same second by its own clock: a few ms apart.
            deadline = time.monotonic() + 1.0
            while await raw.exists(f"{PREFIX}:revoked:short") and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert await raw.exists(f"{PREFIX}:revoked:short") == 0
            await eventually(lambda: "short" not in b.revoked_ids(), 1.5)  # pruned
            assert b.is_revoked("long") and a.is_revoked("long")
            # A revocation of an already expired token changes nothing anywhere.
            await a.revoke("past", time.time() - 5)
            assert not a.is_revoked("past")
            assert await raw.exists(f"{PREFIX}:revoked:past") == 0
        finally:
            await raw.aclose()
            await a.close()
            await b.close()

    run(scenario)


def test_periodic_resync_catches_changes_without_events(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        a = store(redis_server, resync_interval=0.3)
        await a.start()
        raw = aioredis.from_url(redis_server.url, decode_responses=True)
        try:
            # Written without publishing (as if the pub/sub message were lost).
            await raw.set(f"{PREFIX}:revoked:silent", "1", ex=600)
            await raw.hset(f"{PREFIX}:sandboxes", "10.0.0.7",
                           json.dumps({"sandbox": "quiet", "policy": "agent"}))
            await raw.hset(f"{PREFIX}:sandboxes", "10.0.0.8", "not json")
            await raw.publish(f"{PREFIX}:events", "garbage")  # ignored, counted
            await eventually(lambda: a.is_revoked("silent")
                             and a.sandbox_for("10.0.0.7") is not None, 2.0)
            assert a.sandbox_for("10.0.0.8") is None
            assert a.healthy
            # A key without expiry counts forever; deleted behind the store's back, it
            # is re-seeded (revocations only grow), still without expiry.
            await raw.set(f"{PREFIX}:revoked:forever", "1")
            await eventually(lambda: a.is_revoked("forever"), 2.0)
            await raw.delete(f"{PREFIX}:revoked:forever")
            await asyncio.sleep(0.7)
            assert a.is_revoked("forever")
            assert await raw.ttl(f"{PREFIX}:revoked:forever") == -1
            errors = metrics.REGISTRY.get_sample_value(
                "sandbox_gateway_state_store_errors_total", {"op": "decode"})
            assert errors is not None and errors >= 2
        finally:
            await raw.aclose()
            await a.close()

    run(scenario)


def test_redis_restart_reads_from_mirror_writes_fail_then_resync(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()

    async def scenario() -> None:
        s = store(server)
        await s.start()
        try:
            await s.revoke("before", time.time() + 600)
            before = SandboxAddress(sandbox="sb-old", ip="10.0.0.1", policy="agent")
            await s.register_sandbox(before)

            server.stop()  # no persistence: Redis comes back empty
            await eventually(lambda: not s.healthy, 3.0)
            assert up_gauge() == 0
            # Reads answer from the last mirror.
            assert s.is_revoked("before")
            assert s.sandbox_for("10.0.0.1") == before
            # Writes fail closed; a revocation still holds on this replica.
            with pytest.raises(StateUnavailable, match=r"unreachable.*retry"):
                await s.revoke("during", time.time() + 600)
            assert s.is_revoked("during")
            new = SandboxAddress(sandbox="sb-new", ip="10.0.0.2", policy="agent")
            with pytest.raises(StateUnavailable, match=r"10\.0\.0\.2 is not registered"):
                await s.register_sandbox(new)
            assert s.sandbox_for("10.0.0.2") is None
            with pytest.raises(StateUnavailable):
                await s.unregister_sandbox("10.0.0.1")

            # Same port; a password keeps the store out until another client has written
            # directly (no event: only a full re-sync can find these).
            password = "letmein"
            server.start_args = ["--requirepass", password]
            server.start()
            raw = aioredis.from_url(server.url, password=password, decode_responses=True)
            try:
                await raw.set(f"{PREFIX}:revoked:direct", "1", ex=600)
                await raw.hset(f"{PREFIX}:sandboxes", "10.0.0.3",
                               json.dumps({"sandbox": "sb-direct", "policy": "agent"}))
                await asyncio.sleep(0.3)
                assert not s.healthy and not s.is_revoked("direct")
                await raw.config_set("requirepass", "")
                await eventually(lambda: s.healthy, 3.0)
                assert up_gauge() == 1
                assert s.is_revoked("direct")
                assert s.sandbox_for("10.0.0.3") == SandboxAddress("sb-direct", "10.0.0.3",
                                                                   "agent")
                # Revocations Redis lost are re-seeded; sandboxes follow Redis.
                assert s.is_revoked("before") and s.is_revoked("during")
                assert await raw.exists(f"{PREFIX}:revoked:before",
                                        f"{PREFIX}:revoked:during") == 2
                assert s.sandbox_for("10.0.0.1") is None
                # Writes work again.
                await s.register_sandbox(new)
                assert await raw.hget(f"{PREFIX}:sandboxes", "10.0.0.2") is not None
            finally:
                await raw.aclose()
        finally:
            await s.close()

    try:
        run(scenario)
    finally:
        server.stop()


def test_start_fails_when_redis_is_unreachable() -> None:
    async def scenario() -> None:
        s = RedisState(f"redis://:hunter2@127.0.0.1:{free_port()}/0", start_timeout=0.3)
        with pytest.raises(StateUnavailable, match=r"cannot reach Redis at "
                           r"redis://:\*\*\*@127\.0\.0\.1:\d+/0") as info:
            await s.start()
        assert "hunter2" not in str(info.value)
        await s.close()  # harmless after a failed start

    run(scenario)


def test_store_connects_through_an_everywhere_backstop(redis_server: RedisServer) -> None:
    """Redis is an operator-configured endpoint: the store exempts its own connections
    from a backstop that refuses loopback for everyone else."""
    async def scenario() -> None:
        install_backstop(AddressPolicy(), everywhere=True)
        try:
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", redis_server.port)
            a, b = store(redis_server), store(redis_server)
            await a.start()
            await b.start()
            await a.revoke("guarded", time.time() + 60)
            await eventually(lambda: b.is_revoked("guarded"), 1.0)
            await a.close()
            await b.close()
        finally:
            uninstall_backstop()

    run(scenario)


# -- two gateway processes sharing one Redis ----------------------------------------------

POLICY = "version: v1\nname: agent\negress:\n  - host: allowed.test\n"
ADMIN_TOKEN = "test-admin-token-0123456789"


def _admin(port: int, method: str, path: str, body: dict[str, Any] | None = None
           ) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                 "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _wait_ready(proc: subprocess.Popen[bytes], port: int, logs: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"gateway exited {proc.returncode}:\n{logs.read_text()}")
        try:
            if _admin(port, "GET", "/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"gateway on admin port {port} not ready:\n{logs.read_text()}")


@pytest.mark.slow
def test_two_gateway_processes_share_revocations(tmp_path: Path,
                                                 redis_server: RedisServer) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "agent.yaml").write_text(POLICY)
    certs = tmp_path / "certs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOX_GATEWAY_")}
    ports: dict[str, tuple[int, int]] = {}
    configs: dict[str, Path] = {}
    for name in ("a", "b"):
        ports[name] = (free_port(), free_port())
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump({
            "listen": {"proxy": f"127.0.0.1:{ports[name][0]}",
                       "admin": f"127.0.0.1:{ports[name][1]}"},
            "policies": str(policies), "certs": str(certs), "admin_token": ADMIN_TOKEN,
            "state": {"store": "redis", "url": redis_server.url},
            "secrets": {"store": "env"},
            "audit": {"path": str(tmp_path / f"audit-{name}.jsonl")},
            "refusals": {"inside_tls": False},  # (a revoked token read at the CONNECT)
        }))
    gateway = [sys.executable, "-m", "gateway"]
    # One CA and one signing key for both, created before either starts.
    subprocess.run([*gateway, "ca", "init", "--dir", str(certs)], env=env, check=True,
                   capture_output=True, timeout=30)
    subprocess.run([*gateway, "token", "mint", "--config", str(configs["a"]), "--sandbox",
                    "s", "--policy", "agent", "--json", "--init"], env=env, check=True,
                   capture_output=True, timeout=30)

    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tmp_path / f"gateway-{name}.log" for name in configs}
    try:
        for name, config in configs.items():
            with logs[name].open("wb") as out:
                procs[name] = subprocess.Popen([*gateway, "run", "--config", str(config)],
                                               env=env, stdout=out, stderr=subprocess.STDOUT)
        for name, proc in procs.items():
            _wait_ready(proc, ports[name][1], logs[name])

        status, minted = _admin(ports["a"][1], "POST", "/v1/tokens",
                                {"sandbox": "s", "policy": "agent"})
        assert status == 200, minted
        proxy_b = ("127.0.0.1", ports["b"][0])
        status, _, body = raw_connect(proxy_b, "refused.test:443", minted["token"], "s")
        assert status == 403, body  # B accepts A's token; the policy refuses the host

        status, revoked = _admin(ports["a"][1], "POST", "/v1/tokens/revoke",
                                 {"jti": minted["jti"]})
        assert status == 200, revoked
        deadline = time.monotonic() + 2.0
        while True:
            status, headers, body = raw_connect(proxy_b, "refused.test:443",
                                                minted["token"], "s")
            if status == 407 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 407, body
        assert body is not None and body["error"] == "token_revoked"
        assert headers["x-sandbox-gateway-error"] == "token_revoked"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes[name] = None
    assert codes == {"a": 0, "b": 0}, {n: logs[n].read_text() for n in logs}


def test_a_redis_that_does_not_answer_is_named_with_the_timeout(
        redis_server: RedisServer) -> None:
    """An operation Redis does not answer within `op_timeout` (the server stopped) says
    so with the error's name: a timeout's message is empty (it read "did not answer: ",
    nothing after it)."""
    async def scenario() -> None:
        state = store(redis_server, op_timeout=0.3)
        await state.start()
        assert redis_server.process is not None
        os.kill(redis_server.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StateUnavailable, match=r"did not answer: TimeoutError$"):
                await state.read_mint("m")
        finally:
            os.kill(redis_server.process.pid, signal.SIGCONT)
            await state.close()

    run(scenario)
