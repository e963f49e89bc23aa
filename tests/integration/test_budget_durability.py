"""Nothing settled is lost (issue 39, item 6): a gateway process SIGKILLed at any moment
never leaves a budget charged less than its calls used, on the SQLite state file and on
Redis, with one process or with `run --workers 2` (one worker killed: the supervisor
restarts it).

A real `sandbox-gateway run`, a token budget, the fake provider billing a known usage
over a streamed chat completion; the process serving the call is killed (SIGKILL) the
moment the call's last byte reached the client, or while it streams; the gateway is
started again on the same state (same file, same Redis, same proxy port: the same
slot). The budget (`GET /v1/usage`) then shows the call charged once: what it used, or
its reservation (an upper bound of it) when the settlement never reached the store -
never nothing, never both.

Measured before the leases (`state/leases.py`): a kill right after the last byte left
0 used on SQLite (the settlement waited in the 0.25 s batch; the reservation stayed
"reserved" until the window ended).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import ssl
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_client
from fakes.inference import FakeInference
from helpers.clients import open_tunnel
from helpers.process import ADMIN, GatewayProcess, start_with_provider
from helpers.redis_server import RedisServer, running_redis
from helpers.tls import LocalCA

KEY = "sk-fake-provider-key"
POLICY = """
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 1000000}
credentials:
  openai: {preset: openai, secret: provider-key}
"""
OUTPUT = 250  # the output tokens the fake bills (within the call's max_tokens)
BODY = json.dumps({"model": "gpt-4o-mini", "stream": True, "max_tokens": 300,
                   "stream_options": {"include_usage": True},
                   "messages": [{"role": "user", "content": "Say three words."}]}).encode()
SANDBOX = "sbx-durable"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeInference]:
    """The provider: a streamed answer of eight events, 0.3 s apart (time to kill a
    process mid-stream), billing 250 output tokens."""
    with FakeInference(tmp_path / "fake", api_key=KEY, interval=0.3,
                       output_tokens=OUTPUT) as server:
        yield server


def _admin(gw: GatewayProcess, path: str, body: Any = None) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{gw.admin}{path}", method="POST" if body is not None else "GET",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=15) as answer:
        return json.loads(answer.read())


def _budget(gw: GatewayProcess) -> tuple[int, int]:
    """(used, reserved) tokens of the daily budget for the sandbox."""
    found = _admin(gw, f"/v1/usage?sandbox={SANDBOX}&policy=agent")["budgets"]
    daily = next(b for b in found if b["budget"] == "daily")
    return int(daily["used"]["tokens"]), int(daily["reserved"]["tokens"])


def _token(gw: GatewayProcess) -> str:
    return str(_admin(gw, "/v1/tokens", {"sandbox": SANDBOX, "policy": "agent",
                                         "ttl": "2h"})["token"])


class Call:
    """A streamed chat completion through the proxy, read as it comes."""

    def __init__(self, gw: GatewayProcess, token: str) -> None:
        self.sock = open_tunnel(("127.0.0.1", gw.proxy), "api.openai.com:443", token,
                                SANDBOX, timeout=20)
        ctx = ssl.create_default_context(cafile=str(gw.workdir / "certs" / "ca.crt"))
        self.tls = ctx.wrap_socket(self.sock, server_hostname="api.openai.com")
        self.tls.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\n"
                         b"Authorization: Bearer " + token.encode() + b"\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
        self.reader = self.tls.makefile("rb")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            head += self.reader.readline()
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"transfer-encoding: chunked" in head.lower(), head
        self.data = b""

    def chunk(self) -> bool:
        """Read one chunk of the body; False once the last one (the 0-size) came."""
        size = int(self.reader.readline().split(b";")[0], 16)
        if size == 0:
            assert self.reader.readline() == b"\r\n"
            return False
        self.data += self.reader.read(size + 2)[:-2]
        return True

    def used(self) -> int:
        """The usage the provider billed, from the stream's usage event."""
        for line in self.data.split(b"\n"):
            if line.startswith(b"data: {") and b'"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
                return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
        raise AssertionError(f"no usage in {self.data[-400:]!r}")

    def close(self) -> None:
        self.reader.close()
        self.tls.close()


def _serving_pid(gw: GatewayProcess, call: Call) -> int:
    """The gateway process holding the call's client connection: the gateway itself,
    or (with workers) the worker whose descriptors include the accepted socket."""
    children = Path(f"/proc/{gw.proc.pid}/task/{gw.proc.pid}/children").read_text().split()
    if not children:
        return gw.proc.pid
    client_port = call.tls.getsockname()[1]
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == gw.proxy and \
                int(remote.split(":")[1], 16) == client_port:
            inodes.add(f"socket:[{fields[9]}]")
    for pid in children:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return int(pid)
            except OSError:
                continue
    raise AssertionError(f"no worker holds the connection from port {client_port}")


def _ready_file(gw: GatewayProcess, worker: int) -> Path:
    """The file the worker process `worker` touched once it served (``ready-<index>``)."""
    args = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
    return gw.workdir / "runtime" / f"ready-{int(args[args.index(b'--worker-index') + 1])}"


def _replaced(ready: Path, killed_ns: int, timeout: float = 60.0) -> None:
    """Wait until the supervisor's replacement for a killed worker serves: it touches
    `ready` once it does (the supervisor removes the old file before it starts it).
    Until then the replacement's admin socket, already listening, holds connections
    unanswered: under load for longer than an admin call waits."""
    deadline = time.monotonic() + timeout
    while not (ready.exists() and ready.stat().st_mtime_ns > killed_ns):
        assert time.monotonic() < deadline, "the killed worker was not replaced"
        time.sleep(0.1)


def _settled(gw: GatewayProcess, timeout: float = 30.0) -> tuple[int, int]:
    """(used, reserved) once nothing is reserved any more (a restarted worker comes
    back after the supervisor's backoff, then charges what its predecessor left)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            used, reserved = _budget(gw)
        except OSError:
            used, reserved = -1, -1
        if reserved == 0 or time.monotonic() > deadline:
            return used, reserved
        time.sleep(0.2)


def _leases(workdir: Path, redis: RedisServer | None) -> dict[str, float]:
    """Each live lease's holder and what its last renewal set: the expiry (SQLite), the
    key's time to live in ms (Redis; a renewal sets it back to the whole TTL)."""
    if redis is None:
        uri = f"file:{workdir / 'state' / 'gateway.db'}?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=10)) as db:
            return {h: float(e) for h, e in db.execute("SELECT holder, expires_at FROM leases")}
    with contextlib.closing(redis_client.Redis.from_url(redis.url)) as client:
        keys = [k.decode() for k in client.scan_iter("durable:lease:*")]
        return {k: float(client.pttl(k)) for k in keys}


def _beaten(workdir: Path, redis: RedisServer | None, timeout: float = 20.0) -> None:
    """Wait until both workers beat once more (`leases.BEAT`, 5 s): each renewed its
    lease since now, then looked for dead holders (a moment after the renewal: 0.5 s
    more for that look to be written)."""
    before = _leases(workdir, redis)
    deadline = time.monotonic() + timeout
    while True:
        now = _leases(workdir, redis)  # (a later expiry; a time to live set back up)
        renewed = {h for h, value in now.items() if value > before.get(h, float("inf"))}
        if len(renewed) >= 2:
            time.sleep(0.5)
            return
        assert time.monotonic() < deadline, f"the workers' leases not renewed: {before} {now}"
        time.sleep(0.1)


def _start(workdir: Path, fake: FakeInference, ca: LocalCA, workers: int,
           redis: RedisServer | None, proxy: int | None = None) -> GatewayProcess:
    """A gateway; `proxy`: on that port again (a restart in the killed one's slot, which
    the proxy address names). The port is free again once the killed process is gone,
    but another test's outgoing connection may hold it as its local port for a moment
    (it is in the ephemeral range): tried again then, for up to 10 s."""
    extra: dict[str, Any] = {"runtime_dir": str(workdir / "runtime")}  # (ready-<index>)
    if redis is not None:
        extra["state"] = {"store": "redis", "url": redis.url, "prefix": "durable"}
    deadline = time.monotonic() + 10
    while True:
        try:
            return start_with_provider(workdir, fake, ca, key=KEY, policy=POLICY,
                                       workers=workers, extra=extra, proxy=proxy)
        except RuntimeError as exc:
            if proxy is None or "Address already in use" not in str(exc) \
                    or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer | None]:
    if request.param == "sqlite":
        yield None
    else:
        yield from running_redis(tmp_path / "redis")


# (store, moment, workers): one process on each store at each moment; `run --workers 2`
# on each store once and at each moment once (10-13 s each: the supervisor's restart
# backoff, a beat of the dead-holder sweep); its other two with `make soak`
# (DURABILITY_VARIANTS=all).
VARIANTS = [(store, moment, 1) for store in ("sqlite", "redis")
            for moment in ("ended", "streaming")]
VARIANTS += [("sqlite", "ended", 2), ("redis", "streaming", 2)]
if os.environ.get("DURABILITY_VARIANTS") == "all":
    VARIANTS += [("sqlite", "streaming", 2), ("redis", "ended", 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("redis", "moment", "workers"), VARIANTS, indirect=["redis"],
                         ids=[f"{s}-{m}-{w}" for s, m, w in VARIANTS])
def test_a_killed_process_never_leaves_a_call_charged_less_than_it_used(
        tmp_path: Path, fake: FakeInference, test_ca: LocalCA, redis: RedisServer | None,
        workers: int, moment: str) -> None:
    workdir = tmp_path / "gw"
    gw = _start(workdir, fake, test_ca, workers, redis)
    port = gw.proxy
    try:
        token = _token(gw)
        call = Call(gw, token)
        assert call.chunk()  # (the first event: the call runs)
        used, reserved = _budget(gw)  # (the reservation is in the store already)
        assert used == 0 and reserved > OUTPUT, (used, reserved)
        if moment == "ended":
            fake.interval = 0.0  # (the spacing was for the reading above and a kill mid-stream)
            while call.chunk():
                pass
            billed = call.used()
            assert billed > OUTPUT and billed <= reserved
        else:
            billed = OUTPUT + 1  # (at least: the prompt is one word or more)
        victim = _serving_pid(gw, call)
        assert (victim == gw.proc.pid) == (workers == 1)
        ready = _ready_file(gw, victim) if workers == 2 else None
        killed_ns = time.time_ns()
        os.kill(victim, signal.SIGKILL)  # the moment the last byte came, or mid-stream
        call.close()
        fake.interval = 0.0
        if workers == 1:
            gw.proc.wait(10)
            gw.stop()
            gw = _start(workdir, fake, test_ca, workers, redis, proxy=port)
        else:  # the supervisor restarts the worker in its slot (after its backoff)
            assert ready is not None
            _replaced(ready, killed_ns)
        used, left = _settled(gw)
        # Charged what it used (its settlement was written) or its reservation (it was
        # not): never less than it used, never nothing, and once.
        assert left == 0, (used, left)
        expected = (billed, reserved) if moment == "ended" else (reserved,)
        assert used in expected and used >= billed, (used, billed, reserved)
        # Once: a later beat, and another restart in the slot, charge nothing more.
        if workers == 2:
            _beaten(workdir, redis)  # (each worker looks for dead holders at its beat)
        else:
            gw.proc.send_signal(signal.SIGKILL)
            gw.proc.wait(10)
            gw.stop()
            gw = _start(workdir, fake, test_ca, workers, redis, proxy=port)
        assert _budget(gw) == (used, 0)
        # The restarted gateway admits and settles as usual.
        again = Call(gw, token)
        while again.chunk():
            pass
        again.close()
        assert _settled(gw) == (used + again.used(), 0)
    finally:
        gw.proc.send_signal(signal.SIGTERM)
        try:
            gw.proc.wait(30)
        finally:
            gw.stop()

