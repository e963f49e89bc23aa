"""Parity, Kubernetes pod identity: the parity table's rows through every in-process engine
(`h1`, `mitmproxy`, `h2`) with the sandbox known by its address instead of a token.

Each row runs from its own pod (a loopback address the fake API server lists as the pod's
IP, so per-sandbox state such as budgets starts fresh), with no proxy credentials. A row
must give what the table says on every engine (the same answer, the same decision
fields); rows about an expired or revoked proxy token do not apply (a pod has none).
Transparent mode with a pod runs in test_kubernetes_netns.py.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from fakes.kube_api import FakeKubeAPI
from helpers.gateway import GatewayThread
from helpers.mcp_consent import consenting
from helpers.parity import SharedDecisions, Spec, run, shared_decisions
from helpers.parity_cases import (
    CASES,
    ENGINES,
    POLICIES,
    SECRETS,
    Case,
    build_spec,
    deciding_line,
    decision_fields,
    new_lines,
    primes,
)
from helpers.tls import LocalCA
from helpers.upstream import Upstream
from test_parity import expected_engine

from gateway.net.resolver import StaticResolver

NS = "sandboxes"
NAMES = ["allowed.test", "other.test", "unbound.test", "api.openai.com", "minted.test",
         "mintfail.test", "budget.test", "metered.test", "sigv4.test"]
# Rows about an expired or revoked proxy token do not arise: a pod carries none.
ROWS = [c for c in CASES if c.token == "valid"]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(tmp_path_factory.mktemp("kube")) as fake:
        yield fake


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest, kube: FakeKubeAPI, test_ca: LocalCA,
           upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, GatewayThread]]:
    name = request.param
    work = tmp_path_factory.mktemp(f"pods-{name}")
    (work / "policies").mkdir()
    for file, text in POLICIES.items():  # (each row's pod names its case's policy)
        (work / "policies" / file).write_text(text)
    secrets = work / "secrets.yaml"
    secrets.write_text("".join(f"{k}: {v}\n" for k, v in SECRETS.items()))
    secrets.chmod(0o600)
    gw = GatewayThread(work, {
        "network": {"upstream_ca": str(test_ca.cert_path),
                    "intercept": "mitmproxy" if name == "mitmproxy" else "fast",
                    "resolve": {n: f"127.0.0.1:{upstream.port}" for n in NAMES}},
        "secrets": {"store": "file", "path": str(secrets)},
        "identity": {"kubernetes": {
            "enabled": True, "namespaces": [NS],
            "kubeconfig": str(kube.write_kubeconfig(work / "kubeconfig"))}},
    }, resolver=StaticResolver({}))
    try:
        yield name, gw
    finally:
        gw.stop()


_pods: dict[tuple[str, str], str] = {}  # (engine, row) -> the row's pod address


def _pod(kube: FakeKubeAPI, gw: GatewayThread, engine: str, row: str,
         policy: str = "agent") -> str:
    """A pod of its own for a row on an engine (a fresh sandbox: budgets, limits),
    labelled with the row's policy."""
    key = (engine, row)
    if key not in _pods:
        n = len(_pods) + 1
        ip = f"127.0.{1 + n // 250}.{1 + n % 250}"
        kube.add_pod(NS, f"row-{n}", ip, labels={"sandbox-gateway.io/policy": policy})
        _pods[key] = ip
    ip = _pods[key]

    async def known() -> bool:  # (read on the gateway's loop, which updates the index:
        # read from this thread, a pod half added raised KeyError)
        assert gw.gateway.pods is not None
        return not isinstance(gw.gateway.pods.index.at(ip), str)

    deadline = time.monotonic() + 5
    while not gw.call(known()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return ip




@pytest.fixture(scope="session")
def decisions(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> SharedDecisions:
    """Each row's decision fields on every engine, across the run's processes."""
    return shared_decisions(request.config, tmp_path_factory.getbasetemp(), "parity-pods")


def _consent(case: Case, gw: GatewayThread, upstream: Upstream,
             test_ca: LocalCA) -> contextlib.AbstractContextManager[None]:
    """A person completing the MCP OAuth consent the row's request is held for."""
    if not case.consent:
        return contextlib.nullcontext()
    return consenting(gw, upstream.port, test_ca.cert_path)


def _spec(case: Case, gw: GatewayThread, test_ca: LocalCA, engine: str, ip: str) -> Spec:
    assert gw.gateway.proxy_address is not None
    cafile = str(test_ca.cert_path) if case.extra.get("upstream_ca") else str(gw.ca_cert)
    # {TOKEN} is a gateway token the pod holds all the same (another sandbox's, leaked):
    # in a key slot it is replaced like any placeholder; anywhere else the leak checks
    # must still stop it.
    spec = build_spec(case, gw.mint("agent", "leaked-1"), proxy=gw.gateway.proxy_address,
                      proxy_auth=None, cafile=cafile, source=ip)
    return replace(spec, h2=engine == "h2")


@pytest.mark.parametrize("case", ROWS, ids=[c.name for c in ROWS])
def test_row(engine: tuple[str, GatewayThread], case: Case, decisions: SharedDecisions,
             kube: FakeKubeAPI, upstream: Upstream, test_ca: LocalCA) -> None:
    name, gw = engine
    if name not in case.engines:
        pytest.skip(f"{case.name}: not an {name} shape")
    ip = _pod(kube, gw, name, case.name, case.policy)
    for primer in primes(case):
        with _consent(primer, gw, upstream, test_ca):
            run(_spec(primer, gw, test_ca, name, ip))
    gw.settle()  # (a primer's lines all written: none counted as the case's)
    before_lines = len(gw.audit.records())
    before_seen = len(upstream.requests)
    with _consent(case, gw, upstream, test_ca):
        result = run(_spec(case, gw, test_ca, name, ip))
    stage, status, code = case.see
    if case.streamed and name == "mitmproxy":
        stage, status, code = "closed", None, None
    assert (result.stage, result.status, result.code) == (stage, status, code), result
    lines = new_lines(gw.audit.records, before_lines, case.lines, gw.settle)
    assert len(lines) == case.lines, lines
    line = deciding_line(lines)
    for key, want in case.audit.items():
        if key in ("sandbox", "jti"):
            continue
        assert line[key] == want, (key, line)
    assert line["workload"] is not None and line["workload"]["namespace"] == NS, line
    assert line["engine"] == expected_engine(name, line), (name, line["engine"], line)
    if case.check is not None:
        case.check(result, upstream.requests[before_seen:])
    fields = decision_fields(line)
    if fields["credential"] and "(sandbox:" in fields["credential"]:
        # (an MCP OAuth grant per sandbox: this row's pod's, whose name is the engine's)
        pod = f"(sandbox:{line['sandbox']})"
        assert fields["credential"].endswith(pod), (fields, pod)
        fields["credential"] = fields["credential"].replace(pod, "(sandbox: the row's pod)")
    seen = decisions.record(case.name, name, fields)
    # The same decision on every engine that ran the row (in whichever process).
    assert len({json.dumps(v, sort_keys=True) for v in seen.values()}) == 1, seen
