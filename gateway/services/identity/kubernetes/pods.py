"""The watched pods, by address and by name: who a source address is (pure, no I/O).

`PodIndex` is what the pod watcher (`watch.py`) keeps current from the API server's
list and watch events, and what the gate asks for every new connection and request
(`Workloads.identity_for`): a dict lookup, the identity built once per pod change.

An address is an identity only when exactly one pod that has not finished holds it,
and that pod is Running and not being deleted. Pods on the node's network
(`hostNetwork`) share the node's address and are never identities by address (they
exchange a token instead). A finished pod (Succeeded, Failed) keeps its `podIP` in its
status after the network has released it, so it holds nothing; a pod being deleted
still may, so its address is refused until it is gone (another pod may already have
it: the race the refusal protects against).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.core.identity import Identity, Workload

__all__ = ["DEFAULT_POLICY_LABEL", "Pod", "PodIndex", "Policies", "address", "pod_from"]

DEFAULT_POLICY_LABEL = "sandbox-gateway.io/policy"
_FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class Policies:
    """Which policy a pod's requests are judged by: its label, else its namespace's
    default (`identity.kubernetes.policy_label` and `default_policies`)."""

    label: str = DEFAULT_POLICY_LABEL
    defaults: Mapping[str, str] = field(default_factory=dict)

    def of(self, namespace: str, labels: Mapping[str, str]) -> str | None:
        return labels.get(self.label) or self.defaults.get(namespace)


@dataclass(frozen=True, slots=True)
class Pod:
    """What the gateway reads of a pod object."""

    namespace: str
    name: str
    uid: str
    ips: tuple[str, ...]
    phase: str
    deleting: bool
    service_account: str
    labels: Mapping[str, str]
    host_network: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def holds_address(self) -> bool:
        """Does this pod (may it) use its addresses? Finished pods do not; pods on the
        node's network hold the node's, never their own."""
        return not self.host_network and self.phase not in _FINISHED


def address(ip: str) -> str:
    """One spelling of an address, for pods' and connections' alike: compressed IPv6,
    an IPv4-mapped IPv6 address (a dual-stack listener's peer) as its IPv4 address, no
    zone. Text that is no address is kept as it is (it matches nothing)."""
    try:
        parsed = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    return str(parsed)


def pod_from(obj: Mapping[str, Any]) -> Pod:
    """A pod from its API object (JSON, as listed or watched). ValueError if it has no
    namespace, name or uid."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    namespace, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
    if not (isinstance(namespace, str) and isinstance(name, str) and isinstance(uid, str)):
        raise ValueError("a pod object without namespace, name or uid")
    ips = [entry.get("ip") for entry in status.get("podIPs") or () if isinstance(entry, dict)]
    if not ips and status.get("podIP"):
        ips = [status["podIP"]]
    labels = meta.get("labels") or {}
    return Pod(
        namespace=namespace, name=name, uid=uid,
        ips=tuple(address(ip) for ip in ips if isinstance(ip, str) and ip),
        phase=str(status.get("phase") or "Pending"),
        deleting=meta.get("deletionTimestamp") is not None,
        service_account=str(spec.get("serviceAccountName") or "default"),
        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {},
        host_network=bool(spec.get("hostNetwork")),
    )


class PodIndex:
    """The pods of the watched namespaces, by `namespace/name` and by address."""

    def __init__(self, policies: Policies | None = None) -> None:
        self.policies = policies or Policies()
        self._pods: dict[str, Pod] = {}
        self._by_ip: dict[str, set[str]] = {}
        self._identities: dict[str, Identity | str] = {}  # key -> identity, or why none

    def __len__(self) -> int:
        return len(self._pods)

    def get(self, namespace: str, name: str) -> Pod | None:
        return self._pods.get(f"{namespace}/{name}")

    def replace(self, namespace: str, pods: Iterable[Pod]) -> None:
        """A fresh list of `namespace`: every pod of it not listed is gone."""
        for key in [k for k, p in self._pods.items() if p.namespace == namespace]:
            self._drop(key)
        for pod in pods:
            self.put(pod)

    def put(self, pod: Pod) -> None:
        """A pod added or changed."""
        self._drop(pod.key)
        self._pods[pod.key] = pod
        for ip in pod.ips:
            self._by_ip.setdefault(ip, set()).add(pod.key)
        self._identities[pod.key] = self._identity(pod)

    def remove(self, namespace: str, name: str) -> None:
        """A pod deleted."""
        self._drop(f"{namespace}/{name}")

    def _drop(self, key: str) -> None:
        old = self._pods.pop(key, None)
        self._identities.pop(key, None)
        if old is None:
            return
        for ip in old.ips:
            holders = self._by_ip.get(ip)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._by_ip[ip]

    def at(self, ip: str) -> Identity | str:
        """The identity of the pod that holds `ip`, or why there is none."""
        ip = address(ip)
        keys = self._by_ip.get(ip)
        pods = [self._pods[k] for k in sorted(keys or ())]
        holders = [p for p in pods if p.holds_address]
        if not holders:
            if pods:
                shown = ", ".join(f"{p.key} ({'host network' if p.host_network else p.phase})"
                                  for p in pods)
                return f"the pods listed with address {ip} do not hold it: {shown}"
            return f"no pod in the watched namespaces has address {ip}"
        if len(holders) > 1:
            return (f"{len(holders)} pods hold address {ip} at once "
                    f"({', '.join(p.key for p in holders)}), so it names none of them")
        return self._identities[holders[0].key]

    def _identity(self, pod: Pod) -> Identity | str:
        if pod.deleting:
            return f"pod {pod.key} is being deleted"
        if pod.phase != "Running":
            return f"pod {pod.key} is {pod.phase}, not Running"
        policy = self.policies.of(pod.namespace, pod.labels)
        if policy is None:
            return (f"pod {pod.key} has no {self.policies.label} label and namespace "
                    f"{pod.namespace!r} has no default policy "
                    "(identity.kubernetes.default_policies)")
        return Identity(sandbox=pod.key, policy=policy, jti=f"pod:{pod.uid}", scope={},
                        issued_at=0.0, expires_at=math.inf, lifetime_end=math.inf,
                        workload=Workload(pod.namespace, pod.name, pod.uid,
                                          pod.service_account),
                        keyless=True)

    def running(self, namespace: str, name: str, uid: str) -> str | None:
        """None while pod `namespace/name` is there as `uid` and Running; else why not."""
        pod = self._pods.get(f"{namespace}/{name}")
        if pod is None:
            return "that pod is gone"
        if pod.uid != uid:
            return "that pod was replaced by another of the same name"
        if pod.deleting:
            return "that pod is being deleted"
        if pod.phase != "Running":
            return f"that pod is {pod.phase}, not Running"
        return None
