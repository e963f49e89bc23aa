"""Where a credential goes in the upstream request (a value type of its own: the model
and the minted-credential presets both use it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Injection", "InjectionKind"]

InjectionKind = Literal["header", "bearer", "query", "basic", "token"]


@dataclass(frozen=True, slots=True)
class Injection:
    """Where a credential goes in the upstream request.

    * ``header``: header ``name`` carries the secret as is (``x-api-key``, ``api-key``);
    * ``bearer``: ``Authorization: Bearer <secret>`` (``name`` is None);
    * ``query``: query parameter ``name`` (``?key=``);
    * ``basic``: ``Authorization: Basic`` with user ``name`` and the secret as password;
    * ``token``: ``Authorization: token <secret>`` (GitHub's own scheme, as ``gh`` sends).

    ``alternatives`` are other carriers the same provider accepts: the injector
    replaces the token in whichever carrier the client used, and falls back to
    this (primary) carrier when the client used none.
    """

    kind: InjectionKind
    name: str | None = None
    alternatives: tuple[Injection, ...] = ()

    # The primary carrier followed by the alternatives (without their own alternatives):
    # read on every credential request, so made once.
    carriers: tuple[Injection, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        primary = Injection(self.kind, self.name) if self.alternatives else self
        object.__setattr__(self, "carriers", (primary, *self.alternatives))
