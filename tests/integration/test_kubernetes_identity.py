"""Kubernetes pod identity (issue 24) against the fake API server (tests/fakes/kube_api.py)
with kubernetes_asyncio: a pod is known by its address, no token anywhere.

The gateway runs in this process on 127.0.0.1; each "pod" is a client whose connections
leave from its own loopback address (127.0.0.0/8 is all local on Linux), which the fake
lists as the pod's IP. Both engines (`network.intercept: fast` and `mitmproxy`) run
the address cases. Cases: label -> policy, namespace default, no policy, Pending,
credentials injected without a token, audit fields; a pod deleted mid-tunnel (the tunnel
ends within a second); its address reused by a new pod; two pods on one address; watch
cut and resumed, compacted (410, re-list); a stale watch fails closed and /readyz says
why; the token exchange (TokenReview and OIDC): good, another audience, expired, pod
gone, subjects; the plain token path beside it. The netns suite runs curl from real
pod network namespaces (test_kubernetes_netns.py).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.kube_api import FakeKubeAPI
from helpers.gateway import GatewayThread
from helpers.parity_cases import KEY
from helpers.tls import LocalCA
from helpers.upstream import Upstream

NS = "sandboxes"
ROOT = Path(__file__).resolve().parents[2]
POLICIES = {
    "agent.yaml": """
version: v1
name: agent
egress:
  - host: allowed.test
  - host: other.test
    inspect: true
  - host: api.openai.com
    credential: openai
credentials:
  openai: {preset: openai, secret: openai-api-key}
""",
    "narrow.yaml": """
version: v1
name: narrow
egress:
  - host: other.test
    inspect: true
""",
    "limited.yaml": """
version: v1
name: limited
subjects: [{namespace: sandboxes, service_account: "agent-*"}]
egress:
  - host: allowed.test
""",
}


def _ip(n: int) -> str:
    return f"127.0.0.{n}"


class Pods:
    """Requests from pod addresses through the gateway (http.client, CONNECT tunnels)."""

    def __init__(self, gw: GatewayThread, ca: LocalCA) -> None:
        self.gw = gw
        self.ctx = ssl.create_default_context(cafile=str(gw.ca_cert))
        self.ctx.load_verify_locations(cafile=str(ca.cert_path))

    def get(self, ip: str, host: str, path: str = "/", *, auth: str | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
        """(status, body, headers) of one request; a refused CONNECT gives its status."""
        assert self.gw.gateway.proxy_address is not None
        phost, pport = self.gw.gateway.proxy_address
        conn = http.client.HTTPSConnection(phost, pport, source_address=(ip, 0),
                                           context=self.ctx, timeout=10)
        conn.set_tunnel(host, 443, headers={"Proxy-Authorization": auth} if auth else None)
        try:
            conn.request("GET", path, headers={"Host": host, **(headers or {})})
            response = conn.getresponse()
            return response.status, response.read().decode(), dict(response.getheaders())
        except OSError as exc:
            text = str(exc)
            if "Tunnel connection failed:" in text:
                return int(text.split(":", 1)[1].split()[0]), text, {}
            raise
        finally:
            conn.close()

    def tunnel(self, ip: str, host: str) -> socket.socket:
        """An open passthrough tunnel (CONNECT answered 200), TLS not begun."""
        assert self.gw.gateway.proxy_address is not None
        sock = socket.create_connection(self.gw.gateway.proxy_address, timeout=5,
                                        source_address=(ip, 0))
        sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head
        return sock


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(tmp_path_factory.mktemp("kube"), bookmark_interval=0.5) as fake:
        yield fake


def _gateway(workdir: Path, kube: FakeKubeAPI, ca: LocalCA, upstream: Upstream,
             intercept: str = "fast", listen_proxy: str = "127.0.0.1", dns: bool = False,
             **identity: Any) -> GatewayThread:
    (workdir / "policies").mkdir(parents=True, exist_ok=True)
    for name, text in POLICIES.items():
        (workdir / "policies" / name).write_text(text)
    secrets = workdir / "secrets.yaml"
    secrets.write_text(f"openai-api-key: {KEY}\n")
    secrets.chmod(0o600)
    names = ["allowed.test", "other.test", "api.openai.com"]
    return GatewayThread(workdir, {
        "listen": {"proxy": f"{listen_proxy}:0", "admin": "127.0.0.1:0",
                   **({"dns": "127.0.0.1:0"} if dns else {})},
        "network": {"upstream_ca": str(ca.cert_path), "intercept": intercept,
                    "resolve": {n: f"127.0.0.1:{upstream.port}" for n in names}},
        "secrets": {"store": "file", "path": str(secrets)},
        "identity": {"kubernetes": {
            "enabled": True, "namespaces": [NS, "batch"],
            "kubeconfig": str(kube.write_kubeconfig(workdir / "kubeconfig")),
            "default_policies": {"batch": "narrow"}, **identity}},
    })


@pytest.fixture(scope="module", params=["fast", "mitmproxy"])
def lab(request: pytest.FixtureRequest, kube: FakeKubeAPI, test_ca: LocalCA,
        upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[GatewayThread, Pods]]:
    gw = _gateway(tmp_path_factory.mktemp("gw"), kube, test_ca, upstream, request.param)
    try:
        yield gw, Pods(gw, test_ca)
    finally:
        gw.stop()


def _until(predicate: Any, timeout: float = 3.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def _identified(gw: GatewayThread, ip: str, uid: str) -> bool:
    assert gw.gateway.pods is not None
    return _until(lambda: not isinstance(found := gw.gateway.pods.index.at(ip), str)
                  and found.workload is not None and found.workload.uid == uid)


def _last(gw: GatewayThread, ip: str) -> dict[str, Any]:
    assert gw.audit.wait_for(lambda r: str(r.get("client", "")).startswith(ip + ":"))
    return [r for r in gw.audit.records() if str(r.get("client", "")).startswith(ip + ":")][-1]


def test_a_labelled_pod_is_its_policy_with_no_token(lab: tuple[GatewayThread, Pods],
                                                    kube: FakeKubeAPI,
                                                    upstream: Upstream) -> None:
    gw, pods = lab
    pod = kube.add_pod(NS, f"agent-{gw.config.network.intercept}", _ip(10),
                       labels={"sandbox-gateway.io/policy": "agent"},
                       service_account="agent-sa")
    uid = pod["metadata"]["uid"]
    assert _identified(gw, _ip(10), uid)
    status, body, _ = pods.get(_ip(10), "allowed.test", "/status/200")
    assert status == 200, body
    line = _last(gw, _ip(10))
    assert (line["sandbox"], line["policy"], line["jti"]) == (
        f"{NS}/agent-{gw.config.network.intercept}", "agent", f"pod:{uid}")
    assert line["workload"] == {"namespace": NS, "pod": f"agent-{gw.config.network.intercept}",
                                "uid": uid, "service_account": "agent-sa"}
    # A credential call: the key is injected, whatever the key slot held, and no token.
    before = len(upstream.requests)
    status, body, _ = pods.get(_ip(10), "api.openai.com", "/echo-header/authorization",
                               headers={"Authorization": "Bearer sandbox-gateway-pod"})
    assert status == 200, body
    assert len(upstream.requests) == before + 1
    assert upstream.requests[-1].headers["authorization"] == f"Bearer {KEY}"
    assert KEY not in body and KEY not in json.dumps(gw.audit.records())
    # And what the policy does not allow is refused, naming the rule.
    status, body, _ = pods.get(_ip(10), "nothere.test", "/")
    assert status == 403, body
    assert _last(gw, _ip(10))["error"] == "policy_denied"
    kube.delete_pod(NS, f"agent-{gw.config.network.intercept}")


def test_namespace_default_and_no_policy(lab: tuple[GatewayThread, Pods],
                                         kube: FakeKubeAPI) -> None:
    gw, pods = lab
    tag = gw.config.network.intercept
    a = kube.add_pod("batch", f"job-{tag}", _ip(11))  # no label: the namespace's default
    b = kube.add_pod(NS, f"bare-{tag}", _ip(12))  # no label, no default: no identity
    assert _identified(gw, _ip(11), a["metadata"]["uid"])
    assert pods.get(_ip(11), "other.test", "/status/200")[0] == 200
    assert _last(gw, _ip(11))["policy"] == "narrow"
    assert pods.get(_ip(11), "allowed.test", "/")[0] == 403
    assert _until(lambda: b["metadata"]["uid"] and gw.gateway.pods is not None
                  and "no sandbox-gateway.io/policy label" in str(
                      gw.gateway.pods.index.at(_ip(12))))
    status, text, _ = pods.get(_ip(12), "allowed.test", "/")
    assert status == 407, text
    line = _last(gw, _ip(12))
    assert line["error"] == "identity_unknown" and "no sandbox-gateway.io/policy label" in \
        line["reason"]
    # An address no pod holds.
    assert pods.get(_ip(13), "allowed.test", "/")[0] == 407
    assert "no pod in the watched namespaces" in _last(gw, _ip(13))["reason"]
    kube.delete_pod("batch", f"job-{tag}")
    kube.delete_pod(NS, f"bare-{tag}")


def test_pending_and_two_pods_on_one_address(lab: tuple[GatewayThread, Pods],
                                             kube: FakeKubeAPI) -> None:
    gw, pods = lab
    tag = gw.config.network.intercept
    labels = {"sandbox-gateway.io/policy": "agent"}
    kube.add_pod(NS, f"pending-{tag}", _ip(14), labels=labels, phase="Pending")
    assert _until(lambda: "Pending" in str(gw.gateway.pods.index.at(_ip(14))))  # type: ignore[union-attr]
    assert pods.get(_ip(14), "allowed.test", "/")[0] == 407
    assert "Pending, not Running" in _last(gw, _ip(14))["reason"]
    kube.add_pod(NS, f"twin-a-{tag}", _ip(15), labels=labels)
    kube.add_pod(NS, f"twin-b-{tag}", _ip(15), labels=labels)
    assert _until(lambda: "2 pods hold" in str(gw.gateway.pods.index.at(_ip(15))))  # type: ignore[union-attr]
    assert pods.get(_ip(15), "allowed.test", "/")[0] == 407
    assert "2 pods hold address 127.0.0.15" in _last(gw, _ip(15))["reason"]
    # A finished pod keeps its podIP in its status but holds nothing: the other is it.
    kube.update_pod(NS, f"twin-a-{tag}", phase="Succeeded")
    twin_b = kube.get_pod(NS, f"twin-b-{tag}")
    assert twin_b is not None and _identified(gw, _ip(15), twin_b["metadata"]["uid"])
    assert pods.get(_ip(15), "allowed.test", "/status/200")[0] == 200
    for name in (f"pending-{tag}", f"twin-a-{tag}", f"twin-b-{tag}"):
        kube.delete_pod(NS, name)


def test_a_deleted_pod_loses_its_tunnel_and_a_new_pod_its_address(
        lab: tuple[GatewayThread, Pods], kube: FakeKubeAPI) -> None:
    gw, pods = lab
    tag = gw.config.network.intercept
    old = kube.add_pod(NS, f"old-{tag}", _ip(16), labels={"sandbox-gateway.io/policy": "agent"})
    assert _identified(gw, _ip(16), old["metadata"]["uid"])
    sock = pods.tunnel(_ip(16), "allowed.test")  # passthrough: no request to re-check
    kube.delete_pod(NS, f"old-{tag}")
    deleted = time.monotonic()
    sock.settimeout(3)
    assert sock.recv(1) == b""  # closed by the gateway
    assert time.monotonic() - deleted < 1.5
    sock.close()
    lines = gw.audit.wait_for(lambda r: r.get("sandbox") == f"{NS}/old-{tag}"
                              and r.get("error") == "identity_unknown")
    assert lines and lines[-1]["method"] == "CONNECT", gw.audit.records()[-3:]
    # The address goes to a new pod under another policy: it is that pod now.
    new = kube.add_pod(NS, f"new-{tag}", _ip(16), labels={"sandbox-gateway.io/policy": "narrow"})
    assert _identified(gw, _ip(16), new["metadata"]["uid"])
    assert pods.get(_ip(16), "allowed.test", "/")[0] == 403
    assert pods.get(_ip(16), "other.test", "/status/200")[0] == 200
    line = _last(gw, _ip(16))
    assert (line["sandbox"], line["policy"]) == (f"{NS}/new-{tag}", "narrow")
    # A label changed under an open connection: the connection is not the pod it was.
    sock = pods.tunnel(_ip(16), "other.test")
    kube.update_pod(NS, f"new-{tag}", labels={"sandbox-gateway.io/policy": "agent"})
    sock.settimeout(3)
    assert sock.recv(1) == b""
    sock.close()
    kube.delete_pod(NS, f"new-{tag}")


def test_a_pod_whose_address_changed_is_not_its_old_address(
        lab: tuple[GatewayThread, Pods], kube: FakeKubeAPI) -> None:
    gw, pods = lab
    tag = gw.config.network.intercept
    pod = kube.add_pod(NS, f"moved-{tag}", _ip(22),
                       labels={"sandbox-gateway.io/policy": "agent"})
    assert _identified(gw, _ip(22), pod["metadata"]["uid"])
    sock = pods.tunnel(_ip(22), "allowed.test")
    kube.update_pod(NS, f"moved-{tag}", ip=_ip(23))
    sock.settimeout(3)
    assert sock.recv(1) == b""  # the old address is nobody now: its tunnel ends
    sock.close()
    assert _identified(gw, _ip(23), pod["metadata"]["uid"])
    assert pods.get(_ip(22), "allowed.test", "/")[0] == 407
    assert "no pod in the watched namespaces has address 127.0.0.22" in \
        _last(gw, _ip(22))["reason"]
    assert pods.get(_ip(23), "allowed.test", "/status/200")[0] == 200
    kube.delete_pod(NS, f"moved-{tag}")


def test_subjects_keep_a_mislabelled_pod_out(lab: tuple[GatewayThread, Pods],
                                             kube: FakeKubeAPI) -> None:
    gw, pods = lab
    tag = gw.config.network.intercept
    labels = {"sandbox-gateway.io/policy": "limited"}
    ok = kube.add_pod(NS, f"lim-ok-{tag}", _ip(17), labels=labels, service_account="agent-1")
    bad = kube.add_pod(NS, f"lim-bad-{tag}", _ip(18), labels=labels, service_account="web")
    assert _identified(gw, _ip(17), ok["metadata"]["uid"])
    assert _identified(gw, _ip(18), bad["metadata"]["uid"])
    assert pods.get(_ip(17), "allowed.test", "/status/200")[0] == 200
    assert pods.get(_ip(18), "allowed.test", "/")[0] == 407
    assert "does not admit pod" in _last(gw, _ip(18))["reason"]
    kube.delete_pod(NS, f"lim-ok-{tag}")
    kube.delete_pod(NS, f"lim-bad-{tag}")


def test_a_token_still_works_beside_pods(lab: tuple[GatewayThread, Pods]) -> None:
    gw, pods = lab
    token = gw.mint("agent", "classic-1")
    auth = "Basic " + base64.b64encode(f"classic-1:{token}".encode()).decode()
    status, body, _ = pods.get("127.0.0.1", "allowed.test", "/status/200", auth=auth)
    assert status == 200, body
    line = _last(gw, "127.0.0.1")
    assert line["sandbox"] == "classic-1" and line["workload"] is None


def test_the_dns_resolver_knows_pods(kube: FakeKubeAPI, test_ca: LocalCA, upstream: Upstream,
                                     tmp_path: Path) -> None:
    """The gateway's DNS resolver (transparent mode's) asks the same identifier: a pod
    gets answers for its policy's names, an address no pod holds gets none."""
    import dns.message
    import dns.query
    import dns.rcode

    gw = _gateway(tmp_path, kube, test_ca, upstream, dns=True)
    try:
        pod = kube.add_pod(NS, "dns-pod", _ip(30), labels={"sandbox-gateway.io/policy": "agent"})
        assert _identified(gw, _ip(30), pod["metadata"]["uid"])
        assert gw.gateway.dns is not None
        port = gw.gateway.dns.addresses[0][1]

        def ask(name: str, source: str) -> dns.message.Message:
            return dns.query.udp(dns.message.make_query(name, "A"), "127.0.0.1", port=port,
                                 source=source, timeout=5)

        answer = ask("allowed.test", _ip(30))
        assert answer.rcode() == dns.rcode.NOERROR and answer.answer, answer
        assert ask("nothere.test", _ip(30)).rcode() != dns.rcode.NOERROR
        assert ask("allowed.test", _ip(31)).rcode() == dns.rcode.REFUSED  # no pod there
        lines = gw.audit.wait_for(lambda r: r.get("listener") == "dns"
                                  and r.get("sandbox") == f"{NS}/dns-pod")
        assert lines and lines[0]["policy"] == "agent"
        kube.delete_pod(NS, "dns-pod")
        assert _until(lambda: isinstance(gw.gateway.pods.index.at(_ip(30)), str))  # type: ignore[union-attr]
        assert ask("allowed.test", _ip(30)).rcode() == dns.rcode.REFUSED
    finally:
        gw.stop()


# -- the watch: cut, compacted, stale ---------------------------------------------------------

def test_watch_cut_and_compacted_are_followed(kube: FakeKubeAPI, test_ca: LocalCA,
                                              upstream: Upstream, tmp_path: Path) -> None:
    gw = _gateway(tmp_path, kube, test_ca, upstream)
    try:
        pods = Pods(gw, test_ca)
        assert gw.gateway.pods is not None
        watcher = gw.gateway.pods.watcher
        assert watcher is not None
        assert kube.wait_for_watches(2)
        lists = len(kube.seen("GET", f"/api/v1/namespaces/{NS}/pods", watch=False))
        assert kube.cut_watches() >= 2
        a = kube.add_pod(NS, "after-cut", _ip(20), labels={"sandbox-gateway.io/policy": "agent"})
        assert _identified(gw, _ip(20), a["metadata"]["uid"])
        assert pods.get(_ip(20), "allowed.test", "/status/200")[0] == 200
        # A change while the history is compacted away: the watch gets 410, lists again.
        kube.cut_watches()
        kube.delete_pod(NS, "after-cut")
        kube.compact()
        assert _until(lambda: isinstance(gw.gateway.pods.index.at(_ip(20)), str))  # type: ignore[union-attr]
        assert len(kube.seen("GET", f"/api/v1/namespaces/{NS}/pods", watch=False)) > lists
        watches = kube.seen("GET", f"/api/v1/namespaces/{NS}/pods", watch=True)
        # (kubernetes_asyncio sends "True": the API server parses it with Go ParseBool)
        assert all(str(w.param("allowWatchBookmarks")).lower() == "true"
                   and w.param("resourceVersion") for w in watches)
        assert gw.gateway.pods.stale() is None
    finally:
        gw.stop()


def test_a_stale_watch_fails_closed(test_ca: LocalCA, upstream: Upstream,
                                    tmp_path: Path) -> None:
    with FakeKubeAPI(tmp_path / "kube") as kube:
        kube.add_pod(NS, "p", _ip(21), labels={"sandbox-gateway.io/policy": "agent"})
        # (3 s: the "not yet" request must come before it even on a loaded machine)
        gw = _gateway(tmp_path / "gw", kube, test_ca, upstream, stale_after="3s")
        try:
            pods = Pods(gw, test_ca)
            assert pods.get(_ip(21), "allowed.test", "/status/200")[0] == 200
            kube.stop()  # the API server goes away: nothing more is known of pods
            assert pods.get(_ip(21), "allowed.test", "/status/200")[0] == 200  # (not yet)
            # The watch is broken from the gateway's first failed attempt after the stop
            # (its open stream ends first: later on a loaded machine), and stale 3 s on:
            # refused from then on, well within 10 s.
            time.sleep(3.2)
            deadline = time.monotonic() + 10
            while True:
                status, text, _ = pods.get(_ip(21), "allowed.test", "/")
                if status == 503 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert status == 503, text
            line = _last(gw, _ip(21))
            assert line["error"] == "identity_unavailable"
            assert "heard nothing" in line["reason"] and "stale_after" in line["reason"]
            with urllib.request.urlopen(gw.admin + "/readyz", timeout=5) as response:
                ready = json.load(response)
            assert "pods are not identified" in ready["reason"], ready
        finally:
            gw.stop()


def test_a_silent_api_server_fails_closed_and_a_quiet_one_does_not(
        test_ca: LocalCA, upstream: Upstream, tmp_path: Path) -> None:
    """Staleness counts from the last word heard from the API server, not from a failed
    attempt: a server gone silent behind a dropped route (streams open, nothing sent,
    new connections never answered) is stale `stale_after` on, not when the read timeout
    ends the stream minutes later. A server that is merely quiet (no bookmarks, as with
    the watch cache off) is not: a stream silent for half of stale_after is reopened."""
    # (bookmarks never come: liveness is the watcher's to prove)
    with FakeKubeAPI(tmp_path / "kube", bookmark_interval=3600.0) as kube:
        kube.add_pod(NS, "p", _ip(22), labels={"sandbox-gateway.io/policy": "agent"})
        gw = _gateway(tmp_path / "gw", kube, test_ca, upstream, stale_after="2s")
        try:
            pods = Pods(gw, test_ca)
            assert gw.gateway.pods is not None
            assert pods.get(_ip(22), "allowed.test", "/status/200")[0] == 200
            # Quiet, for three stale_afters: never stale; streams were reopened.
            watches = len(kube.seen("GET", f"/api/v1/namespaces/{NS}/pods", watch=True))
            end = time.monotonic() + 6.0
            while time.monotonic() < end:
                assert gw.gateway.pods.stale() is None
                time.sleep(0.1)
            assert pods.get(_ip(22), "allowed.test", "/status/200")[0] == 200
            assert len(kube.seen("GET", f"/api/v1/namespaces/{NS}/pods",
                                 watch=True)) >= watches + 2  # (about 6; 0 before)
            # Silent: refused within stale_after (+ the gate's half-second sweep).
            kube.freeze()
            frozen = time.monotonic()
            assert _until(lambda: gw.gateway.pods.stale() is not None,  # type: ignore[union-attr]
                          timeout=6.0)
            waited = time.monotonic() - frozen
            assert 0.2 < waited < 4.0, waited  # (the last word came about 0-1 s before)
            status, text, _ = pods.get(_ip(22), "allowed.test", "/")
            assert status == 503, text
            line = _last(gw, _ip(22))
            assert line["error"] == "identity_unavailable"
            assert "heard nothing" in line["reason"] and "stale_after" in line["reason"]
            # Back: current again, allowed again.
            kube.thaw()
            assert _until(lambda: gw.gateway.pods.stale() is None,  # type: ignore[union-attr]
                          timeout=15.0)
            assert pods.get(_ip(22), "allowed.test", "/status/200")[0] == 200
        finally:
            kube.thaw()
            gw.stop()


# -- the token exchange ---------------------------------------------------------------------

def _exchange(gw: GatewayThread, token: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(gw.admin + "/v1/tokens/exchange", method="POST",
                                     data=json.dumps({"token": token}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.mark.parametrize("verify", ["tokenreview", "oidc"])
def test_exchange(verify: str, kube: FakeKubeAPI, test_ca: LocalCA, upstream: Upstream,
                  tmp_path: Path) -> None:
    gw = _gateway(tmp_path, kube, test_ca, upstream,
                  exchange={"verify": verify, "ttl": "10m"})
    try:
        pods = Pods(gw, test_ca)
        # A pod behind NAT: its address (here 10.99.0.5) is not where it connects from.
        pod = kube.add_pod(NS, f"nat-{verify}", "10.99.0.5", service_account="agent-x",
                           labels={"sandbox-gateway.io/policy": "limited"})
        assert _until(lambda: gw.gateway.pods is not None and gw.gateway.pods.index.get(
            NS, f"nat-{verify}") is not None)
        status, got = _exchange(gw, kube.issue_token(NS, f"nat-{verify}"))
        assert status == 200, got
        assert (got["sandbox"], got["policy"]) == (f"{NS}/nat-{verify}", "limited")
        assert got["expires_at"] - time.time() <= 600 + 1
        claims = json.loads(base64.urlsafe_b64decode(got["token"].split(".")[1] + "=="))
        assert claims["pod"]["uid"] == pod["metadata"]["uid"]
        user = urllib.parse.quote(got["sandbox"], safe="")
        auth = "Basic " + base64.b64encode(f"{user}:{got['token']}".encode()).decode()
        status, body, _ = pods.get("127.0.0.1", "allowed.test", "/status/200", auth=auth)
        assert status == 200, body
        assert _last(gw, "127.0.0.1")["workload"]["uid"] == pod["metadata"]["uid"]
        # Refused: another audience, expired, unbound to a pod's service account.
        for bad, word in [(kube.issue_token(NS, f"nat-{verify}", audience="other"),
                           "audience"),
                          (kube.issue_token(NS, f"nat-{verify}", expires_in=-60), "expire"),
                          ("not-a-token", "not a JWT")]:
            status, err = _exchange(gw, bad)
            assert status == 401 and err["error"] == "exchange_refused", err
            assert word in err["reason"], err
        # An open endpoint: what cannot be a token costs no API call, and the calls in
        # flight at once are bounded.
        reviews = len(kube.seen("POST"))
        assert _exchange(gw, "x" * 100_000)[0] == 401
        assert len(kube.seen("POST")) == reviews
        assert gw.gateway.pods is not None
        gw.gateway.pods._verifying = 32
        try:
            status, err = _exchange(gw, kube.issue_token(NS, f"nat-{verify}"))
            assert status == 503 and err["error"] == "exchange_busy", err
        finally:
            gw.gateway.pods._verifying = 0
        # A pod whose service account the policy's subjects do not admit.
        kube.add_pod(NS, f"web-{verify}", "10.99.0.6", service_account="web",
                     labels={"sandbox-gateway.io/policy": "limited"})
        assert _until(lambda: gw.gateway.pods.index.get(NS, f"web-{verify}"))  # type: ignore[union-attr]
        status, err = _exchange(gw, kube.issue_token(NS, f"web-{verify}"))
        assert status == 403 and "does not admit" in err["reason"], err
        # The pod goes: its exchanged token stops working, open tunnels end, no new one.
        stale_token = kube.issue_token(NS, f"nat-{verify}")
        kube.delete_pod(NS, f"nat-{verify}")
        assert _until(lambda: gw.gateway.pods.index.get(NS, f"nat-{verify}") is None)  # type: ignore[union-attr]
        status, text, _ = pods.get("127.0.0.1", "allowed.test", "/", auth=auth)
        assert status == 407 and "identity_unknown" in text, text
        status, err = _exchange(gw, stale_token)
        assert status in (401, 403), err  # TokenReview: not authenticated; OIDC: pod gone
        assert gw.call(_no_secret_in_audit(gw, got["token"]))
        kube.delete_pod(NS, f"web-{verify}")
        if verify == "tokenreview":
            _cli_exchange(gw, kube, pods, tmp_path)
    finally:
        gw.stop()


def _cli_exchange(gw: GatewayThread, kube: FakeKubeAPI, pods: Pods, tmp_path: Path) -> None:
    """`sandbox-gateway token exchange` from inside a pod: the projected file in, the
    proxy URL out, and that URL works."""
    kube.add_pod(NS, "cli-pod", "10.99.0.7", labels={"sandbox-gateway.io/policy": "agent"})
    assert _until(lambda: gw.gateway.pods.index.get(NS, "cli-pod"))  # type: ignore[union-attr]
    projected = tmp_path / "token"
    projected.write_text(kube.issue_token(NS, "cli-pod"))
    out = subprocess.run([sys.executable, "-m", "gateway", "token", "exchange", "--gateway",
                          gw.admin, "--token-file", str(projected), "--proxy", gw.proxy],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    url = out.stdout.splitlines()[0].partition("=")[2]
    parts = urllib.parse.urlsplit(url)
    assert urllib.parse.unquote(parts.username or "") == f"{NS}/cli-pod"
    auth = "Basic " + base64.b64encode(
        f"{parts.username}:{parts.password}".encode()).decode()
    assert pods.get("127.0.0.1", "allowed.test", "/status/200", auth=auth)[0] == 200
    bad = tmp_path / "other-audience"
    bad.write_text(kube.issue_token(NS, "cli-pod", audience="vault"))
    out = subprocess.run([sys.executable, "-m", "gateway", "token", "exchange", "--gateway",
                          gw.admin, "--token-file", str(bad)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1 and "401 exchange_refused" in out.stderr, out.stderr
    kube.delete_pod(NS, "cli-pod")


def test_env_kubernetes_prints_no_token() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway", "env", "--kubernetes", "--proxy",
                          "http://sandbox-gateway.gw:8080"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert lines["HTTPS_PROXY"] == "http://sandbox-gateway.gw:8080"
    assert lines["OPENAI_API_KEY"] == "sandbox-gateway-pod-identity"
    assert "eyJ" not in out.stdout


async def _no_secret_in_audit(gw: GatewayThread, token: str) -> bool:
    text = json.dumps(gw.audit.records())
    return token not in text and token.split(".")[2] not in text


def test_every_worker_process_knows_the_pods(kube: FakeKubeAPI, tmp_path: Path) -> None:
    """`run --workers 2`: each worker watches the pods itself; a pod's connections,
    whichever worker the kernel hands them to, are that pod."""
    from test_worker_processes import _two_workers

    pod = kube.add_pod(NS, "workers-pod", _ip(50), labels={"sandbox-gateway.io/policy": "agent"})
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    (tmp_path / "gw").mkdir()
    gw, proxy, _, _ = _two_workers(tmp_path / "gw", audit={"path": "audit.jsonl"},
                                   identity={"kubernetes": {
                                       "enabled": True, "namespaces": [NS],
                                       "kubeconfig": str(kubeconfig)}})
    try:
        def connect(source: str) -> bytes:
            with socket.create_connection(("127.0.0.1", proxy), timeout=5,
                                          source_address=(source, 0)) as sock:
                sock.sendall(b"CONNECT nothere.test:443 HTTP/1.1\r\nHost: nothere.test\r\n\r\n")
                return sock.recv(4096)

        deadline = time.monotonic() + 10  # (each worker lists the pods once it runs)
        while b"403" not in connect(_ip(50)) and time.monotonic() < deadline:
            time.sleep(0.1)
        answers = [connect(_ip(50)) for _ in range(30)]
        assert all(a.startswith(b"HTTP/1.1 403") for a in answers), answers[:3]
        assert connect(_ip(51)).startswith(b"HTTP/1.1 407")
        audit = tmp_path / "gw" / "audit.jsonl"
        lines = [json.loads(x) for x in audit.read_text().splitlines() if x.strip()]
        mine = [x for x in lines if x["sandbox"] == f"{NS}/workers-pod"]
        assert {x["worker"] for x in mine} == {0, 1}, {x["worker"] for x in mine}
        assert all(x["workload"]["uid"] == pod["metadata"]["uid"] for x in mine)
    finally:
        gw.terminate()
        gw.wait(30)
        if gw.stderr is not None:
            gw.stderr.close()
        kube.delete_pod(NS, "workers-pod")
