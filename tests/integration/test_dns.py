"""The gateway's DNS resolver for real: the whole gateway with `listen.dns`, queried by
`dig` (bind9-dnsutils) and dnspython over UDP and TCP.

Distinct sandboxes are distinct loopback source addresses (127.0.0.2, 127.0.0.3, all on
`lo`: clients bind to them), registered through the admin API like transparent-mode
sandboxes. Names resolve only through an injected StaticResolver (documentation and
loopback addresses) or `network.resolve`: the system resolver is never asked and no
packet leaves this machine. The last test runs transparent mode end to end in network
namespaces, the sandbox's resolv.conf pointing at the gateway.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import httpx
import pytest
import yaml
from conftest import GatewayFactory
from helpers.gateway import GatewayThread
from helpers.tls import LocalCA

from gateway.net.resolver import StaticResolver

ROOT = Path(__file__).resolve().parents[2]
NETNS = ROOT / "scripts" / "sandbox-netns.sh"

POLICY = """
version: v1
name: agent
egress:
  - host: allowed.test
  - host: private.test
  - host: mapped.test
  - host: "*.cdn.test"
  - host: boom.test
"""
OTHER = """
version: v1
name: other
egress:
  - host: other-only.test
"""
SBX_A, SBX_B, STRANGER = "127.0.0.2", "127.0.0.3", "127.0.0.4"
NAMES = {
    "allowed.test": ["203.0.113.10", "2001:db8::10", "10.1.2.3"],  # the private one dropped
    "x.cdn.test": ["203.0.113.11"],
    "private.test": ["10.0.0.5", "169.254.169.254"],                # forbidden only
    "other-only.test": ["203.0.113.12"],
    "evil.test": ["203.0.113.66"],                                  # never allowed
}
DIG_STATUS = re.compile(r"status: (\w+)")


class RecordingResolver(StaticResolver):
    """StaticResolver that remembers every name the gateway asked it for."""

    def __init__(self, mapping: dict[str, list[str]]) -> None:
        super().__init__(mapping)
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int) -> list[str]:
        self.asked.append(host)
        if host == "boom.test":
            raise RuntimeError("a resolver bug")  # not an OSError: nothing expects it
        return await super().resolve(host, port)


@dataclass
class Dns:
    gw: GatewayThread
    port: int
    resolver: RecordingResolver

    def register(self, sandbox: str, ip: str, policy: str = "agent") -> None:
        r = httpx.post(f"{self.gw.admin}/v1/sandboxes", json={"id": sandbox, "ip": ip,
                       "policy": policy},
                       headers={"Authorization": f"Bearer {self.gw.gateway.admin_token}"})
        assert r.status_code in (200, 201), r.text

    def dig(self, name: str, qtype: str = "A", source: str = SBX_A, *opts: str
            ) -> tuple[str, list[str]]:
        """(status, answer records) from the real dig."""
        out = subprocess.run(
            ["dig", "@127.0.0.1", "-p", str(self.port), "-b", source, name, qtype,
             "+tries=1", "+time=3", "+noall", "+comments", "+answer", *opts],
            capture_output=True, text=True, timeout=20)
        status = DIG_STATUS.search(out.stdout)
        assert status, out.stdout + out.stderr
        answers = [line.split() for line in out.stdout.splitlines()
                   if line and not line.startswith(";")]
        return status.group(1), [f[-1] for f in answers if len(f) >= 5 and f[3] == qtype]

    def query(self, name: str, qtype: str = "A", source: str = SBX_A, tcp: bool = False
              ) -> dns.message.Message:
        """A dnspython query (UDP or TCP) from `source`."""
        q = dns.message.make_query(name, qtype)
        send = dns.query.tcp if tcp else dns.query.udp
        return send(q, "127.0.0.1", port=self.port, source=source, timeout=3)

    def audit(self) -> list[dict[str, Any]]:
        return [r for r in self.gw.audit.records() if r.get("engine") == "dns"]

    def metric(self, policy: str, result: str) -> float:
        text = httpx.get(f"{self.gw.admin}/metrics").text
        line = (f'sandbox_gateway_dns_queries_total{{policy="{policy}",'
                f'result="{result}"}} ')
        for row in text.splitlines():
            if row.startswith(line):
                return float(row[len(line):])
        return 0.0


def _start(make_gateway: GatewayFactory, rate: float, burst: int) -> Dns:
    if shutil.which("dig") is None:
        pytest.fail("dig is missing: run `make tools` (Debian package bind9-dnsutils)")
    resolver = RecordingResolver(NAMES)
    gw = make_gateway(
        {"agent.yaml": POLICY, "other.yaml": OTHER},
        {"listen": {"dns": "127.0.0.1:0"},
         "network": {"allow_cidrs": ["203.0.113.0/24", "2001:db8::/32"],
                     "resolve": {"mapped.test": "127.0.0.1:8443"}},
         "dns": {"ttl": "7s", "rate": rate, "burst": burst}},
        resolver=resolver)
    assert gw.gateway.dns is not None
    lab = Dns(gw, gw.gateway.dns.addresses[0][1], resolver)
    lab.register("sbx-a", SBX_A)
    lab.register("sbx-b", SBX_B, "other")
    return lab


@pytest.fixture
def resolver_gw(make_gateway: GatewayFactory) -> Dns:
    return _start(make_gateway, rate=100, burst=200)


@pytest.fixture
def tight_gw(make_gateway: GatewayFactory) -> Dns:
    """dns.rate 5/s, dns.burst 10."""
    return _start(make_gateway, rate=5, burst=10)


def test_allowed_name_is_answered_with_allowed_addresses_only(resolver_gw: Dns) -> None:
    lab = resolver_gw
    assert lab.dig("allowed.test") == ("NOERROR", ["203.0.113.10"])
    assert lab.dig("allowed.test", "AAAA") == ("NOERROR", ["2001:db8::10"])
    assert lab.dig("Allowed.TEST", "A", SBX_A, "+tcp") == ("NOERROR", ["203.0.113.10"])
    assert lab.dig("x.cdn.test") == ("NOERROR", ["203.0.113.11"])
    # An operator's network.resolve override is answered as configured.
    assert lab.dig("mapped.test") == ("NOERROR", ["127.0.0.1"])
    assert lab.dig("mapped.test", "AAAA") == ("NOERROR", [])
    r = lab.query("allowed.test")
    assert r.rcode() == dns.rcode.NOERROR
    (rrset,) = r.answer
    assert [rd.address for rd in rrset] == ["203.0.113.10"] and rrset.ttl == 7
    r = lab.query("allowed.test", "AAAA", tcp=True)
    assert [rd.address for rd in r.answer[0]] == ["2001:db8::10"]

    line = next(a for a in lab.audit() if a["host"] == "x.cdn.test")
    assert {k: line[k] for k in ("sandbox", "policy", "method", "qtype", "decision", "rcode",
                                 "answer", "error", "rule", "engine", "transport")} == {
        "sandbox": "sbx-a", "policy": "agent", "method": "DNS", "qtype": "A",
        "decision": "allow", "rcode": "NOERROR", "answer": ["203.0.113.11"], "error": None,
        "rule": "policies/agent.yaml:8", "engine": "dns",  # (never the host's path)
        "transport": "udp"}
    assert line["client"].startswith(f"{SBX_A}:") and line["time"].endswith("Z")


def test_refusals(resolver_gw: Dns) -> None:
    lab = resolver_gw
    # Metrics are process-wide (other tests count too): compare deltas.
    before = {k: lab.metric(*k) for k in (("agent", "policy_denied"), ("-", "unknown_sandbox"),
                                          ("agent", "type_refused"))}
    # A name the policy does not allow: NXDOMAIN, and never resolved.
    assert lab.dig("evil.test") == ("NXDOMAIN", [])
    assert lab.query("evil.test", "AAAA", tcp=True).rcode() == dns.rcode.NXDOMAIN
    # Each sandbox has its own policy.
    assert lab.dig("other-only.test") == ("NXDOMAIN", [])
    assert lab.dig("other-only.test", "A", SBX_B) == ("NOERROR", ["203.0.113.12"])
    assert lab.dig("allowed.test", "A", SBX_B) == ("NXDOMAIN", [])
    # Tunnel-friendly record types: refused, even for an allowed name.
    for qtype in ("TXT", "NULL", "ANY", "CNAME", "MX", "SRV"):
        assert lab.dig("allowed.test", qtype)[0] == "REFUSED", qtype
    assert lab.query("evil.test", "TXT").rcode() == dns.rcode.REFUSED
    # An allowed name that resolves only to forbidden addresses: refused, no address.
    assert lab.dig("private.test") == ("REFUSED", [])
    # A source that is not a registered sandbox: refused, whatever it asks.
    assert lab.dig("allowed.test", "A", STRANGER) == ("REFUSED", [])
    assert lab.query("allowed.test", "A", STRANGER, tcp=True).rcode() == dns.rcode.REFUSED

    lines = lab.audit()
    evil = next(a for a in lines if a["host"] == "evil.test" and a["qtype"] == "A")
    assert (evil["decision"], evil["rcode"], evil["error"]) == ("deny", "NXDOMAIN",
                                                                "policy_denied")
    assert 'no rule in policy "agent" allows host "evil.test"' in evil["reason"]
    private = next(a for a in lines if a["host"] == "private.test")
    assert private["error"] == "forbidden_destination" and private["answer"] == []
    assert "10.0.0.5" in private["reason"]
    stranger = [a for a in lines if a["client"].startswith(STRANGER + ":")]
    assert len(stranger) == 2 and all(a["error"] == "unknown_sandbox" for a in stranger)
    # Only allowed names ever reach the gateway's resolver: a denied name (the data a
    # tunnel carries) is never looked up, so it cannot leave through the gateway either.
    assert set(lab.resolver.asked) == {"private.test", "other-only.test"}
    after = {k: lab.metric(*k) for k in before}
    assert after[("agent", "policy_denied")] - before[("agent", "policy_denied")] == 3
    assert after[("-", "unknown_sandbox")] - before[("-", "unknown_sandbox")] == 2
    assert after[("agent", "type_refused")] - before[("agent", "type_refused")] == 7


ASKING = """
version: v1
name: agent
ask: {hosts: true}
egress:
  - host: allowed.test
  - host: blocked.test
    action: deny
    reason: never this one
"""


def test_a_grant_resolves_a_name_only_where_the_proxy_lets_it_decide(
        make_gateway: GatewayFactory) -> None:
    """Ask mode's grants decide the resolver's answer as they decide the proxy's CONNECT
    (one decision, `name_allowed` over `with_grants`): a granted name resolves (within
    the watcher's tenth of a second of the grant being written), a deny rule with a
    grant for its host (made before the rule) does not, and the proxy refuses it too,
    without asking."""
    from helpers.clients import raw_connect

    from gateway.core.approvals import Asked, Grant

    resolver = RecordingResolver({**NAMES, "new.test": ["203.0.113.13"],
                                  "blocked.test": ["203.0.113.14"]})
    gw = make_gateway({"agent.yaml": ASKING}, {
        "listen": {"dns": "127.0.0.1:0"},
        "network": {"allow_cidrs": ["203.0.113.0/24"]}}, resolver=resolver)
    assert gw.gateway.dns is not None and gw.gateway.approvals is not None
    lab = Dns(gw, gw.gateway.dns.addresses[0][1], resolver)
    lab.register("sbx-a", SBX_A)
    assert lab.dig("new.test") == ("NXDOMAIN", [])
    assert lab.dig("blocked.test") == ("NXDOMAIN", [])
    now = time.time()
    store = gw.gateway.approvals.store
    for n, host in enumerate(["new.test", "blocked.test"]):
        grant = Grant(id=f"gr_{n}", approval=f"ap_{n}", scope="policy", policy="agent",
                      sandbox=None, asked=Asked("host", host, 443), by="alice", note=None,
                      created=now, expires=now + 600)
        assert gw.call(store.record_put("grant", grant.id, grant.to_doc(), now + 600, None))
    deadline = time.monotonic() + 2
    while lab.dig("new.test")[0] != "NOERROR":
        assert time.monotonic() < deadline, "the grant never reached the resolver"
        time.sleep(0.02)
    assert lab.dig("new.test") == ("NOERROR", ["203.0.113.13"])
    assert lab.dig("blocked.test") == ("NXDOMAIN", [])
    lines = lab.audit()
    granted = [a for a in lines if a["host"] == "new.test" and a["decision"] == "allow"]
    assert granted and all(a["rule"] == "grant:gr_0" for a in granted)
    blocked = [a for a in lines if a["host"] == "blocked.test"]
    assert blocked and all(a["error"] == "policy_denied" and "never this one" in a["reason"]
                           for a in blocked)
    assert "blocked.test" not in resolver.asked  # (never resolved: refused first)
    # The proxy decides the same: refused at once, nobody asked.
    token = gw.mint("agent", "sbx-proxy")
    status, _, body = raw_connect(gw.gateway.proxy_address, "blocked.test:443", token,
                                  sandbox="sbx-proxy")
    assert status == 403 and body is not None and body["error"] == "policy_denied"
    assert not [r for r in gw.audit.records() if r.get("engine") == "approvals"]


def test_random_label_flood_is_rate_limited_per_sandbox(tight_gw: Dns) -> None:
    """A DNS tunnel's query stream (long random labels under an attacker's domain) from
    one sandbox is refused past its bucket (rate 5/s, burst 10) while another sandbox is
    still answered; the audit log gets a line a second for the refusals, not one each."""
    lab = tight_gw
    limited_before = lab.metric("agent", "rate_limited")
    rcodes: list[int] = []
    started = time.monotonic()
    for _ in range(120):
        label = secrets.token_hex(30)  # 60 chars: ~30 bytes of payload per label
        name = f"{label}.{secrets.token_hex(20)}.tunnel.evil.test"
        rcodes.append(lab.query(name, "A").rcode())
        if len(rcodes) == 60:
            # Mid-flood, another sandbox is answered at once.
            assert lab.dig("other-only.test", "A", SBX_B) == ("NOERROR", ["203.0.113.12"])
    elapsed = time.monotonic() - started
    refused = rcodes.count(dns.rcode.REFUSED)
    nxdomain = rcodes.count(dns.rcode.NXDOMAIN)
    assert refused + nxdomain == 120
    assert nxdomain <= 10 + 5 * elapsed + 1  # burst + refill, nothing more
    assert refused >= 120 - (10 + 5 * elapsed + 1) and refused >= 60
    assert rcodes[:10] == [dns.rcode.NXDOMAIN] * 10  # the burst got through
    assert not [n for n in lab.resolver.asked if "evil" in n]
    assert lab.metric("agent", "rate_limited") - limited_before == refused
    limited = [a for a in lab.audit() if a["error"] == "rate_limited"]
    assert 1 <= len(limited) <= elapsed + 2  # about one line a second
    assert sum(a["queries"] for a in limited) <= refused
    assert all(a["sandbox"] == "sbx-a" and a["rcode"] == "REFUSED" for a in limited)
    # sbx-b's bucket is its own: still answered after the flood.
    assert lab.dig("other-only.test", "A", SBX_B) == ("NOERROR", ["203.0.113.12"])


def test_garbage_gets_formerr_or_nothing(resolver_gw: Dns) -> None:
    import socket

    lab = resolver_gw
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((SBX_A, 0))
        s.settimeout(3)
        s.sendto(b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07trunc", ("127.0.0.1",
                                                                               lab.port))
        reply = dns.message.from_wire(s.recv(512))
        assert reply.id == 0xBEEF and reply.rcode() == dns.rcode.FORMERR
        # A response sent to the resolver is never answered (no reflection loops).
        s.sendto(dns.message.make_response(dns.message.make_query("a.test", "A")).to_wire(),
                 ("127.0.0.1", lab.port))
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(512)
    assert lab.dig("allowed.test") == ("NOERROR", ["203.0.113.10"])  # still serving


def test_an_internal_error_fails_closed(resolver_gw: Dns) -> None:
    """A crash while answering gives SERVFAIL and an audit line, never an address."""
    lab = resolver_gw
    assert lab.dig("boom.test") == ("SERVFAIL", [])
    line = next(a for a in lab.audit() if a["host"] == "boom.test")
    assert (line["decision"], line["error"], line["answer"]) == ("deny", "gateway_error", [])
    assert lab.dig("allowed.test") == ("NOERROR", ["203.0.113.10"])  # still serving


def test_dns_port_is_one_of_the_gateways_own_addresses(resolver_gw: Dns) -> None:
    """No sandbox can be proxied to the resolver's own TCP port."""
    verdict = resolver_gw.gw.gateway.address_policy.classify("127.0.0.1", resolver_gw.port)
    assert not verdict.allowed


def test_bad_listen_dns_stops_the_gateway(tmp_path: Path) -> None:
    """A taken DNS port stops `run` with a message naming listen.dns (exit 2)."""
    import socket

    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
            "listen": {"proxy": "127.0.0.1:0", "admin": "127.0.0.1:0",
                       "dns": f"127.0.0.1:{port}"},
            "policies": "policies", "certs": "certs", "secrets": {"store": "env"},
        }))
        out = subprocess.run([sys.executable, "-m", "gateway", "run", "--workers", "1",
                              "--config", str(tmp_path / "gateway.yaml")], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on listen.dns 127.0.0.1:{port}" in out.stderr


# ------------------------------------------------------------------- transparent, netns

UPSTREAM_IP, SANDBOX_IP, GATEWAY_IP = "203.0.113.10", "198.18.0.2", "198.18.0.1"
ADMIN = "sandbox-gateway-dns-test-admin-token"
NETNS_POLICY = """
version: v1
name: agent
egress:
  - host: allowed.test
"""
UPSTREAM = r"""
import json, ssl, sys, http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def do_GET(self):
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
srv = http.server.ThreadingHTTPServer((sys.argv[1], 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(sys.argv[2], sys.argv[3])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print("ready", flush=True); srv.serve_forever()
"""


def _wait_ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if "ready" in proc.stdout.readline():
            return
        if proc.poll() is not None:
            raise RuntimeError("upstream exited")
    raise TimeoutError("upstream not ready")


@pytest.mark.netns
def test_transparent_sandbox_resolves_through_the_gateway(tmp_path: Path) -> None:
    """A sandbox namespace whose only resolver is the gateway: an allowed name resolves
    (through `getaddrinfo`, i.e. its resolv.conf) and is then reached through the
    transparent listener; a denied name does not resolve at all."""
    if os.geteuid() != 0:
        pytest.fail("needs root for network namespaces")
    for tool in ("ip", "iptables", "curl", "dig", "getent"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run `make tools`")
    tag = uuid.uuid4().hex[:6]
    gw_ns, sbx_ns = f"dgw{tag}", f"dsb{tag}"
    etc = [Path("/etc/netns") / gw_ns, Path("/etc/netns") / sbx_ns]
    procs: list[subprocess.Popen[str]] = []

    def in_sandbox(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", sbx_ns, *cmd], capture_output=True,
                              text=True, timeout=30)

    def admin(method: str, path: str, body: dict[str, str] | None = None) -> str:
        cmd = ["ip", "netns", "exec", gw_ns, "curl", "-sS", "-X", method,
               "-H", f"Authorization: Bearer {ADMIN}", f"http://127.0.0.1:8090{path}"]
        if body is not None:
            cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout

    try:
        out = subprocess.run([str(NETNS), "up", sbx_ns, gw_ns, "8081", "53"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            pytest.skip(f"the kernel refused the namespace setup: {out.stderr.strip()}")
        subprocess.run(["ip", "-n", gw_ns, "addr", "add", f"{UPSTREAM_IP}/32", "dev", "lo"],
                       check=True)
        # Each namespace's /etc: the sandbox knows only the gateway as its resolver; the
        # gateway namespace's own resolver is a dead end on its loopback (it only ever
        # resolves names through network.resolve here).
        for d in etc:
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("127.0.0.1 localhost\n")
        (etc[1] / "resolv.conf").write_text(
            f"nameserver {GATEWAY_IP}\noptions timeout:2 attempts:1\n")
        (etc[0] / "resolv.conf").write_text("nameserver 127.0.0.1\n")

        ca = LocalCA.create(tmp_path / "ca")
        cert, key = ca.issue(tmp_path, ["allowed.test"])
        up = subprocess.Popen(["ip", "netns", "exec", gw_ns, sys.executable, "-c", UPSTREAM,
                               UPSTREAM_IP, str(cert), str(key)], stdout=subprocess.PIPE,
                              text=True)
        procs.append(up)
        _wait_ready(up)
        (tmp_path / "policies").mkdir()
        (tmp_path / "policies" / "agent.yaml").write_text(NETNS_POLICY)
        audit = tmp_path / "audit.jsonl"
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
            "listen": {"proxy": "127.0.0.1:8080", "admin": "127.0.0.1:8090",
                       "transparent": "0.0.0.0:8081", "dns": "0.0.0.0:53"},
            "admin_token": ADMIN, "policies": "policies", "certs": "certs", "workers": 1,
            "secrets": {"store": "env"}, "audit": {"path": str(audit)},
            # 203.0.113.0/24 stands in for the internet here, as in test_transparent.py.
            "network": {"resolve": {"allowed.test": f"{UPSTREAM_IP}:443"},
                        "allow_cidrs": ["203.0.113.0/24"]},
        }))
        gw = subprocess.Popen(
            ["ip", "netns", "exec", gw_ns, sys.executable, "-m", "gateway", "run",
             "--config", str(tmp_path / "gateway.yaml")],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        procs.append(gw)
        deadline = time.monotonic() + 20
        while '"ready"' not in admin("GET", "/readyz").replace(" ", ""):
            if gw.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(gw.stderr.read() if gw.stderr else "gateway not ready")
            time.sleep(0.2)

        # Not registered yet: the gateway refuses to resolve anything for it.
        r = in_sandbox("dig", "+tries=1", "+time=3", "allowed.test")
        assert "status: REFUSED" in r.stdout, r.stdout + r.stderr
        assert SANDBOX_IP in admin("POST", "/v1/sandboxes",
                                   {"id": "sbx-1", "ip": SANDBOX_IP, "policy": "agent"})

        # getaddrinfo through the sandbox's resolv.conf -> the gateway's resolver.
        r = in_sandbox("getent", "ahostsv4", "allowed.test")
        assert r.returncode == 0 and r.stdout.split()[0] == UPSTREAM_IP, r.stdout + r.stderr
        r = in_sandbox("dig", "+tcp", "+tries=1", "+time=3", "+short", "allowed.test")
        assert r.stdout.split() == [UPSTREAM_IP], r.stdout + r.stderr
        # ...then the connection goes through the transparent listener (no --resolve).
        r = in_sandbox("curl", "-sS", "--max-time", "8", "--cacert", str(ca.cert_path),
                       "https://allowed.test/via-dns")
        assert r.returncode == 0, r.stderr + audit.read_text()
        assert json.loads(r.stdout)["path"] == "/via-dns"
        # A name the policy does not allow does not even resolve.
        r = in_sandbox("curl", "-sS", "--max-time", "8", "https://evil.test/")
        assert r.returncode == 6, r.stderr  # CURLE_COULDNT_RESOLVE_HOST
        r = in_sandbox("dig", "+tries=1", "+time=3", "evil.test", "TXT")
        assert "status: REFUSED" in r.stdout

        lines = [json.loads(x) for x in audit.read_text().splitlines()]
        dns_lines = [x for x in lines if x.get("engine") == "dns"]
        assert any(x["host"] == "allowed.test" and x["decision"] == "allow"
                   and x["answer"] == [UPSTREAM_IP] and x["sandbox"] == "sbx-1"
                   for x in dns_lines)
        assert any(x["host"] == "evil.test" and x["rcode"] == "NXDOMAIN" for x in dns_lines)
        assert any(x.get("path_taken") == "passthrough" and x["host"] == "allowed.test"
                   for x in lines)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        subprocess.run([str(NETNS), "down", sbx_ns, gw_ns], capture_output=True, timeout=30)
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)
