"""The policy data model: frozen, slotted values built once at load and shared read-only.

``Rule`` and ``Credential`` carry their compiled host/path patterns next to the
text they came from, so the matcher never re-parses anything per request.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.hosts import HostPattern, compile_host_pattern
from gateway.core.policy.injection import Injection
from gateway.core.policy.mcp_rule import McpRule
from gateway.core.policy.paths import PathSet, compile_paths

if TYPE_CHECKING:
    from gateway.core.dlp.policy import Dlp
    from gateway.core.policy.minted import MintSpec

__all__ = [
    "DEFAULT_HTTPS_PORT",
    "DEFAULT_HTTP_PORT",
    "Action",
    "Budget",
    "Credential",
    "Decision",
    "Injection",
    "MeteringRule",
    "Mode",
    "Protocol",
    "Request",
    "Rule",
    "Subject",
    "records_only",
]

Mode = Literal["enforce", "report", "learn"]
"""``report``: a would-deny is allowed and recorded; ``learn`` (report's sibling): the
same, and the tunnel is intercepted and a credential bound to the host is injected, so
the audit line shows what a policy would need (see ``Matcher``). Both only record."""
Protocol = Literal["http", "tcp"]
Action = Literal["allow", "deny"]
DecisionResult = Literal["allow", "deny", "report"]
BudgetScope = Literal["sandbox", "policy"]

DEFAULT_HTTPS_PORT = 443
DEFAULT_HTTP_PORT = 80
_MAX_REASON = 280  # an allow's reason, as shown (a long rule is cut)


def records_only(mode: str) -> bool:
    """True where a refusal is recorded, not enforced (``mode: report`` and ``learn``)."""
    return mode != "enforce"


@dataclass(frozen=True, slots=True)
class Subject:
    """A workload a policy admits (`subjects:`): a Kubernetes namespace and service
    account, each a glob (`*`, `?`, `[...]`; `service_account` None: any)."""

    namespace: str
    service_account: str | None = None

    def admits(self, namespace: str, service_account: str) -> bool:
        return fnmatch.fnmatchcase(namespace, self.namespace) and (
            self.service_account is None
            or fnmatch.fnmatchcase(service_account, self.service_account))

    def __str__(self) -> str:
        return f"{self.namespace}/{self.service_account or '*'}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Credential:
    """A named secret bound to hosts: injected only where a destination matches ``hosts``.

    ``secret`` is the name the value is read by from the secret cache: a store secret,
    or for a minted credential (``mint`` set, ``type:`` in the policy) the cache name
    of its minted value. ``places`` is where the value goes whatever carrier the
    client used (None: that carrier); ``signs``: the value signs the request (SigV4)
    instead; ``challenge``: a request with no token gets 401 + ``WWW-Authenticate``.
    """

    name: str
    secret: str
    hosts: tuple[str, ...]
    injection: Injection
    preset: str | None = None
    source: str = "<memory>"
    policy: str = ""
    mint: MintSpec | None = None
    places: Injection | None = None
    signs: bool = False
    challenge: bool = False
    placeholder: str | None = None  # a key-shaped prefix `env` puts before the token
    host_patterns: tuple[HostPattern, ...] = field(default=(), compare=False, repr=False)
    # (split for `binds`, asked twice a credential call: the exact hosts a set, the others
    # matched in turn)
    _exact: frozenset[str] = field(default=frozenset(), init=False, compare=False, repr=False)
    _wild: tuple[HostPattern, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.host_patterns:
            compiled = tuple(compile_host_pattern(h) for h in self.hosts)
            object.__setattr__(self, "host_patterns", compiled)
        object.__setattr__(self, "_exact", frozenset(
            p.text for p in self.host_patterns if not p.is_wildcard))
        object.__setattr__(self, "_wild", tuple(p for p in self.host_patterns
                                                if p.is_wildcard))

    def binds(self, host: str) -> bool:
        """True if this credential may be sent to the normalised ``host``."""
        return host in self._exact or (
            bool(self._wild) and any(pattern.matches(host) for pattern in self._wild))

    @property
    def kind(self) -> str:
        """The credential's type (``key`` for a secret read from the store)."""
        return self.mint.type if self.mint is not None else "key"


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """One egress rule, as written (``host``, ``ports``...) plus its compiled patterns.

    ``ports`` None means the defaults (443, and 80 for plain http). ``methods`` and
    ``paths`` None mean any. ``source`` is ``file:line``; ``policy`` the name of the
    policy file the rule was written in (differs from the deciding policy with extends).
    ``models`` (credential rules only) is the allowlist of model globs, None = any.
    ``metering`` (credential rules only, see ``MeteringRule``) and
    ``allow_minted_secrets``: a provider may mint secrets for the sandbox on this rule
    (OpenAI Realtime client secrets...), which are then bound like the key.
    ``action: deny`` refuses what the rule matches (``reason`` says why and what to
    change); a deny rule has no credential and allows nothing. ``mcp``: the rule's
    requests are MCP JSON-RPC, allowed call by call (tools, resources, prompts).
    ``ask``: what the rule matches goes only once a person approves it (ask mode).
    ``unmetered`` (credential rules only): path patterns of calls the meter cannot model
    that the operator lets through knowingly on a rule that must be metered.
    ``dlp``: the rule's ``dlp:`` section (outbound credential detection, resolved over
    its policy's by `core/dlp/policy.resolve`); a rule with it is intercepted.
    """

    host: str
    source: str = "<memory>"
    policy: str = ""
    ports: tuple[int, ...] | None = None
    methods: tuple[str, ...] | None = None
    paths: tuple[str, ...] | None = None
    credential: str | None = None
    inspect: bool = False
    protocol: Protocol = "http"
    models: tuple[str, ...] | None = None
    metering: MeteringRule | None = None
    allow_minted_secrets: bool = False
    action: Action = "allow"
    reason: str | None = None
    mcp: McpRule | None = None
    ask: Ask | None = None
    unmetered: tuple[str, ...] | None = None
    dlp: Dlp | None = None
    host_pattern: HostPattern = field(init=False, compare=False, repr=False)
    path_set: PathSet | None = field(init=False, compare=False, repr=False)
    unmetered_set: PathSet | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Compile the host and path patterns (raises ValueError if invalid)."""
        pattern = compile_host_pattern(self.host)
        object.__setattr__(self, "host_pattern", pattern)
        object.__setattr__(self, "host", pattern.text)
        if self.methods is not None:
            object.__setattr__(self, "methods", tuple(m.upper() for m in self.methods))
        path_set = compile_paths(self.paths) if self.paths is not None else None
        object.__setattr__(self, "path_set", path_set)
        unmetered = compile_paths(self.unmetered) if self.unmetered else None
        object.__setattr__(self, "unmetered_set", unmetered)

    @property
    def needs_inspection(self) -> bool:
        """True if the rule can only be enforced on decrypted requests."""
        return bool(self.methods or self.paths or self.credential or self.inspect
                    or self.mcp or (self.dlp is not None and self.dlp.enabled))

    @property
    def host_only(self) -> bool:
        """True for a plain HTTP(S) host rule that can be passed through without interception."""
        return self.protocol == "http" and not self.needs_inspection

    @property
    def denies(self) -> bool:
        """True for an ``action: deny`` rule."""
        return self.action == "deny"

    def describe(self) -> str:
        """A one-line summary for reasons and explain output."""
        parts = [f"host: {self.host}"]
        if self.ports is not None:
            parts.append("ports: " + ", ".join(str(p) for p in self.ports))
        if self.methods is not None:
            parts.append("methods: " + ", ".join(self.methods))
        if self.paths is not None:
            parts.append("paths: " + ", ".join(self.paths))
        if self.credential is not None:
            parts.append(f"credential: {self.credential}")
        if self.models is not None:
            parts.append("models: " + ", ".join(self.models))
        if self.metering is not None:
            parts.append("metering: " + ("required" if self.metering.required else
                                         "optional") + (f" (reserve {self.metering.reserve})"
                                                        if self.metering.reserve else ""))
        if self.unmetered:
            parts.append("unmetered: " + ", ".join(self.unmetered))
        if self.allow_minted_secrets:
            parts.append("allow_minted_secrets: true")
        if self.protocol != "http":
            parts.append(f"protocol: {self.protocol}")
        if self.inspect:
            parts.append("inspect: true")
        if self.mcp is not None:
            parts.append(self.mcp.describe())
        if self.ask is not None:
            parts.append(self.ask.describe())
        if self.dlp is not None:
            parts.append("dlp: " + (self.dlp.action or "refuse") if self.dlp.enabled
                         else "dlp: false")
        if self.denies:
            parts.append("action: deny")
        return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class MeteringRule:
    """``metering:`` on a credential rule. ``required``: every inference call on the rule
    is metered or refused (``metering_unavailable``), as on a rule whose policy has a
    ``tokens`` or ``cost_usd`` budget. ``reserve``: the output tokens a call that names
    no maximum (``max_tokens``...) reserves against token budgets while it runs, for a
    model whose maximum output the catalogue does not know. ``max_input_tokens``: the
    context window of such a model (bounds a call that refers to provider-held state)."""

    required: bool = True
    reserve: int | None = None
    max_input_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """A usage limit over fixed time windows (``budgets:`` in a policy file).

    ``per`` sandbox: each sandbox of the policy has its own allowance; ``policy``: all
    of them share one. ``window`` is a length in seconds (windows aligned to the Unix
    epoch, so day multiples start at 00:00 UTC) or ``"month"`` (calendar months, UTC).
    At least one of ``tokens`` (input + output), ``requests``, ``cost_usd`` is set.
    ``credentials`` None = every credential the policy injects. ``source`` is
    ``file:line``; ``policy`` the file's policy (differs from the deciding one with extends).
    """

    name: str
    per: BudgetScope
    window: int | Literal["month"]
    window_text: str
    tokens: int | None = None
    requests: int | None = None
    cost_usd: float | None = None
    credentials: tuple[str, ...] | None = None
    source: str = "<memory>"
    policy: str = ""

    def applies_to(self, credential: str) -> bool:
        """True if requests on ``credential`` count against this budget."""
        return self.credentials is None or credential in self.credentials

    def describe(self) -> str:
        """A one-line summary for explain output and reasons."""
        limits = [f"{label} {value:,}" if isinstance(value, int) else f"{label} {value:g}"
                  for label, value in (("tokens", self.tokens), ("requests", self.requests),
                                       ("cost_usd", self.cost_usd)) if value is not None]
        scope = "" if self.credentials is None else "; credentials: " + ", ".join(
            self.credentials)
        return f"{self.name}: per {self.per}, window {self.window_text}; " + ", ".join(
            limits) + scope


@dataclass(frozen=True, slots=True)
class Request:
    """What is being decided.

    ``method`` None = tunnel-level decision at CONNECT time (no method/path yet).
    ``scheme`` is ``https``, ``http`` or ``tcp`` (raw bytes of unknown content).
    ``host`` must already be normalised (``hosts.normalize_host``).
    ``path`` is the raw request target path, query allowed; None at CONNECT time.
    """

    method: str | None
    scheme: str
    host: str
    port: int
    path: str | None


class Decision:
    """The outcome of one decision.

    ``reason`` is a fixed human sentence. ``rule`` is the allowing rule, or the
    closest rule that refused. ``inspect`` (tunnel level) says TLS must be
    intercepted; ``credential`` (request level) names the credential to inject.

    A value: compared, hashed and shown by its fields, and never changed once built (the
    matcher shares one allow decision per rule between all its requests). An allow by a
    rule (``allowed_by``, built with the policy's index) formats its reason when that is
    first read, not before: a decision is made on the request's way, its reason read for
    the audit line at the end (`docs/performance.md`, the policy decision).
    """

    __slots__ = ("_reason", "credential", "inspect", "result", "rule")

    result: DecisionResult
    rule: Rule | None
    inspect: bool
    credential: str | None
    _reason: str | None

    def __init__(self, result: DecisionResult, reason: str, rule: Rule | None,
                 inspect: bool = False, credential: str | None = None) -> None:
        self.result = result
        self._reason = reason
        self.rule = rule
        self.inspect = inspect
        self.credential = credential

    @classmethod
    def allowed_by(cls, rule: Rule, inspect: bool, credential: str | None) -> Decision:
        """The allow of ``rule``; its reason ``allowed by rule <source> (<describe>)``."""
        decision = cls("allow", "", rule, inspect, credential)
        decision._reason = None
        return decision

    @property
    def reason(self) -> str:
        """The decision's sentence (an allow by a rule: formatted on first read, then kept)."""
        reason = self._reason
        if reason is None:
            rule = self.rule
            assert rule is not None  # (allowed_by always has one)
            reason = f"allowed by rule {rule.source} ({rule.describe()})"
            if len(reason) > _MAX_REASON:
                reason = reason[: _MAX_REASON - 3] + "..."
            self._reason = reason
        return reason

    @property
    def allowed(self) -> bool:
        """True for allow and report (report = would deny, allowed by ``mode: report``)."""
        return self.result != "deny"

    def _key(self) -> tuple[str, str, Rule | None, bool, str | None]:
        return self.result, self.reason, self.rule, self.inspect, self.credential

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Decision):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"Decision(result={self.result!r}, reason={self.reason!r}, rule={self.rule!r}, "
                f"inspect={self.inspect!r}, credential={self.credential!r})")
