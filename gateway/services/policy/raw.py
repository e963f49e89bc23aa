"""What the section readers return: the model objects a policy file defines (rules,
budgets, credentials, ``policy/model.py``), each with the positions that the checks across
files (``build.py``) name in their errors."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gateway.core.dlp.policy import Dlp
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.model import Budget, Credential, Mode, Rule, Subject

__all__ = ["NAME", "CredentialDef", "RawBudget", "RawPolicy", "RawRule"]

# A policy's, budget's or credential's name.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True, slots=True)
class RawRule:
    """A rule as written (what the matcher is compiled from once its credential is
    checked), the line of its ``credential:`` and a preset's ``telemetry: true``."""

    rule: Rule
    credential_line: int
    telemetry: bool = False  # a shipped preset's telemetry rule (see policy/agents)


@dataclass(frozen=True, slots=True)
class RawBudget:
    """A budget with its line and the line of each credential it names."""

    budget: Budget
    line: int
    credentials: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class CredentialDef:
    """A credential and where it is defined (``file:line``: names are global)."""

    credential: Credential
    where: str


@dataclass
class RawPolicy:
    """One policy document: its own keys and what each section reader returned."""

    name: str
    mode: Mode
    file: str
    line: int
    named: bool = True  # False: no valid name (``name`` says where it is)
    extends: list[tuple[str, int]] = field(default_factory=list)  # parent, line
    rules: list[RawRule] = field(default_factory=list)
    budgets: list[RawBudget] = field(default_factory=list)
    token_ttl: float | None = None  # `tokens: {ttl: 8h}`: its tokens' default lifetime
    subjects: list[Subject] = field(default_factory=list)  # `subjects:` (Kubernetes)
    ask: Ask | None = None  # `ask:` (what a person may approve)
    dlp: Dlp | None = None  # `dlp:` (outbound credential detection; inherited)
    telemetry_content: bool = False  # `telemetry: {content: true}` (not inherited)

    @property
    def given_name(self) -> str:
        """The name the file gives (``""`` when it gives no valid one)."""
        return self.name if self.named else ""
