"""What the core needs from outside, as protocols: the gateway wires its services in
(`runtime/app.py`), tests wire fakes. The core imports none of those services."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from gateway.core.addresses import Pinned
from gateway.core.approvals import Approval, Asked, Grant
from gateway.core.dlp.scanner import Scanner
from gateway.core.ephemeral import EphemeralKey
from gateway.core.identity import Identity, SandboxAddress, Workload
from gateway.core.mcp_oauth import Challenge, McpToken
from gateway.core.messages import RequestHead
from gateway.core.metering.refusals import StepRefusal
from gateway.core.metering.usage import Meter
from gateway.core.policy import Credential, Policy, Request, Rule
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.mcp_rule import McpOAuth
from gateway.core.secret_value import SecretValue
from gateway.core.target import Target

__all__ = [
    "NO_MINTED_SECRETS",
    "SILENT",
    "Approvals",
    "AuditHealth",
    "Capacity",
    "Detectors",
    "Guard",
    "McpTokens",
    "MeteredCall",
    "MeteredUse",
    "Metering",
    "Minted",
    "MintedSecrets",
    "Registry",
    "Secrets",
    "Signer",
    "Signers",
    "StateHealth",
    "Telemetry",
    "Tokens",
    "Workloads",
]


class Telemetry(Protocol):
    """Where the core's counts go (observability/metrics.py: Prometheus). `event` and
    `name` are the metric's short name (`bytes`, `open_connections`, ...), `labels` its
    label values in order."""

    def count(self, event: str, *labels: str, by: float = 1) -> None: ...
    def gauge(self, name: str, delta: float) -> None: ...
    def observe(self, name: str, value: float) -> None: ...


class _Silent:
    """Telemetry that counts nothing: decisions taken without traffic (explain,
    `policy test`, replay) and tests that do not look."""

    def count(self, event: str, *labels: str, by: float = 1) -> None:
        return None

    def gauge(self, name: str, delta: float) -> None:
        return None

    def observe(self, name: str, value: float) -> None:
        return None


SILENT: Telemetry = _Silent()


class MeteredCall(Protocol):
    """An exchange the metering step admitted (``services/metering.Exchange``): ``body``
    the request body to forward instead (None: unchanged), ``meter`` what reads the
    answer's usage, ``capture`` an answer kept whole (a deferred job's id),
    ``holds_response`` an answer held until its minted secrets are swapped."""

    body: bytes | None
    meter: Meter | None
    capture: list[bytes] | None
    holds_response: bool

    def head(self, header: Callable[[str], str | None]) -> None: ...
    def feed(self, chunk: bytes) -> None: ...


class MeteredUse(Protocol):
    """What an exchange used, as its audit line's ``usage`` says it."""

    def as_record(self) -> dict[str, Any] | None: ...


class Metering(Protocol):
    """The metering step (``services/metering.Metering``): model allowlists, what cannot
    be metered, budgets, usage. ``admit`` answers a refusal of ``core/metering/refusals``
    (``STEP_REFUSALS``) or a ``MeteredCall``; over counters that stay empty it decides
    from the request alone (explain, test). The later calls take what ``admit`` gave
    (typed ``Any`` here: each implementation takes its own admission type)."""

    def admit(self, *, sandbox: str, policy: Policy, rule: Rule, preset: str | None,
              method: str, path: str, body: bytes | None, now: float
              ) -> MeteredCall | StepRefusal: ...
    def session_message(self, exchange: Any, data: bytes, now: float
                        ) -> StepRefusal | None: ...
    def session_event(self, exchange: Any, data: bytes, now: float) -> None: ...
    def release(self, exchange: Any, status: int, body: bytes, now: float) -> bytes | str: ...
    def complete(self, exchange: Any, status: int, now: float, *,
                 sent: bool = True) -> MeteredUse: ...


class MintedSecrets(Protocol):
    """Provider-minted secrets and their aliases (``services/secrets/ephemeral``):
    ``version`` changes whenever the set does."""

    @property
    def version(self) -> int: ...
    def live(self) -> list[EphemeralKey]: ...
    def by_alias(self, alias: str) -> EphemeralKey | None: ...


class _NoMintedSecrets:
    """A gateway that meters no minted secrets (tests, tools): none, ever."""

    version = 0

    def live(self) -> list[EphemeralKey]:
        return []

    def by_alias(self, alias: str) -> EphemeralKey | None:
        return None


NO_MINTED_SECRETS: MintedSecrets = _NoMintedSecrets()


class Minted(Protocol):
    """A gateway token just minted: what the sandbox-facing refresh answers."""

    @property
    def token(self) -> str: ...
    @property
    def jti(self) -> str: ...
    @property
    def expires_at(self) -> float: ...


class Tokens(Protocol):
    """Gateway tokens (services/identity/tokens.py): `verify` raises TokenRefused;
    `refresh` raises TokenRefused, or ValueError for a ttl it cannot grant."""

    @property
    def issuer(self) -> str: ...
    def verify(self, token: str) -> Identity: ...
    def refresh(self, identity: Identity, ttl: float | None = None) -> Minted: ...


class Guard(Protocol):
    """The destination check: resolve, classify, choose the address (raises Refusal)."""

    async def check(self, host: str, port: int) -> Pinned: ...


class Detectors(Protocol):
    """Outbound credential detection's detectors (`services/dlp`), built once per
    process and keyed with the deployment's fingerprint salt: `scanner()` holds every
    detector of `core/dlp/catalogue.py`; a rule's selection is `scanner().only(...)`.
    Built on first use (detect-secrets is slow to import) or at start when a policy
    has `dlp:`; raises if the detectors cannot be built (the caller fails closed)."""

    def scanner(self) -> Scanner: ...


class Secrets(Protocol):
    """The secret cache: a credential's value, forgetting a value the upstream
    rejected, and every value fetched so far (for the leak scan)."""

    async def get(self, name: str) -> SecretValue: ...
    def invalidate(self, name: str, rejected: SecretValue | None = None) -> None: ...
    def known_items(self) -> list[tuple[str, SecretValue]]: ...


class Signer(Protocol):
    """Signs a request with a minted credential (SigV4), replacing the client's
    signature. Both methods raise `Refusal` for a request it cannot sign."""

    def needs_body(self, head: RequestHead) -> bool:
        """True if the signature covers the body (then `sign` needs it whole)."""
        ...

    def sign(self, head: RequestHead, target: Target, body: bytes | None) -> None:
        """Sign `head` in place (`body`: the whole body as forwarded, or None)."""
        ...


class Signers(Protocol):
    """Makes the request signer of a credential that signs (AWS SigV4) from its
    minted value (the minting backends, services/minting/)."""

    def signer(self, credential: Credential, value: SecretValue) -> Signer: ...


class Registry(Protocol):
    """Transparent mode's registered sandboxes, by source address."""

    def sandbox_for(self, ip: str) -> SandboxAddress | None: ...


class Workloads(Protocol):
    """Kubernetes pods as identities (identity.kubernetes; services/identity/kubernetes):
    the watched pods by address, and whether a pod a token is bound to is still there."""

    def identity_for(self, ip: str) -> Identity:
        """The identity of the running pod that holds `ip` (keyless, its workload set);
        raises Refusal `identity_unknown` (no such pod, not running, two pods on it) or
        `identity_unavailable` (the watch is too stale to trust)."""
        ...

    def gone(self, workload: Workload) -> str | None:
        """None while the pod is running as the same pod (uid); else why it is not.
        Raises Refusal `identity_unavailable` while the watch is too stale to say."""
        ...


class AuditHealth(Protocol):
    """The audit sink's health (observability/audit.py): `refusing` is why new
    exchanges must be refused now (their audit lines cannot be written), or None."""

    @property
    def refusing(self) -> str | None: ...


class StateHealth(Protocol):
    """The state store's health as the gateway serves it (services/state/health.py):
    `refusing` is why new exchanges must be refused now (the store is away and
    `state.unavailable: refuse`), or None."""

    @property
    def refusing(self) -> str | None: ...


class Capacity(Protocol):
    """The process's room for more connections beyond the descriptor cap (the memory
    ceiling, runtime/memory.py): `refusing` is why a new connection must be refused
    now, or None. Read on every accepted connection: no I/O beyond a cached reading."""

    @property
    def refusing(self) -> str | None: ...


class Approvals(Protocol):
    """Ask mode (gateway/services/approvals): the grants people made, and asking them.
    `grant_for` and `active` read a local view (no I/O); `ask` holds `request` (naming
    `model`) until the answer or the ask's timeout and returns the approval as it ended
    (approved, denied, timeout), or the grant that covers the request, written
    meanwhile on any process; raises StateUnavailable when the store cannot hold the
    ask."""

    def grant_for(self, sandbox: str, policy: str, request: Request,
                  model: str | None = None) -> Grant | None: ...
    def active(self, grant: str) -> bool: ...
    async def ask(self, identity: Identity, asked: Asked, reason: str, spec: Ask, *,
                  request: Request, model: str | None = None) -> Approval | Grant: ...


class McpTokens(Protocol):
    """The gateway as MCP servers' OAuth client (`services/mcp_oauth`, rules with
    `mcp.oauth`). `token` finds the grant serving `identity` at `resource` (refreshed when
    due; None: a consent is needed); `consent` holds the request until a person consents
    (raises Refusal otherwise); `rejected` tells it the server refused a token (a 401, or
    a 403 asking for more scopes). `live` and `version`: the tokens this process holds,
    with the host each is bound to, for the leak markers."""

    @property
    def version(self) -> int: ...
    def live(self) -> list[tuple[str, SecretValue]]: ...
    async def token(self, identity: Identity, resource: str, oauth: McpOAuth
                    ) -> McpToken | None: ...
    async def consent(self, identity: Identity, resource: str, oauth: McpOAuth, spec: Ask,
                      rule: str | None) -> None: ...
    def rejected(self, token: McpToken, resource: str, challenge: Challenge | None
                 ) -> None: ...
