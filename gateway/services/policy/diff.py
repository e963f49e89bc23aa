"""What a policy change changes, rule by rule (``replay`` has the traffic side).

Per policy, its own rules (inherited ones are reported once, on the policy that
writes them, with the policies that inherit them). A rule's identity is its host
pattern and protocol within the policy; a rule with the same identity whose ports,
methods, paths, credential or inspect differ is *changed*. Several rules with one
identity are paired identical-first, then in file order. Also: policies added or
removed, ``mode`` and ``extends`` changes, credentials added, removed or changed.
Pure: two PolicySets in, a SetDiff out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.core.policy.compiled import PolicySet
from gateway.core.policy.injection import Injection
from gateway.core.policy.model import Credential, Rule
from gateway.services.policy.testing import relative_source

__all__ = [
    "CredentialChange",
    "PolicyDiff",
    "RuleChange",
    "SetDiff",
    "diff_sets",
]

Kind = Literal["added", "removed", "changed"]
Field = tuple[str, str, str]

# --------------------------------------------------------------------------------------
# Rule-level diff
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RuleChange:
    """One rule added, removed or changed (``fields``: (name, old, new))."""

    kind: Kind
    label: str
    summary: str
    old_source: str | None
    new_source: str | None
    fields: tuple[Field, ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyDiff:
    """The changes of one policy; ``affects`` are the policies that inherit its rules."""

    name: str
    kind: Kind
    source: str | None
    fields: tuple[Field, ...] = ()
    rules: tuple[RuleChange, ...] = ()
    affects: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CredentialChange:
    """One credential added, removed or changed. Secrets are named, never read."""

    name: str
    kind: Kind
    summary: str
    fields: tuple[Field, ...] = ()


@dataclass(frozen=True, slots=True)
class SetDiff:
    """The rule-level difference between a base set and the proposed (head) set."""

    base_label: str
    base_revision: str
    head_label: str
    head_revision: str
    policies: tuple[PolicyDiff, ...]
    credentials: tuple[CredentialChange, ...]

    @property
    def empty(self) -> bool:
        return not self.policies and not self.credentials

    def to_dict(self) -> dict[str, Any]:
        def fields(items: tuple[Field, ...]) -> list[dict[str, str]]:
            return [{"field": f, "old": a, "new": b} for f, a, b in items]

        return {
            "base": {"label": self.base_label, "revision": self.base_revision},
            "head": {"label": self.head_label, "revision": self.head_revision},
            "policies": [
                {"name": p.name, "change": p.kind, "source": p.source,
                 "fields": fields(p.fields), "affects": list(p.affects),
                 "rules": [{"change": r.kind, "rule": r.label, "summary": r.summary,
                            "old_source": r.old_source, "new_source": r.new_source,
                            "fields": fields(r.fields)} for r in p.rules]}
                for p in self.policies
            ],
            "credentials": [{"name": c.name, "change": c.kind, "summary": c.summary,
                             "fields": fields(c.fields)} for c in self.credentials],
        }


def _rule_fields(rule: Rule) -> tuple[tuple[str, str], ...]:
    return (
        ("ports", "default (443, 80)" if rule.ports is None else ", ".join(map(str, rule.ports))),
        ("methods", "any" if rule.methods is None else ", ".join(rule.methods)),
        ("paths", "any" if rule.paths is None else ", ".join(rule.paths)),
        ("credential", rule.credential or "none"),
        ("inspect", "true" if rule.inspect else "false"),
    )


def _rule_label(rule: Rule) -> str:
    return rule.host if rule.protocol == "http" else f"{rule.host} ({rule.protocol})"


def _diff_rules(old: tuple[Rule, ...], new: tuple[Rule, ...], base_root: str,
                head_root: str) -> list[RuleChange]:
    def group(rules: tuple[Rule, ...]) -> dict[tuple[str, str], list[Rule]]:
        out: dict[tuple[str, str], list[Rule]] = {}
        for rule in rules:
            out.setdefault((rule.host, rule.protocol), []).append(rule)
        return out

    old_by, new_by = group(old), group(new)
    changes: list[RuleChange] = []
    for key in list(dict.fromkeys([*old_by, *new_by])):
        before, after = list(old_by.get(key, [])), list(new_by.get(key, []))
        for rule in list(before):  # identical rules on both sides are unchanged
            twin = next((r for r in after if _rule_fields(r) == _rule_fields(rule)), None)
            if twin is not None:
                before.remove(rule)
                after.remove(twin)
        for a, b in zip(before, after, strict=False):
            fields = tuple((name, x, y) for (name, x), (_, y)
                           in zip(_rule_fields(a), _rule_fields(b), strict=True) if x != y)
            changes.append(RuleChange("changed", _rule_label(b), b.describe(),
                                      relative_source(a.source, base_root),
                                      relative_source(b.source, head_root), fields))
        for a in before[len(after):]:
            changes.append(RuleChange("removed", _rule_label(a), a.describe(),
                                      relative_source(a.source, base_root), None))
        for b in after[len(before):]:
            changes.append(RuleChange("added", _rule_label(b), b.describe(), None,
                                      relative_source(b.source, head_root)))
    return changes


def _dependents(policy_set: PolicySet, name: str) -> list[str]:
    """Policies that inherit ``name``'s rules, directly or through others."""
    out: list[str] = []
    for other in policy_set.policies.values():
        if other.name != name and any(r.policy == name for r in other.rules):
            out.append(other.name)
    return sorted(out)


def _injection_text(injection: Injection) -> str:
    parts = []
    for carrier in injection.carriers:
        if carrier.kind == "bearer":
            parts.append("Authorization: Bearer")
        else:
            parts.append(f"{carrier.kind} {carrier.name}")
    return " or ".join(parts)


def _credential_fields(c: Credential) -> tuple[tuple[str, str], ...]:
    if c.mint is not None:  # minted: its type and fields (secret fields are names)
        return (("type", c.mint.type), *((k, str(v)) for k, v in c.mint.options),
                ("hosts", ", ".join(c.hosts)))
    return (
        ("preset", c.preset or "none"),
        ("secret", c.secret),
        ("hosts", ", ".join(c.hosts)),
        ("inject", _injection_text(c.injection)),
    )


def _credential_summary(c: Credential) -> str:
    return "; ".join(f"{k}: {v}" for k, v in _credential_fields(c))


def diff_sets(base: PolicySet, head: PolicySet, *, base_root: str = "", head_root: str = "",
              base_label: str = "base", head_label: str = "head",
              base_revision: str | None = None) -> SetDiff:
    """The rule-level difference from ``base`` to ``head`` (roots trim rule sources)."""
    policies: list[PolicyDiff] = []
    for name in sorted(set(base.policies) | set(head.policies)):
        old, new = base.policies.get(name), head.policies.get(name)
        if old is None and new is not None:
            rules = _diff_rules((), new.own_rules, base_root, head_root)
            policies.append(PolicyDiff(name, "added", relative_source(new.source, head_root),
                                       rules=tuple(rules)))
            continue
        if new is None and old is not None:
            rules = _diff_rules(old.own_rules, (), base_root, head_root)
            policies.append(PolicyDiff(name, "removed", relative_source(old.source, base_root),
                                       rules=tuple(rules)))
            continue
        assert old is not None and new is not None
        fields: list[Field] = []
        if old.mode != new.mode:
            fields.append(("mode", old.mode, new.mode))
        if old.extends != new.extends:
            fields.append(("extends", ", ".join(old.extends) or "none",
                           ", ".join(new.extends) or "none"))
        rules = _diff_rules(old.own_rules, new.own_rules, base_root, head_root)
        if fields or rules:
            affects = _dependents(head, name) if rules else []
            policies.append(PolicyDiff(name, "changed", relative_source(new.source, head_root),
                                       tuple(fields), tuple(rules), tuple(affects)))
    credentials: list[CredentialChange] = []
    for name in sorted(set(base.credentials) | set(head.credentials)):
        a, b = base.credentials.get(name), head.credentials.get(name)
        if a is None and b is not None:
            credentials.append(CredentialChange(name, "added", _credential_summary(b)))
        elif b is None and a is not None:
            credentials.append(CredentialChange(name, "removed", _credential_summary(a)))
        elif a is not None and b is not None:
            changed = tuple((k, x, y) for (k, x), (_, y)
                            in zip(_credential_fields(a), _credential_fields(b), strict=True)
                            if x != y)
            if changed:
                credentials.append(CredentialChange(name, "changed", _credential_summary(b),
                                                    changed))
    return SetDiff(base_label, base_revision or base.revision, head_label, head.revision,
                   tuple(policies), tuple(credentials))
