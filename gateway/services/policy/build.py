"""From raw policies to a PolicySet: resolve `extends`, check every credential a rule or
budget names (and that it can reach the rule's hosts), inherit budgets, compile."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.core.dlp.policy import Dlp
from gateway.core.policy.compiled import Policy, PolicySet, compile_policy
from gateway.core.policy.hosts import HostPattern
from gateway.core.policy.model import (
    Budget,
    Credential,
    Rule,
)
from gateway.services.policy.agents import PREFIX, SERVICE, known_agents, known_services
from gateway.services.policy.problems import Problems, shown, suggest
from gateway.services.policy.raw import CredentialDef, RawPolicy


def _can_reach(rule: HostPattern, credential: tuple[HostPattern, ...]) -> bool:
    """True if some host could match both the rule pattern and a credential pattern.

    Exact on either side is decided exactly; two wildcards overlap when one literal
    suffix is a label-suffix of the other (an over-approximation, which is fine:
    requests are still checked against both at decision time).
    """
    for cred in credential:
        if not rule.is_wildcard:
            if cred.matches(rule.text):
                return True
        elif not cred.is_wildcard:
            if rule.matches(cred.text):
                return True
        else:
            a, b = rule.suffix, cred.suffix
            if a == b or a.endswith("." + b) or b.endswith("." + a):
                return True
    return False


def _credential_problem(rule: Rule, credentials: Mapping[str, Credential], policy: str,
                        known: tuple[str, ...]) -> str | None:
    """What is wrong with the credential ``rule`` names, if anything: undefined, or
    bound to hosts the rule's host never reaches."""
    name = rule.credential
    assert name is not None
    cred = credentials.get(name)
    if cred is None:
        define = ("define it under credentials: in any policy file"
                  if not policy.startswith(PREFIX) else
                  f"{policy} injects the credential named {shown(name)}: define it, e.g. "
                  f"credentials: {{{name}: {{preset: {name}, secret: <secret name>}}}}")
        return f"unknown credential {shown(name)}{suggest(name, known)}; {define}"
    if not _can_reach(rule.host_pattern, cred.host_patterns):
        return (f'credential "{name}" is only sent to {", ".join(cred.hosts)}, which host '
                f"{rule.host_pattern.text} never reaches; fix the rule's host or use another "
                "credential")
    return None


def _by_name(read: list[RawPolicy], errors: list[tuple[str, int, str]]
             ) -> dict[str, RawPolicy]:
    """The policies by name: a name is unique across files (a second one is an error)."""
    by_name: dict[str, RawPolicy] = {}
    for raw in read:
        if raw.name in by_name:
            first = by_name[raw.name]
            errors.append((raw.file, raw.line, f'duplicate policy name "{raw.name}" (also in '
                           f"{first.file}:{first.line}); policy names must be unique across "
                           "files"))
            continue
        by_name[raw.name] = raw
    return by_name


def build_policy_set(read: list[RawPolicy], defined: Mapping[str, CredentialDef],
                     problems: Problems, revision: str = "") -> PolicySet:
    """Cross-file checks, extends resolution and compilation of the policies ``read``
    and the credentials ``defined`` (raises PolicyError with every problem)."""
    errors = problems.errors
    by_name = _by_name(read, errors)
    credentials = {name: d.credential for name, d in defined.items()}
    known_credentials = tuple(credentials)

    own_rules: dict[str, list[Rule]] = {}
    for raw in by_name.values():
        rules: list[Rule] = []
        for raw_rule in raw.rules:
            rule = raw_rule.rule
            if rule.credential is not None:
                problem = _credential_problem(rule, credentials, raw.name, known_credentials)
                if problem is not None:
                    errors.append((raw.file, raw_rule.credential_line, problem))
                    continue
            rules.append(rule)
        own_rules[raw.name] = rules

    resolved: dict[str, list[Rule]] = {}
    known_policies = tuple(name for name, raw in by_name.items() if raw.named)

    def resolve(name: str, stack: list[str]) -> list[Rule]:
        if name in resolved:
            return resolved[name]
        raw = by_name[name]
        out: list[Rule] = list(own_rules[name])
        seen = {id(r) for r in out}
        for parent, line in raw.extends:
            if parent not in known_policies:
                if parent.startswith(SERVICE):
                    hint = f"; the shipped service presets are {', '.join(known_services())}"
                elif parent.startswith(PREFIX):
                    hint = f"; the shipped agent presets are {', '.join(known_agents())}"
                else:
                    hint = suggest(parent, known_policies)
                errors.append(
                    (raw.file, line, f'policy "{name}" extends unknown policy {shown(parent)}'
                     f"{hint}")
                )
                continue
            if parent in stack:
                cycle = " -> ".join([*stack[stack.index(parent) :], parent])
                errors.append(
                    (raw.file, line, f"extends cycle {cycle}; remove one of these extends")
                )
                continue
            for rule in resolve(parent, [*stack, parent]):
                if id(rule) not in seen:
                    seen.add(id(rule))
                    out.append(rule)
        resolved[name] = out
        return out

    for name in by_name:
        resolve(name, [name])
    budgets = _budgets(by_name, resolved, credentials, errors)
    problems.raise_any()

    policies: dict[str, Policy] = {}
    for name, raw in by_name.items():
        policies[name] = compile_policy(
            name,
            resolved[name],
            mode=raw.mode,
            source=raw.file,
            extends=tuple(p for p, _ in raw.extends),
            credentials=credentials,
            budgets=budgets.get(name, ()),
            token_ttl=raw.token_ttl,
            subjects=tuple(raw.subjects),
            ask=raw.ask,
            dlp=_dlp(by_name, name, (name,)),
            telemetry_content=raw.telemetry_content,
        )
    files = tuple(dict.fromkeys(raw.file for raw in read))
    return PolicySet(policies=policies, credentials=credentials, files=files, revision=revision)


def _dlp(by_name: Mapping[str, RawPolicy], name: str, stack: tuple[str, ...]) -> Dlp | None:
    """A policy's ``dlp:``: its own, else the first parent's (in ``extends`` order,
    depth first) that has one. (Cycles were reported before this runs.)"""
    raw = by_name[name]
    if raw.dlp is not None:
        return raw.dlp
    for parent, _ in raw.extends:
        if parent in by_name and parent not in stack:
            found = _dlp(by_name, parent, (*stack, parent))
            if found is not None:
                return found
    return None


def _budgets(
    by_name: Mapping[str, RawPolicy],
    resolved: Mapping[str, list[Rule]],
    credentials: Mapping[str, Credential],
    errors: list[tuple[str, int, str]],
) -> dict[str, tuple[Budget, ...]]:
    """Each policy's budgets: its own, then inherited ones it does not redefine.

    An own budget's ``credentials`` must exist and be injected by a rule of the policy
    (a budget that could never apply is a mistake worth a file:line error).
    """
    known = tuple(credentials)
    for name, raw in by_name.items():
        injected = {r.credential for r in resolved.get(name, ()) if r.credential}
        for raw_budget in raw.budgets:
            for cred, line in raw_budget.credentials:
                if cred not in credentials:
                    errors.append((raw.file, line, f'budget "{raw_budget.budget.name}" names '
                                   f"unknown credential {shown(cred)}{suggest(cred, known)}"))
                elif cred not in injected:
                    errors.append((raw.file, line, f'budget "{raw_budget.budget.name}" limits '
                                   f'credential "{cred}", which no rule of policy "{name}" '
                                   "injects; add a rule with credential: "
                                   f"{cred} or remove it from the budget"))
    out: dict[str, tuple[Budget, ...]] = {}

    def collect(name: str, stack: tuple[str, ...]) -> tuple[Budget, ...]:
        if name in out:
            return out[name]
        raw = by_name[name]
        found: dict[str, Budget] = {b.budget.name: b.budget for b in raw.budgets}
        for parent, _ in raw.extends:
            if parent in by_name and parent not in stack:
                for budget in collect(parent, (*stack, parent)):
                    found.setdefault(budget.name, budget)
        out[name] = tuple(found.values())
        return out[name]

    for name in by_name:
        collect(name, (name,))
    return out
