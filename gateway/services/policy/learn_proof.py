"""The replay proof of a learned policy (``policy learn --replay``), by ``replay.py``:

- every learned line is allowed by the learned set, where a default-deny base (the same
  policy without rules) refuses it: the replay shows all of them newly allowed;
- no line the gateway refused is newly allowed (the destination check, leaks, denies);
- probes next to the learned requests (a path never seen, a method never seen, a host
  never seen) show what the learned policy allows beyond the lines, with the rule that
  does: a preset's own shapes, a host rule of a tunnel seen only as a tunnel, a
  ``prefix/**`` generalisation. Listed, not failed: a reviewer reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.core.policy.compiled import PolicySet, compile_policy
from gateway.services.policy.learn import Learned
from gateway.services.policy.replay import ReplayReport, replay

__all__ = ["Proof", "prove"]

_PROBE_PATH = "/sandbox-gateway-learn-probe"
_PROBE_METHOD = "DELETE"


@dataclass(slots=True)
class Proof:
    """``allowed`` of ``requests`` learned requests are allowed; ``missed`` the ones that
    are not (examples), ``leaked`` refused lines now allowed, ``beyond`` probes allowed."""

    requests: int = 0
    allowed: int = 0
    missed: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    beyond: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.allowed == self.requests and not self.missed and not self.leaked

    def lines(self) -> list[str]:
        """The proof as text for people."""
        out = [f"replay proof: {self.allowed} of {self.requests} learned requests allowed "
               f"(a default-deny base refuses them all); {len(self.leaked)} refused "
               f"requests newly allowed: {'OK' if self.ok else 'FAILED'}"]
        out += [f"  not allowed: {m}" for m in self.missed]
        out += [f"  refused before, allowed now: {m}" for m in self.leaked]
        if self.beyond:
            out.append("allowed beyond the lines (probes; review them):")
            out += [f"  {b}" for b in self.beyond]
        return out


def _examples(report: ReplayReport, category: str) -> list[str]:
    return [f"{e.describe()}: {e.new.short()}" for g in report.groups(category)
            for e in g.examples]


def _probes(learned: Learned) -> list[dict[str, Any]]:
    """Requests next to the learned ones that were never seen (see the module)."""
    seen: set[tuple[Any, ...]] = set()
    probes: list[dict[str, Any]] = []
    for rec in learned.learned:
        seen.add((rec.get("method"), rec.get("host"), rec.get("port"), rec.get("path")))
    for rec in learned.learned:
        host, port, scheme = rec.get("host"), rec.get("port"), rec.get("scheme")
        if learned.hosts.get(str(host)) != "own rules" or scheme == "tcp":
            continue
        tunnel = rec.get("method") in (None, "CONNECT")
        shapes = [("GET", _PROBE_PATH)] if tunnel else [
            (_PROBE_METHOD, rec.get("path")), ("GET", _PROBE_PATH)]
        for method, path in shapes:
            key = (method, host, port, path)
            if key not in seen:
                seen.add(key)
                probes.append({"policy": learned.policy, "method": method,
                               "scheme": "https" if tunnel else scheme, "host": host,
                               "port": port, "path": path})
    probes.append({"policy": learned.policy, "method": "GET", "scheme": "https",
                   "host": "learn-probe.invalid", "port": 443, "path": "/"})
    return probes


def prove(learned: Learned, head: PolicySet) -> Proof:
    """Replay ``learned``'s lines under ``head`` (the policies with the learned file) and a
    default-deny base; see the module for what is checked."""
    name = learned.policy
    base = PolicySet(policies={name: compile_policy(name, [], credentials=head.credentials)},
                     credentials=head.credentials)
    learn_all = PolicySet(policies={name: compile_policy(
        name, [], mode="learn", credentials=head.credentials)}, credentials=head.credentials)
    proof = Proof()
    lines = [json.dumps(r) for r in learned.learned]
    report = replay(lines, base, head)
    proof.requests, proof.allowed = report.requests, report.count("newly_allowed")
    if proof.allowed != proof.requests:
        proof.missed = _examples(replay(lines, learn_all, head), "newly_denied")
    proof.leaked = _examples(replay([json.dumps(r) for r in learned.refused], base, head),
                             "newly_allowed")
    proof.beyond = _examples(replay([json.dumps(p) for p in _probes(learned)], base, head),
                             "newly_allowed")
    return proof
