"""The gate built from fakes (issue 22, item 3): every refusal code it or an exchange
gives, with its answer and its one audit line.

No engine, no socket, no token machinery: the ports (core/ports.py) are small fakes, the
policies are real (the parity table's policy). Each row drives the gate the way an
engine does and must produce exactly one new audit line (decision deny, the code, the
status) and an answer with the same status and code. The last test requires every
code the renderer knows to be in the table, or named with the test that covers it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from helpers.parity_cases import KEY, POLICY

from gateway.core.addresses import Pinned
from gateway.core.client import Client, Refused
from gateway.core.credentials import TOKEN_PREFIX
from gateway.core.identity import Identity, TokenRefused, Workload
from gateway.core.messages import Headers, RequestHead
from gateway.core.policy import PolicySet
from gateway.core.refusal import _CODES, ERROR_HEADER, Answer, Refusal, StateUnavailable, status_of
from gateway.core.secret_value import SecretValue
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.gate import INTERNAL_HOST, Gate
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import SandboxAddress

GOOD = f"{TOKEN_PREFIX}good.sig"
BOUND = f"{TOKEN_PREFIX}bound.sig"  # bound to 10.9.9.9/32
OTHER = f"{TOKEN_PREFIX}other.sig"  # another sandbox's token
TOKEN_CODES = ("token_expired", "token_revoked", "token_bad_signature", "token_bad_algorithm",
               "token_invalid", "token_lifetime_over", "token_not_yet_valid",
               "token_unknown_key", "token_wrong_audience", "token_wrong_issuer",
               "unknown_policy")
PEER = ("10.0.0.5", 40000)
STORE_DETAIL = "Redis at redis://192.0.2.44:6379 did not answer: Timeout"


def _identity(sandbox: str = "sandbox-1", cidr: tuple[str, ...] = ()) -> Identity:
    now = time.time()
    scope = dict.fromkeys(("openai", "metered", "mintfail", "budgeted", "minted", "sigv4"))
    return Identity(sandbox=sandbox, policy="agent", jti=f"jti-{sandbox}", scope=scope,
                    issued_at=now, expires_at=now + 900, lifetime_end=now + 3600, cidr=cidr)


@dataclass
class Minted:
    token: str
    jti: str
    expires_at: float


class Tokens:
    issuer = "sandbox-gateway"

    def verify(self, token: str) -> Identity:
        for code in TOKEN_CODES:
            if token == f"{TOKEN_PREFIX}{code}.sig":
                raise TokenRefused(code, f"the token is refused: {code}")
        if token == GOOD:
            return _identity()
        if token == BOUND:
            return _identity(cidr=("10.9.9.9/32",))
        if token == OTHER:
            return _identity("sandbox-2")
        raise TokenRefused("token_malformed", "not a gateway token")

    def refresh(self, identity: Identity, ttl: float | None = None) -> Minted:
        return Minted(GOOD, "jti-new", time.time() + (ttl or 900))


class Guard:
    """Addresses for names, for hosts the policy allows: the metadata address is
    forbidden, `noname.test` does not resolve, `unbound.test` breaks the guard, and
    `storeless.test` finds the state store away."""

    async def check(self, host: str, port: int) -> Pinned:
        if host == "169.254.169.254":
            raise Refusal("forbidden_destination", "169.254.169.254 is a link-local "
                          "(cloud metadata) address")
        if host == "noname.test":
            raise Refusal("unresolvable", "noname.test does not resolve")
        if host == "unbound.test":
            raise RuntimeError("the guard broke")
        if host == "storeless.test":  # (a port that needs the state store, which is away)
            raise StateUnavailable(STORE_DETAIL)
        return Pinned(host, port, "203.0.113.7")


class Secrets:
    def __init__(self) -> None:
        self.fetched: dict[str, SecretValue] = {}
        self.down = False  # the store fails

    async def get(self, name: str) -> SecretValue:
        if name == "openai-api-key" and not self.down:
            value = self.fetched[name] = SecretValue(KEY)
            return value
        raise LookupError(name)  # (the cache's SecretUnavailable has a reason; this none)

    def invalidate(self, name: str, rejected: SecretValue | None = None) -> None:
        self.fetched.pop(name, None)

    def known_items(self) -> list[tuple[str, SecretValue]]:
        return list(self.fetched.items())


class Registry:
    def __init__(self) -> None:
        self.by_ip: dict[str, SandboxAddress] = {}

    def sandbox_for(self, ip: str) -> SandboxAddress | None:
        return self.by_ip.get(ip)


class Health:
    refusing: str | None = None


class Pods:
    """The Workloads port: pods by address (`stale`: the watch cannot be trusted)."""

    def __init__(self, pods: dict[str, Identity | str], stale: str | None = None) -> None:
        self.pods = pods
        self.stale = stale

    def identity_for(self, ip: str) -> Identity:
        if self.stale is not None:
            raise Refusal("identity_unavailable", self.stale, retry_after=5)
        found = self.pods.get(ip, f"no pod in the watched namespaces has address {ip}")
        if isinstance(found, str):
            raise Refusal("identity_unknown", found)
        return found

    def gone(self, workload: Workload) -> str | None:
        return None


def _pod(account: str = "agent", policy: str = "agent") -> Identity:
    return Identity(sandbox="sb/pod-1", policy=policy, jti="pod:uid-1", scope={},
                    issued_at=0.0, expires_at=float("inf"), lifetime_end=float("inf"),
                    workload=Workload("sb", "pod-1", "uid-1", account), keyless=True)


def _pod_connect(pods: Pods) -> Callable[[World], Any]:
    def step(w: World) -> Any:
        w.gate.identities.workloads = pods
        return w.gate.connect(Client(PEER), "allowed.test:443", None)
    return step


@dataclass
class World:
    gate: Gate
    lines: list[dict[str, Any]]
    registry: Registry
    health: Health
    secrets: Secrets


@pytest.fixture(scope="module")
def policies() -> PolicySet:
    doc = yaml.safe_load(POLICY)  # the parity policy, and the sandbox-facing API
    doc["egress"] += [{"host": INTERNAL_HOST}, {"host": "storeless.test"}]
    return load_policy_texts({"policies/agent.yaml": yaml.safe_dump(doc)})


def _world(policies: PolicySet, **kw: Any) -> World:
    lines: list[dict[str, Any]] = []
    registry, health, secrets = Registry(), Health(), Secrets()

    async def resolve(host: str, port: int) -> list[str]:
        return ["203.0.113.7"]

    gate = Gate(tokens=Tokens(), policies=lambda: policies, guard=Guard(), secrets=secrets,
                registry=registry, audit=lines.append, resolve=resolve, audit_health=health,
                **kw)
    return World(gate, lines, registry, health, secrets)


def _head(method: str, target: str, *headers: tuple[str, str]) -> RequestHead:
    return RequestHead(method, target, Headers.of(*headers))


def _basic(user: str, token: str) -> str:
    import base64

    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def _run(w: World, step: Callable[[World], Any]) -> Answer:
    """Run one row's step; the answer it gives or the one its Refused carries."""
    try:
        got = step(w)
        if asyncio.iscoroutine(got):
            got = asyncio.run(got)
    except Refused as refused:
        return refused.answer
    assert isinstance(got, Answer), f"not refused: {got!r}"
    return got


async def _tunnel(w: World, host: str, *, token: str = GOOD) -> Client:
    client = Client(PEER)
    await w.gate.connect(client, f"{host}:443", _basic("sandbox-1", token))
    return client


async def _plain_again(w: World, proxy_authorization: str | None) -> Exchange | Answer:
    """A second plain proxy request on a kept-alive connection whose first one carried
    sandbox-1's credentials (and was let through)."""
    client = Client(PEER)
    first = await w.gate.begin(client, _head("GET", "http://allowed.test/1",
                                             ("Host", "allowed.test")),
                               tls=False, proxy_authorization=_basic("sandbox-1", GOOD))
    assert isinstance(first, Exchange), first
    del w.lines[:]
    return await w.gate.begin(client, _head("GET", "http://allowed.test/2",
                                            ("Host", "allowed.test")),
                              tls=False, proxy_authorization=proxy_authorization)


async def _request(w: World, host: str, head: RequestHead, *, tls: bool = True
                   ) -> Exchange | Answer:
    client = await _tunnel(w, host)
    del w.lines[:]  # (a tunnel to an inspected host writes no line until it closes)
    return await w.gate.begin(client, head, tls=tls)


async def _exchange(w: World, host: str, head: RequestHead) -> Exchange:
    got = await _request(w, host, head)
    assert isinstance(got, Exchange), got
    return got


def _second_connection(w: World) -> Any:
    w.gate.connections.per_sandbox = 1
    asyncio.run(_tunnel(w, "allowed.test"))
    del w.lines[:]
    return _tunnel(w, "allowed.test")


def _hello(sni: str | None, *, tls: bool) -> Callable[[World], Any]:
    def step(w: World) -> None:
        client = asyncio.run(_tunnel(w, "allowed.test"))
        w.gate.check_hello(client, sni, tls=tls)
    return step


def _transparent(kind: str, name: str | None, *, registered: bool = False,
                 resolves: bool = True) -> Callable[[World], Any]:
    async def step(w: World) -> None:
        if registered:
            w.registry.by_ip[PEER[0]] = SandboxAddress("sandbox-1", PEER[0], "agent")
        client = Client(PEER, listener="transparent")
        if registered:
            assert w.gate.identify_registered(client, ("203.0.113.9", 443))
        await w.gate.open_transparent(client, ("203.0.113.9" if not resolves else
                                               "203.0.113.7", 443), kind, name)
    return step


def _transparent_limit(w: World) -> None:
    w.registry.by_ip[PEER[0]] = SandboxAddress("sandbox-1", PEER[0], "agent")
    w.gate.connections.per_sandbox = 0
    w.gate.identify_registered(Client(PEER, listener="transparent"), ("203.0.113.7", 443))


def _audit_down(w: World) -> Any:
    w.health.refusing = "the audit file's disk is full"
    return _tunnel(w, "allowed.test")


def _state_down(w: World) -> Any:
    """`state.unavailable: refuse` while the state store is away (the port says why)."""
    down = Health()
    down.refusing = "the state file's disk is full"
    w.gate.state_health = down
    return _tunnel(w, "allowed.test")


def _at_capacity(w: World) -> None:
    w.gate.connections.limit = 0
    w.gate.opened(Client(PEER))


class _Full:
    refusing = "this worker holds 600 MiB of memory, above its ceiling limits.memory (512 MiB)"


def _memory_ceiling(w: World) -> None:
    w.gate.connections.capacity = _Full()
    w.gate.opened(Client(PEER))


async def _key_in_body(w: World) -> Answer:
    await _exchange(w, "api.openai.com", _head(  # the key is fetched: a marker off its hosts
        "POST", "/v1/chat/completions", ("Host", "api.openai.com"),
        ("Authorization", f"Bearer {GOOD}"), ("Content-Length", "99")))
    other = await _exchange(w, "other.test", _head("POST", "/api/x", ("Host", "other.test")))
    try:
        other.request_data(f'{{"stolen": "{KEY}"}}'.encode())
        other.request_end(None)
    except Refusal as refusal:
        return other.abort(refusal)
    raise AssertionError("the key went out")


async def _upstream(w: World, kind: str) -> Answer:
    ex = await _exchange(w, "allowed.test", _head("GET", "/", ("Host", "allowed.test")))
    if kind == "proxy":
        return ex.upstream_proxy_failed("the upstream proxy answered 403 to CONNECT "
                                        "203.0.113.7:443 (forbidden by the proxy's rules)")
    return ex.upstream_failed(kind, "timed out" if kind == "timeout" else "Connection refused")


async def _model(w: World) -> Answer:
    from gateway.services.metering import static_metering

    w.gate.metering = static_metering({})
    ex = await _exchange(w, "api.openai.com", _head(
        "POST", "/v1/chat/completions", ("Host", "api.openai.com"),
        ("Authorization", f"Bearer {GOOD}"), ("Content-Type", "application/json")))
    try:
        ex.request_whole(b'{"model": "gpt-5-huge", "messages": []}', None)
    except Refusal as refusal:
        return ex.abort(refusal)
    raise AssertionError("the model went through")


def _crash_in_engine(w: World) -> Answer:
    try:
        raise RuntimeError("an engine broke")
    except RuntimeError:
        return w.gate.failed(Client(PEER))


# (name, step, code, fields the audit line must have besides decision/error/status)
ROWS: list[tuple[str, Callable[[World], Any], str, dict[str, Any]]] = [
    ("past the process's connection cap", _at_capacity, "at_capacity", {}),
    ("above the process's memory ceiling", _memory_ceiling, "at_capacity", {}),
    ("CONNECT without proxy credentials",
     lambda w: w.gate.connect(Client(PEER), "allowed.test:443", None), "auth_required",
     {"method": "CONNECT", "sandbox": None}),
    ("proxy credentials in an unknown scheme",
     lambda w: w.gate.connect(Client(PEER), "allowed.test:443", "Digest abc"),
     "token_malformed", {"method": "CONNECT"}),
    ("not a token", lambda w: w.gate.connect(Client(PEER), "allowed.test:443",
                                             _basic("sandbox-1", "hunter2")),
     "token_malformed", {}),
    *[(f"a refused token: {code}",
       (lambda c: lambda w: _tunnel(w, "allowed.test", token=f"{TOKEN_PREFIX}{c}.sig"))(code),
       code, {"method": "CONNECT", "sandbox": None})
      for code in TOKEN_CODES],
    ("a pod address no running pod holds", _pod_connect(Pods({PEER[0]: "pod sb/p is "
                                                             "Pending, not Running"})),
     "identity_unknown", {"method": "CONNECT", "sandbox": None}),
    ("the pod watch is stale", _pod_connect(Pods({}, stale="the pod watch is broken")),
     "identity_unavailable", {"method": "CONNECT"}),
    ("a pod whose policy does not exist", _pod_connect(Pods({PEER[0]: _pod(policy="gone")})),
     "identity_unknown", {"sandbox": "sb/pod-1"}),
    ("the proxy username is another sandbox",
     lambda w: w.gate.connect(Client(PEER), "allowed.test:443", _basic("sandbox-9", GOOD)),
     "sandbox_mismatch", {}),
    ("a plain request after a first on its connection, without credentials",
     lambda w: _plain_again(w, None), "auth_required",
     {"method": "GET", "sandbox": "sandbox-1"}),
    ("a plain request after a first on its connection, another sandbox's token",
     lambda w: _plain_again(w, _basic("sandbox-2", OTHER)), "sandbox_mismatch",
     {"method": "GET", "sandbox": "sandbox-1"}),
    ("a token bound to another address", lambda w: _tunnel(w, "allowed.test", token=BOUND),
     "token_wrong_source", {}),
    ("a sandbox's connection limit", _second_connection, "too_many_connections", {}),
    ("a host no rule allows", lambda w: _tunnel(w, "denied.test"), "policy_denied",
     {"sandbox": "sandbox-1", "policy": "agent", "host": "denied.test"}),
    ("a CONNECT authority with user information",
     lambda w: w.gate.connect(Client(PEER), "u@allowed.test:443", _basic("sandbox-1", GOOD)),
     "bad_destination", {}),
    ("the guard refuses the address", lambda w: _tunnel(w, "169.254.169.254"),
     "forbidden_destination", {"host": "169.254.169.254"}),
    ("the name does not resolve", lambda w: _tunnel(w, "noname.test"), "unresolvable", {}),
    ("the audit trail cannot be written", _audit_down, "audit_unavailable", {}),
    ("the state store is away (state.unavailable: refuse)", _state_down,
     "state_unavailable", {}),
    ("a port finds the state store away", lambda w: _tunnel(w, "storeless.test"),
     "state_unavailable", {"method": "CONNECT", "host": "storeless.test"}),
    ("the gate fails while deciding", lambda w: _tunnel(w, "unbound.test"), "gateway_error",
     {"method": "CONNECT", "host": "unbound.test"}),
    ("non-TLS bytes in a passthrough tunnel", _hello(None, tls=False), "policy_denied", {}),
    ("a ClientHello for another name", _hello("other.test", tls=True), "host_mismatch",
     {"host": "allowed.test"}),
    ("transparent raw TCP from an unregistered source", _transparent("tcp", None),
     "unknown_sandbox", {"listener": "transparent"}),
    ("transparent HTTP without a Host", _transparent("http", None), "bad_destination", {}),
    ("transparent: a name paired with another address",
     _transparent("tls", "allowed.test", registered=True, resolves=False), "host_mismatch", {}),
    ("transparent: a registered sandbox's connection limit", _transparent_limit,
     "too_many_connections", {"host": "203.0.113.7"}),
    ("an upgrade to anything but WebSocket",
     lambda w: _request(w, "other.test", _head("GET", "/ok/", ("Host", "other.test"),
                                                ("Upgrade", "h2c"))),
     "unsupported", {"method": "GET", "path": "/ok/"}),
    ("a path no rule allows",
     lambda w: _request(w, "other.test", _head("GET", "/admin", ("Host", "other.test"))),
     "policy_denied", {"path": "/admin"}),
    ("a Host that is not the tunnel's",
     lambda w: _request(w, "other.test", _head("GET", "/ok/", ("Host", "allowed.test"))),
     "host_mismatch", {}),
    ("a gateway token sent to another host",
     lambda w: _request(w, "other.test", _head("GET", "/ok/", ("Host", "other.test"),
                                                ("X-Token", GOOD))),
     "exfiltration_blocked", {}),
    ("a credential call without the sandbox's token",
     lambda w: _request(w, "api.openai.com", _head("GET", "/v1/models",
                                                    ("Host", "api.openai.com"))),
     "credential_not_in_scope", {"host": "api.openai.com"}),
    ("a credential call with another sandbox's token",
     lambda w: _request(w, "api.openai.com", _head(
         "GET", "/v1/models", ("Host", "api.openai.com"), ("Authorization", f"Bearer {OTHER}"))),
     "credential_not_in_scope", {}),
    ("a key over cleartext (a plain proxy request)",
     lambda w: w.gate.begin(Client(PEER), _head(
         "GET", "http://api.openai.com/v1/models", ("Host", "api.openai.com"),
         ("Authorization", f"Bearer {GOOD}")), tls=False,
         proxy_authorization=_basic("sandbox-1", GOOD)),
     "credential_requires_tls", {"scheme": "http", "port": 80}),
    ("the secret cannot be fetched",
     lambda w: setattr(w.secrets, "down", True) or _request(w, "metered.test", _head(
         "GET", "/", ("Host", "metered.test"), ("Authorization", f"Bearer {GOOD}"))),
     "secret_unavailable", {"credential": "metered"}),
    ("a minted credential cannot be minted",
     lambda w: _request(w, "mintfail.test", _head(
         "GET", "/", ("Host", "mintfail.test"), ("Authorization", f"Bearer {GOOD}"))),
     "credential_unavailable", {"credential": "mintfail"}),
    ("a key in the body to a host it is not bound to", _key_in_body, "exfiltration_blocked",
     {"host": "other.test", "method": "POST"}),
    ("a model outside the allowlist", _model, "model_not_allowed",
     {"host": "api.openai.com"}),
    # (an upstream failure's line keeps the policy's decision, allow: the error says what)
    ("the upstream cannot be reached", lambda w: _upstream(w, "connect"), "upstream_failed",
     {"decision": "allow"}),
    ("the upstream says nothing", lambda w: _upstream(w, "timeout"), "upstream_timeout",
     {"decision": "allow"}),
    ("the upstream proxy refuses the CONNECT", lambda w: _upstream(w, "proxy"),
     "upstream_proxy_failed", {"decision": "allow", "error": "upstream_proxy_failed"}),
    ("the local API serves only the refresh",
     lambda w: _request(w, INTERNAL_HOST, _head("GET", "/", ("Host", INTERNAL_HOST))),
     "policy_denied", {"host": INTERNAL_HOST}),
    ("input an engine cannot parse",
     lambda w: w.gate.unparsable(Client(PEER), "not an HTTP/1.x request line"), "bad_request",
     {"reason": "not an HTTP/1.x request line"}),
    ("an engine's own failure", _crash_in_engine, "gateway_error", {}),
]
# Codes given where no gate call can reach them, and the tests that cover them there.
ELSEWHERE = {
    "secret_detected": "the parity rows DLP: ... (a detector set the gateway builds; "
                       "this fake world has none)",
    "budget_exceeded": "tests/services/metering/test_metering_budgets.py (live counters)",
    "metering_unavailable": "tests/services/metering/test_metering_fail_closed.py",
    "minted_secret_refused": "tests/services/metering/test_metering_service.py",
    "credential_required": "tests/core/test_core_minted.py (a credential that challenges)",
    "shutting_down": "tests/integration/test_shutdown.py (the doors end connections)",
    "mcp_denied": "tests/core/test_core_mcp.py (the calls) and the parity rows MCP: ... "
                  "(the table's unbound.test, which this fake guard breaks on purpose)",
    "mcp_tool_changed": "tests/core/test_core_mcp_pins.py (the calls) and the parity rows "
                        "MCP: ... pinned ... (the table's unbound.test)",
    "mcp_token_refused": "tests/integration/test_mcp_oauth.py (a sandbox's own token on a "
                         "rule with mcp.oauth, both engines) and the parity rows MCP OAuth",
    "mcp_consent_required": "tests/integration/test_mcp_oauth.py (insufficient_scope: the "
                            "server's 403 read in the answer, both engines) and the parity "
                            "rows MCP OAuth",
    "mcp_oauth_failed": "tests/integration/test_mcp_oauth.py (metadata naming another "
                        "resource, both engines) and the parity rows MCP OAuth",
    "mcp_user_required": "tests/integration/test_mcp_oauth.py (consent: user, a token "
                         "naming no user, both engines) and the parity rows MCP OAuth",
    "approval_denied": "tests/core/test_core_ask.py (the gate with a fake approvals port)",
    "approval_timeout": "tests/core/test_core_ask.py (the gate with a fake approvals port)",
}


@pytest.mark.parametrize(("name", "step", "code", "fields"), ROWS, ids=[r[0] for r in ROWS])
def test_every_refusal_is_answered_and_audited_once(
        policies: PolicySet, name: str, step: Callable[[World], Any], code: str,
        fields: dict[str, Any]) -> None:
    w = _world(policies)
    answer = _run(w, step)
    status = status_of(code)
    assert (answer.status, answer.headers.get(ERROR_HEADER)) == (status, code)
    assert len(w.lines) == 1, w.lines
    line = w.lines[0]
    decision = fields.get("decision", "deny")
    assert (line["decision"], line["error"], line["status"]) == (decision, code, status)
    assert {k: line[k] for k in fields} == fields
    assert KEY not in json.dumps(line) and GOOD not in json.dumps(line)
    assert KEY.encode() not in answer.body and GOOD.encode() not in answer.body


def test_the_store_s_own_words_stay_in_the_log(policies: PolicySet) -> None:
    """A store's error may name its address: the sandbox reads a fixed reason."""
    w = _world(policies)
    answer = _run(w, lambda w: _tunnel(w, "storeless.test"))
    assert answer.headers.get("Retry-After") == "5"
    assert b"state store" in answer.body and b"192.0.2.44" not in answer.body
    assert "192.0.2.44" not in json.dumps(w.lines)


def test_every_code_is_in_the_table_or_covered_elsewhere() -> None:
    codes = {row[2] for row in ROWS}
    assert set(_CODES) - codes == set(ELSEWHERE), set(_CODES) - codes - set(ELSEWHERE)
    assert set(TOKEN_CODES) <= codes


def test_the_refresh_is_answered_and_audited_as_allowed(policies: PolicySet) -> None:
    w = _world(policies)
    got = asyncio.run(_request(w, INTERNAL_HOST, _head(
        "POST", "/v1/tokens/refresh?ttl=5m", ("Host", INTERNAL_HOST))))
    assert isinstance(got, Answer) and got.status == 200
    assert json.loads(got.body)["jti"] == "jti-new"
    assert [(x["decision"], x["path_taken"]) for x in w.lines] == [("allow", "local")]


def test_a_bad_ttl_is_a_bad_request(policies: PolicySet) -> None:
    w = _world(policies)
    got = asyncio.run(_request(w, INTERNAL_HOST, _head(
        "POST", "/v1/tokens/refresh?ttl=soon", ("Host", INTERNAL_HOST))))
    assert isinstance(got, Answer) and got.headers.get(ERROR_HEADER) == "bad_request"
    assert b"is not a duration" in got.body


def test_the_swap_places_the_key_and_the_exchange_writes_one_line(policies: PolicySet) -> None:
    w = _world(policies)
    ex = asyncio.run(_exchange(w, "api.openai.com", _head(
        "GET", "/v1/models", ("Host", "api.openai.com"), ("Authorization", f"Bearer {GOOD}"))))
    assert ex.head.headers.get("authorization") == f"Bearer {KEY}"
    ex.finish(200)
    ex.finish(200)  # (idempotent)
    assert [(x["decision"], x["credential"], x["status"]) for x in w.lines] == [
        ("allow", "openai", 200)]


def test_sweep_ends_a_connection_whose_token_was_revoked(policies: PolicySet) -> None:
    w = _world(policies)
    client = Client(PEER)
    w.gate.opened(client)
    asyncio.run(w.gate.connect(client, "allowed.test:443", _basic("sandbox-1", GOOD)))
    ended: list[bool] = []
    client.end = lambda: ended.append(True)
    assert w.gate.sweep() == 0
    client.token = f"{TOKEN_PREFIX}token_revoked.sig"
    assert w.gate.sweep() == 1 and ended == [True] and client.ended_by == "token_revoked"
    w.gate.closed(client)
    assert w.lines[-1]["error"] == "token_revoked"  # the tunnel's line names why
    assert w.gate.open_connections == 0 and w.gate.connections.of("sandbox-1") == 0


def test_the_gate_reads_time_from_its_clock(policies: PolicySet) -> None:
    """Time is a port too: every start and end the lines carry comes from `clock`."""
    ticks = iter(range(1000, 2000))
    w = _world(policies, clock=lambda: float(next(ticks)))
    asyncio.run(_request(w, "other.test", _head("GET", "/admin", ("Host", "other.test"))))
    # begin reads the start (one tick), the refusal's line its end (the next)
    assert [line["duration_ms"] for line in w.lines] == [1000.0]
    client = asyncio.run(_tunnel(w, "allowed.test"))
    assert client.tunnel is not None and 1000 < client.tunnel.started < 2000


@pytest.mark.parametrize(("step", "inside"), [
    (lambda w: _tunnel(w, "denied.test"), "denied.test"),                         # the policy
    (lambda w: _tunnel(w, "allowed.test", token=f"{TOKEN_PREFIX}token_expired.sig"),
     "allowed.test"),                                                             # a token
    (lambda w: w.gate.connect(Client(PEER), "allowed.test:443", None), None),     # 407 challenge
    (lambda w: w.gate.connect(Client(PEER), "u@allowed.test:443",
                              _basic("sandbox-1", GOOD)), None),                  # no name
    (_audit_down, None),                                                          # no TLS spent
])
def test_which_refused_connects_are_answered_inside_tls(
        policies: PolicySet, step: Callable[[World], Any], inside: str | None) -> None:
    w = _world(policies, refusals_inside_tls=True)
    with pytest.raises(Refused) as caught:
        asyncio.run(step(w))
    assert caught.value.inside == inside
    if inside is not None:  # rendered again for the request that comes inside
        head = _head("GET", "/", ("Host", inside), ("User-Agent", "git/2.39.5"))
        answer = w.gate.answer_inside(caught.value, head)
        assert (answer.headers.get("content-type") or "").startswith("text/plain")
        assert caught.value.refusal.code.encode() in answer.body
    assert len(w.lines) == 1  # (the CONNECT's line is the refusal's only one)
    off = _world(policies)
    with pytest.raises(Refused) as caught:
        asyncio.run(step(off))
    assert caught.value.inside is None


# -- report mode is a rendering: the proxy's line says what evaluate says (issue 41.3) --

REPORTED = [
    ("an MCP call the rule denies", "POST", "https://mcp.test/mcp",
     b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "delete_repo"}}',
     (("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream"))),
    ("a body on an MCP GET", "GET", "https://mcp.test/mcp", b'{"x": 1}', ()),
    ("an MCP method no transport uses", "PUT", "https://mcp.test/mcp", b"", ()),
    ("a model outside the allowlist", "POST", "https://api.openai.com/v1/chat/completions",
     b'{"model": "gpt-4o", "messages": []}',
     (("Content-Type", "application/json"), ("Authorization", f"Bearer {GOOD}"))),
    ("a fallback model outside the allowlist", "POST",
     "https://api.openai.com/v1/chat/completions",
     b'{"model": "gpt-4o-mini", "models": ["gpt-4o"], "messages": []}',
     (("Content-Type", "application/json"), ("Authorization", f"Bearer {GOOD}"))),
]


@pytest.mark.parametrize(("what", "method", "url", "body", "headers"), REPORTED,
                         ids=[r[0] for r in REPORTED])
def test_report_mode_renders_the_same_in_the_proxy_and_in_evaluate(
        what: str, method: str, url: str, body: bytes,
        headers: tuple[tuple[str, str], ...]) -> None:
    """Under `mode: report` the body stage's refusal is recorded, not enforced: the
    proxy forwards the request and its audit line says `report` with the same reason
    and rule as `evaluate` (explain, policy test, replay) gives."""
    from gateway.core.evaluate import evaluate, request_for
    from gateway.services.metering import static_metering

    doc = yaml.safe_load(POLICY)
    doc["mode"] = "report"
    doc["egress"].insert(0, {"host": "mcp.test", "paths": ["/mcp"], "mcp": {
        "tools": {"allow": ["search_*"], "deny": ["delete_*"]}}})
    policies = load_policy_texts({"policies/agent.yaml": yaml.safe_dump(doc)})
    w = _world(policies)
    w.gate.metering = static_metering()
    request = request_for(method, url)
    assert request.path is not None
    head = _head(method, request.path, ("Host", request.host), *headers,
                 *((("Content-Length", str(len(body))),) if body else ()))
    ex = asyncio.run(_exchange(w, request.host, head))
    ex.request_whole(body)
    ex.finish(200)
    [line] = [x for x in w.lines if x["method"] == method]
    verdict = evaluate(policies, policies.policies["agent"], request, body=body,
                       metering=static_metering())
    assert verdict.result == "report", verdict
    assert (line["decision"], line["reason"], line["rule"]) == (
        verdict.result, verdict.reason, verdict.rule), (what, line)


REFRESHED = f"{TOKEN_PREFIX}refreshed.sig"  # a token of the same sandbox, refreshed
GONE = f"{TOKEN_PREFIX}gone.sig"  # a token of the same sandbox, revoked


class _Counted(Tokens):
    """The fake token port, counting the verifications it is asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def verify(self, token: str) -> Identity:
        self.asked.append(token)
        if token == GONE:
            raise TokenRefused("token_revoked", "the token was revoked")
        return _identity() if token == REFRESHED else super().verify(token)


@pytest.mark.parametrize(("carried", "asked", "code"), [
    (GOOD, [GOOD], None),  # the connection's token: verified once, by the recheck
    (REFRESHED, [GOOD, REFRESHED], None),
    (OTHER, [GOOD, OTHER], "credential_not_in_scope"),  # another sandbox's
    (GONE, [GOOD, GONE], "token_revoked"),
], ids=["its own token", "refreshed", "another sandbox's", "revoked"])
def test_the_carried_token_is_verified_unless_it_is_the_one_just_rechecked(
        policies: PolicySet, carried: str, asked: list[str], code: str | None) -> None:
    """A credential call's carrier usually holds the connection's own token, which the
    request's recheck verified a moment before: it is not verified a second time. Any
    other token in the carrier is verified itself (and refused as it would be)."""
    w = _world(policies)
    tokens = _Counted()
    w.gate.identities.tokens = w.gate.requests.parts.tokens = tokens
    client = asyncio.run(_tunnel(w, "api.openai.com"))
    del tokens.asked[:]
    got = asyncio.run(w.gate.begin(client, _head(
        "GET", "/v1/models", ("Host", "api.openai.com"),
        ("Authorization", f"Bearer {carried}")), tls=True))
    assert tokens.asked == asked
    if code is None:
        assert isinstance(got, Exchange), got
    else:
        assert isinstance(got, Answer) and got.headers.get(ERROR_HEADER) == code, got
