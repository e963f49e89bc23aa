"""Agent presets shipped with the gateway: policies for the agent CLIs people run, used as
``extends: [agent/codex]``.

Each preset (``<name>.yaml`` here, rules sourced as ``agent/<name>.yaml:<line>``) holds the
agent's provider rule (its credential, by a conventional name the extending policy
defines, and ``models: ["*"]`` so only model calls use it) and the agent's other calls
(settings, plugins, registries) as rules with ``paths``, which the matcher tries before the
host's provider rule: a settings or telemetry call is never judged as an inference call.

Rules marked ``telemetry: true`` (telemetry, experiments, update checks) follow the
extending policy's switch: ``agent/codex`` refuses them (403 ``policy_denied`` with a
reason, which the agents tolerate), ``{agent/codex: {telemetry: allow}}`` allows them.
Only the presets a policy extends are loaded, once per telemetry setting.

Service presets (``service/github-read``..., in ``policy/services``) load the same way,
without options.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from importlib import resources
from typing import TYPE_CHECKING

from gateway.services.policy.raw import RawPolicy

if TYPE_CHECKING:
    from gateway.core.policy.compiled import PolicySet

__all__ = ["PREFIX", "SERVICE", "TELEMETRY", "add_agent_presets", "known_agents",
           "known_services", "preset_lines", "variant"]

PREFIX = "agent/"
SERVICE = "service/"
_SERVICES = "gateway.services.policy.services"
TELEMETRY = ("deny", "allow")


def _shipped(package: str | None, prefix: str) -> tuple[str, ...]:
    files = resources.files(package or "")
    return tuple(sorted(prefix + f.name.removesuffix(".yaml") for f in files.iterdir()
                        if f.name.endswith(".yaml")))


def known_agents() -> tuple[str, ...]:
    """The shipped agent presets' names (``agent/codex``...), sorted."""
    return _shipped(__package__, PREFIX)


def known_services() -> tuple[str, ...]:
    """The shipped service presets' names (``service/pypi``...), sorted."""
    return _shipped(_SERVICES, SERVICE)


def variant(agent: str, telemetry: str) -> str:
    """The name a policy extends for ``agent`` with that telemetry setting."""
    return agent if telemetry == "deny" else f"{agent} (telemetry: {telemetry})"


def _split(name: str) -> tuple[str, str]:
    agent, _, rest = name.partition(" (telemetry: ")
    return agent, rest.rstrip(")") or "deny"


def add_agent_presets(policies: list[RawPolicy],
                      read: Callable[[str, str], list[RawPolicy]]) -> None:
    """Add to ``policies`` the presets they extend, one raw policy per telemetry setting
    asked for (each preset read once with ``read(file, text)``, as the shipped file
    ``agent/<name>.yaml``)."""
    wanted: dict[str, set[str]] = {}
    services: set[str] = set()
    for policy in policies:
        for name, _ in policy.extends:
            if name.startswith(SERVICE):
                services.add(name)
            elif name.startswith(PREFIX):
                agent, telemetry = _split(name)
                wanted.setdefault(agent, set()).add(telemetry)
    shipped = set(known_services())
    for service in sorted(services & shipped):
        text = resources.files(_SERVICES).joinpath(
            service.removeprefix(SERVICE) + ".yaml").read_text("utf-8")
        policies.extend(p for p in read(service + ".yaml", text) if p.name == service)
    if not wanted:
        return
    known = set(known_agents())
    for agent, settings in sorted(wanted.items()):
        if agent not in known:
            continue  # build reports the unknown parent, with the shipped names
        text = resources.files(__package__).joinpath(
            agent.removeprefix(PREFIX) + ".yaml").read_text("utf-8")
        base = [p for p in read(agent + ".yaml", text) if p.name == agent]
        if len(base) != 1:  # a broken shipped file: its own errors say why
            continue
        policies.extend(_with_telemetry(base[0], telemetry) for telemetry in sorted(settings))


def _with_telemetry(preset: RawPolicy, telemetry: str) -> RawPolicy:
    """The preset with its telemetry rules allowed or refused (with a reason), its rules
    named after the variant."""
    name = variant(preset.name, telemetry)
    rules = []
    for raw in preset.rules:
        if raw.telemetry and telemetry == "deny":
            reason = (f"{preset.name} turns the agent's telemetry off; extend "
                      f"{{{preset.name}: {{telemetry: allow}}}} to send it")
            raw = replace(raw, rule=replace(  # what only an allow rule takes (ALLOW_ONLY) goes
                raw.rule, policy=name, action="deny", reason=reason, credential=None,
                inspect=False, models=None, metering=None, allow_minted_secrets=False,
                mcp=None, ask=None, unmetered=None))
        elif raw.rule.policy != name:
            raw = replace(raw, rule=replace(raw.rule, policy=name))
        rules.append(raw)
    return replace(preset, name=name, rules=rules)


def preset_lines(policy_set: PolicySet) -> list[str]:
    """What each extended agent preset brings (for ``policy check``): its rules, in the
    order they are tried, with the policies that extend it."""
    lines: list[str] = []
    for name, policy in sorted(policy_set.policies.items()):
        if not name.startswith((PREFIX, SERVICE)):
            continue
        users = sorted(n for n, p in policy_set.policies.items() if name in p.extends)
        lines.append(f"{name} (extended by {', '.join(users) or 'no policy'}):")
        for rule in policy.rules:
            if rule.denies:
                lines.append(f"  deny  {rule.describe().removesuffix('; action: deny')}  "
                             f"({rule.source}): {rule.reason}")
            else:
                lines.append(f"  allow {rule.describe()}  ({rule.source})")
    return lines
