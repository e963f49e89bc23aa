"""What the gateway does while its state store is away (`state.unavailable`).

The store can be away (a full disk under the SQLite file, Redis down) while the gateway
runs. What it knows keeps being enforced from memory - revocations included, which reach
every worker through the supervisor's relay - and what could not be written is held and
written when the store is back. Meanwhile each replica decides alone: a token revoked on
another replica is not known here, and budgets are counted per replica. `serve` (the
default) keeps serving, `/readyz` 200 saying `degraded: ["state store"]`; `refuse` makes
the replica refuse new tunnels and requests `503 state_unavailable` (its `/readyz` 503,
so a load balancer sends sandboxes to replicas that have their store).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["MODES", "StoreHealth", "unavailable_mode"]

MODES = ("serve", "refuse")


def unavailable_mode(config: Mapping[str, Any]) -> str:
    """`state.unavailable` of a `state` config section (ValueError if not a mode)."""
    mode = config.get("unavailable", "serve")
    if mode not in MODES:
        raise ValueError(f"state.unavailable: {mode!r} is not serve (go on while the store "
                         "is away, the default) or refuse (503 state_unavailable meanwhile)")
    return str(mode)


class _Store(Protocol):
    @property
    def problem(self) -> str | None: ...


class StoreHealth:
    """The gate's `StateHealth` port: `refusing` while the store is away under `refuse`."""

    def __init__(self, state: _Store, mode: str = "serve") -> None:
        self.state = state
        self.mode = mode

    @property
    def problem(self) -> str | None:
        """Why the store is away now (None: it is not)."""
        return self.state.problem

    @property
    def refusing(self) -> str | None:
        return self.state.problem if self.mode == "refuse" else None
