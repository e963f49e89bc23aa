"""A compiled policy: its rules with their index (the matcher), the set of loaded
policies, and the two calls every caller uses: ``compile_policy`` and ``decide``.

Apart from the model (rules, credentials, decisions) and the matcher (the index) so
that neither imports the other's owner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gateway.core.dlp.policy import Dlp
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.matcher import Matcher
from gateway.core.policy.model import (
    Budget,
    Credential,
    Decision,
    Mode,
    Request,
    Rule,
    Subject,
)

__all__ = ["Policy", "PolicySet", "compile_policy", "decide", "learning"]


@dataclass(frozen=True, slots=True, eq=False)
class Policy:
    """One named policy: its own and inherited rules, in order, and their compiled index.

    Build it with ``matcher.compile_policy``. ``source`` is the file it came from.
    ``budgets`` are its own and inherited budgets (an own budget replaces an inherited
    one of the same name). ``token_ttl`` (``tokens: {ttl: 8h}``, not inherited) is the
    lifetime of a token minted for it without a TTL of its own. ``subjects`` (not
    inherited): the Kubernetes workloads that may be this policy's sandboxes (empty:
    any); a pod labelled with a policy that does not admit it is no identity. ``ask``
    (not inherited): what a person may approve that no rule allows (ask mode). ``dlp``
    (inherited: its own, else the first parent's in ``extends`` order that has one): the
    ``dlp:`` section every rule's own resolves over (outbound credential detection); with
    it, every HTTP rule is intercepted. ``telemetry_content`` (``telemetry: {content:
    true}``, not inherited): its exchanges' content (prompts, completions, MCP arguments
    and results), redacted, goes with their spans to the OpenTelemetry collector.
    """

    name: str
    mode: Mode
    source: str
    rules: tuple[Rule, ...]
    extends: tuple[str, ...]
    matcher: Matcher = field(repr=False)
    budgets: tuple[Budget, ...] = ()
    token_ttl: float | None = None
    subjects: tuple[Subject, ...] = ()
    ask: Ask | None = None
    dlp: Dlp | None = None
    telemetry_content: bool = False

    def admits(self, namespace: str, service_account: str) -> bool:
        """May this workload be one of the policy's sandboxes (its `subjects`)?"""
        return not self.subjects or any(
            s.admits(namespace, service_account) for s in self.subjects)

    # Credentials its rules inject (a token's default scope), and under ``mode: learn``
    # those it may inject where no rule does: read on every request (a token's scope), so
    # made once. (A tuple: a caller cannot change it for the next one.)
    credential_names: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "credential_names", tuple(sorted(
            {r.credential for r in self.rules if r.credential}
            | {c.name for c in self.matcher.learnable})))

    @property
    def own_rules(self) -> tuple[Rule, ...]:
        """Rules written in this policy's own file (not inherited)."""
        return tuple(r for r in self.rules if r.policy == self.name)


@dataclass(frozen=True, slots=True, eq=False)
class PolicySet:
    """Every loaded policy by name, plus the global credentials they reference.

    ``revision`` says what the set was loaded from: a git commit (``<sha>`` or
    ``<sha>-dirty``), a ``REVISION`` file's text, or ``sha256:<12 hex>`` of the files
    (see ``revision.policy_revision``); the same files give the same revision.
    """

    policies: Mapping[str, Policy]
    credentials: Mapping[str, Credential]
    files: tuple[str, ...] = ()
    revision: str = ""

    def get(self, name: str) -> Policy | None:
        """The policy called ``name``, or None."""
        return self.policies.get(name)

    @property
    def uses_dlp(self) -> bool:
        """True if any policy or rule has a `dlp:` section that turns detection on (the
        detectors are built at start then)."""
        return any((p.dlp is not None and p.dlp.enabled)
                   or any(r.dlp is not None and r.dlp.enabled for r in p.rules)
                   for p in self.policies.values())

    @property
    def exports_content(self) -> bool:
        """True if any policy exports its exchanges' content (``telemetry: {content:
        true}``: redacted by the detectors, built at start then with an exporter)."""
        return any(p.telemetry_content for p in self.policies.values())

    @property
    def rule_count(self) -> int:
        """Rules as written in the files (inherited copies not counted twice)."""
        return sum(len(p.own_rules) for p in self.policies.values())


def compile_policy(
    name: str,
    rules: Iterable[Rule],
    *,
    mode: Mode = "enforce",
    source: str = "<memory>",
    extends: tuple[str, ...] = (),
    credentials: Mapping[str, Credential] | None = None,
    budgets: tuple[Budget, ...] = (),
    token_ttl: float | None = None,
    subjects: tuple[Subject, ...] = (),
    ask: Ask | None = None,
    dlp: Dlp | None = None,
    telemetry_content: bool = False,
) -> Policy:
    """Build a Policy with its index. Every credential a rule names must be in ``credentials``."""
    rule_tuple = tuple(rules)
    matcher = Matcher(name, mode, source, rule_tuple, credentials or {}, dlp=dlp)
    return Policy(
        name=name, mode=mode, source=source, rules=rule_tuple, extends=extends, matcher=matcher,
        budgets=budgets, token_ttl=token_ttl, subjects=subjects, ask=ask, dlp=dlp,
        telemetry_content=telemetry_content,
    )


def decide(policy: Policy, request: Request) -> Decision:
    """The decision for one request (``method`` None = tunnel level). Pure, no I/O."""
    if request.method is None:
        return policy.matcher.decide_tunnel(request)
    return policy.matcher.decide_request(request)


def learning(policy_set: PolicySet) -> PolicySet:
    """``policy_set`` with every policy in ``mode: learn`` (``run --learn``)."""
    policies = {name: compile_policy(
        name, p.rules, mode="learn", source=p.source, extends=p.extends,
        credentials=policy_set.credentials, budgets=p.budgets, token_ttl=p.token_ttl,
        subjects=p.subjects, ask=p.ask, dlp=p.dlp, telemetry_content=p.telemetry_content)
        for name, p in policy_set.policies.items()}
    return PolicySet(policies=policies, credentials=policy_set.credentials,
                     files=policy_set.files, revision=policy_set.revision)
