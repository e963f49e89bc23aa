"""Kubernetes pod identity in namespaces of this machine's kernel: the real curl from a
pod network namespace (a veth into this host's namespace, 10.244.<n>.10) through the
explicit proxy; transparent mode with a pod and no registration (the fake API server
bound inside the lab's gateway namespace); the in-cluster configuration (the service
account's files under /run, in a private mount namespace). Nothing leaves the machine:
every namespace is linked only to this host."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fakes.kube_api import FakeKubeAPI
from helpers.netns import SANDBOX_IP, UPSTREAM_IP, transparent_lab, unavailable
from helpers.parity_cases import KEY
from helpers.tls import LocalCA
from helpers.upstream import Upstream
from test_kubernetes_identity import NS, ROOT, _gateway, _until

pytestmark = pytest.mark.netns


@pytest.fixture
def pod_ns() -> Iterator[tuple[str, str, str]]:
    """(namespace, pod address, host-side address) of a fresh pod network namespace."""
    why = unavailable()
    if why:
        pytest.fail(why)
    tag = uuid.uuid4().hex[:6]
    n = int(tag[:2], 16) % 200 + 20
    name, host_if, pod_if = f"kpod{tag}", f"kp{tag}h", f"kp{tag}p"
    host_ip, pod_ip = f"10.244.{n}.1", f"10.244.{n}.10"
    steps = [["ip", "netns", "add", name],
             ["ip", "link", "add", host_if, "type", "veth", "peer", "name", pod_if],
             ["ip", "link", "set", pod_if, "netns", name],
             ["ip", "addr", "add", f"{host_ip}/24", "dev", host_if],
             ["ip", "link", "set", host_if, "up"],
             ["ip", "-n", name, "addr", "add", f"{pod_ip}/24", "dev", pod_if],
             ["ip", "-n", name, "link", "set", pod_if, "up"],
             ["ip", "-n", name, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True, timeout=10)
        yield name, pod_ip, host_ip
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def test_curl_from_a_pod_namespace(pod_ns: tuple[str, str, str], test_ca: LocalCA,
                                   upstream: Upstream, tmp_path: Path) -> None:
    name, pod_ip, host_ip = pod_ns
    assert shutil.which("curl")
    with FakeKubeAPI(tmp_path / "kube") as kube:
        pod = kube.add_pod(NS, "curl-pod", pod_ip, labels={"sandbox-gateway.io/policy": "agent"},
                           service_account="agent-sa")
        # The proxy listens on the host side of the pod's veth (in a cluster: the
        # Service's address).
        gw = _gateway(tmp_path / "gw", kube, test_ca, upstream, listen_proxy=host_ip)
        try:
            bundle = tmp_path / "bundle.pem"
            bundle.write_text(test_ca.cert_path.read_text() + gw.ca_cert.read_text())
            assert gw.gateway.proxy_address is not None
            proxy = f"http://{host_ip}:{gw.gateway.proxy_address[1]}"

            def curl(url: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run(
                    ["ip", "netns", "exec", name, "curl", "-sS", "--max-time", "10",
                     "--proxy", proxy, "--cacert", str(bundle), "-w", "\n%{http_code}", url],
                    capture_output=True, text=True, timeout=20)

            out = curl("https://allowed.test/status/200")
            assert out.stdout.endswith("200"), out.stdout + out.stderr
            line = gw.audit.wait_for(lambda r: str(r.get("client", "")).startswith(pod_ip))
            assert line and line[-1]["sandbox"] == f"{NS}/curl-pod"
            assert line[-1]["workload"]["uid"] == pod["metadata"]["uid"]
            before = len(upstream.requests)
            out = curl("https://api.openai.com/echo-header/authorization")
            assert out.stdout.endswith("200"), out.stdout + out.stderr
            assert upstream.requests[before].headers["authorization"] == f"Bearer {KEY}"
            assert KEY not in out.stdout
            kube.delete_pod(NS, "curl-pod")
            assert _until(lambda: gw.gateway.pods is not None
                          and isinstance(gw.gateway.pods.index.at(pod_ip), str))
            out = curl("https://allowed.test/status/200")
            assert "407" in out.stdout + out.stderr, out.stdout + out.stderr
        finally:
            gw.stop()


POLICY = """
version: v1
name: agent
egress:
  - host: allowed.test           # passthrough
  - host: key.test
    credential: key
credentials:
  key: {hosts: [key.test], secret: key-secret, inject: {header: X-Api-Key}}
"""
SECRET = "real-key-for-key-test-0123456789"


def _in_netns(ns: str, start: Callable[[], object]) -> None:
    """Run `start` in a thread that entered network namespace `ns`: a server it binds
    listens there (the thread ends; the sockets stay in that namespace)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with open(f"/var/run/netns/{ns}") as handle:
                os.setns(handle.fileno(), os.CLONE_NEWNET)
            start()
        except BaseException as exc:  # (reported in the test's thread)
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    if failed:
        raise failed[0]


def test_transparent_mode_knows_a_pod_by_its_address(tmp_path: Path) -> None:
    """Transparent mode with no registration: the sandbox namespace's address is a pod's,
    and the API server (the fake, listening inside the gateway's namespace) says so."""
    why = unavailable()
    if why:
        pytest.fail(why)
    kube = FakeKubeAPI(tmp_path / "kube")
    pod = kube.add_pod(NS, "transparent-pod", SANDBOX_IP,
                       labels={"sandbox-gateway.io/policy": "agent"})

    def identity(gw_ns: str) -> dict[str, Any]:
        _in_netns(gw_ns, kube.start)
        return {"identity": {"kubernetes": {
            "enabled": True, "namespaces": [NS],
            "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig"))}}}

    try:
        with transparent_lab(tmp_path / "lab", policy=POLICY,
                             names=["allowed.test", "key.test"],
                             secrets={"key-secret": SECRET}, extra=identity) as lab:
            r = lab.sandbox_curl("https://allowed.test/hello", UPSTREAM_IP,
                                 "--cacert", str(lab.ca.cert_path))
            assert r.returncode == 0, r.stderr + lab.gateway_log
            line = lab.audit_until(lambda a: a.get("host") == "allowed.test")[-1]
            assert line["sandbox"] == f"{NS}/transparent-pod"
            assert line["workload"]["uid"] == pod["metadata"]["uid"]
            # A credential with no token anywhere: injected for the pod.
            r = lab.sandbox_curl("https://key.test/k", UPSTREAM_IP,
                                 "--cacert", str(lab.gateway_ca))
            assert r.returncode == 0, r.stderr
            assert [s for s in lab.upstream_seen() if s.get("path") == "/k"][-1][
                "headers"]["x-api-key"] == SECRET
            assert SECRET not in r.stdout
            kube.delete_pod(NS, "transparent-pod")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                r = lab.sandbox_curl("https://key.test/k", UPSTREAM_IP,
                                     "--cacert", str(lab.gateway_ca))
                if "unknown_sandbox" in r.stdout:
                    break
                time.sleep(0.1)
            assert "unknown_sandbox" in r.stdout, r.stdout + r.stderr
            assert lab.canary_hits() == 0
    finally:
        kube.stop()


def test_in_cluster_config(tmp_path: Path) -> None:
    """No kubeconfig: the gateway uses its pod's service account as a cluster gives it
    (KUBERNETES_SERVICE_HOST/PORT, the token and CA under
    /var/run/secrets/kubernetes.io/serviceaccount), here in a private mount namespace
    whose /run is a fresh tmpfs. The API server sees the service account's requests."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is missing")
    with FakeKubeAPI(tmp_path / "kube") as kube:
        kube.add_service_account("sandbox-gateway-system", "sandbox-gateway")
        sa_token = kube.request_token("sandbox-gateway-system", "sandbox-gateway", {})["token"]
        kube.add_pod(NS, "in-cluster-pod", "127.0.0.60",
                     labels={"sandbox-gateway.io/policy": "agent"})
        (tmp_path / "sa").mkdir()
        (tmp_path / "sa" / "token").write_text(sa_token)
        (tmp_path / "sa" / "ca.crt").write_text(kube.ca_path.read_text())
        (tmp_path / "policies").mkdir()
        (tmp_path / "policies" / "agent.yaml").write_text(POLICY)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            proxy = s.getsockname()[1]
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump({
            "listen": {"proxy": f"127.0.0.1:{proxy}", "admin": "127.0.0.1:0"},
            "policies": "policies", "certs": "certs", "workers": 1,
            "secrets": {"store": "env"}, "audit": {"path": "audit.jsonl"},
            "refusals": {"inside_tls": False},
            "identity": {"kubernetes": {"enabled": True, "namespaces": [NS]}}}))
        sa_dir = "/run/secrets/kubernetes.io/serviceaccount"
        script = (f"mount -t tmpfs tmpfs /run && mkdir -p {sa_dir} && "
                  f"cp {tmp_path}/sa/token {tmp_path}/sa/ca.crt {sa_dir}/ && "
                  f"exec {sys.executable} -m gateway run --config {tmp_path}/gateway.yaml")
        env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
               "KUBERNETES_SERVICE_PORT": str(kube.port)}
        gw = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               script], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            answer = b""
            while time.monotonic() < deadline and not answer.startswith(b"HTTP/1.1 403"):
                assert gw.poll() is None, gw.stderr.read() if gw.stderr else ""
                try:
                    with socket.create_connection(("127.0.0.1", proxy), timeout=5,
                                                  source_address=("127.0.0.60", 0)) as sock:
                        sock.sendall(b"CONNECT nothere.test:443 HTTP/1.1\r\n\r\n")
                        answer = sock.recv(4096)
                except OSError:
                    time.sleep(0.2)
            assert answer.startswith(b"HTTP/1.1 403"), answer  # identified, then refused
            audit = tmp_path / "audit.jsonl"
            while time.monotonic() < deadline and not audit.read_text().strip():
                time.sleep(0.05)  # (the line is written as the answer goes, not before)
            line = json.loads(audit.read_text().splitlines()[-1])
            assert line["sandbox"] == f"{NS}/in-cluster-pod", line
            users = {r.user for r in kube.seen("GET", f"/api/v1/namespaces/{NS}/pods")}
            assert users == {"system:serviceaccount:sandbox-gateway-system:sandbox-gateway"}
        finally:
            gw.terminate()
            gw.wait(30)
            if gw.stderr is not None:
                gw.stderr.close()
