"""The pod index (services/identity/kubernetes/pods.py): who an address is, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.identity import Identity
from gateway.services.identity.kubernetes.pods import PodIndex, Policies, pod_from

LABEL = "sandbox-gateway.io/policy"


def _obj(name: str, ip: str | None = "10.0.0.5", *, ns: str = "sb", phase: str = "Running",
         labels: dict[str, str] | None = None, deleting: bool = False, host: bool = False,
         uid: str | None = None, ips: list[str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": ns, "name": name, "uid": uid or f"uid-{name}",
                            "labels": {LABEL: "agent"} if labels is None else labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T00:00:00Z"
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    if ips:
        status["podIPs"] = [{"ip": i} for i in ips]
    return {"metadata": meta, "spec": {"serviceAccountName": "agent-sa", "hostNetwork": host},
            "status": status}


# (case, pods, address, the identity's sandbox or a phrase of the reason)
CASES = [
    ("a running labelled pod", [_obj("a")], "10.0.0.5", "sb/a"),
    ("nobody", [_obj("a")], "10.0.0.9", "no pod in the watched namespaces"),
    ("pending", [_obj("a", phase="Pending")], "10.0.0.5", "Pending, not Running"),
    ("being deleted", [_obj("a", deleting=True)], "10.0.0.5", "being deleted"),
    ("two pods on one address", [_obj("a"), _obj("b")], "10.0.0.5", "2 pods hold"),
    ("a deleting pod and its successor", [_obj("a", deleting=True), _obj("b")], "10.0.0.5",
     "2 pods hold"),
    ("a finished pod keeps its podIP, holds nothing", [_obj("a", phase="Succeeded"),
                                                       _obj("b")], "10.0.0.5", "sb/b"),
    ("only a finished pod", [_obj("a", phase="Failed")], "10.0.0.5", "do not hold it"),
    ("host network shares the node's address", [_obj("a", host=True)], "10.0.0.5",
     "host network"),
    ("no label, no default", [_obj("a", labels={})], "10.0.0.5", "no sandbox-gateway.io"),
    ("no label, the namespace's default", [_obj("a", ns="batch", labels={})], "10.0.0.5",
     "batch/a"),
    ("dual stack: the second address", [_obj("a", ips=["10.0.0.5", "fd00::5"])], "fd00::5",
     "sb/a"),
    ("another spelling of the IPv6 address", [_obj("a", ips=["FD00:0::5"])], "fd00::0:5",
     "sb/a"),
    ("an IPv4-mapped peer (a dual-stack listener)", [_obj("a")], "::ffff:a00:5", "sb/a"),
    ("an IPv4-mapped peer, dotted", [_obj("a")], "::ffff:10.0.0.5", "sb/a"),
    ("a zone", [_obj("a", ips=["fe80::5"])], "fe80::5%eth0", "sb/a"),
]


@pytest.mark.parametrize(("case", "pods", "ip", "expected"), CASES, ids=[c[0] for c in CASES])
def test_who_an_address_is(case: str, pods: list[dict[str, Any]], ip: str,
                           expected: str) -> None:
    index = PodIndex(Policies(LABEL, {"batch": "narrow"}))
    for obj in pods:
        index.put(pod_from(obj))
    found = index.at(ip)
    if isinstance(found, Identity):
        assert found.sandbox == expected and found.keyless and found.workload is not None
        assert found.jti == f"pod:uid-{found.workload.pod}"
    else:
        assert expected in found


def test_changes_deletes_and_relists() -> None:
    index = PodIndex()
    index.put(pod_from(_obj("a")))
    index.put(pod_from(_obj("a", ip="10.0.0.6")))  # the pod's address changed
    assert isinstance(index.at("10.0.0.5"), str)
    assert not isinstance(index.at("10.0.0.6"), str)
    index.put(pod_from(_obj("c", ns="other", ip="10.0.0.7")))
    index.replace("sb", [pod_from(_obj("b", ip="10.0.0.8"))])  # a relist: a is gone
    assert index.get("sb", "a") is None and len(index) == 2
    assert index.get("other", "c") is not None  # (another namespace's pods stay)
    index.remove("sb", "b")
    assert "no pod" in str(index.at("10.0.0.8"))


def test_running_checks_the_uid() -> None:
    index = PodIndex()
    index.put(pod_from(_obj("a", uid="u1")))
    assert index.running("sb", "a", "u1") is None
    assert "replaced" in str(index.running("sb", "a", "u0"))
    assert "gone" in str(index.running("sb", "x", "u1"))
    index.put(pod_from(_obj("a", uid="u1", deleting=True)))
    assert "being deleted" in str(index.running("sb", "a", "u1"))


def test_an_object_without_identity_is_refused() -> None:
    with pytest.raises(ValueError, match="without namespace"):
        pod_from({"metadata": {"name": "a"}})
