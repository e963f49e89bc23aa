"""What the metering step refuses, as the sandbox reads it: a model the allowlist refuses
(``models.ModelRefusal``), a call that cannot be metered or would mint a secret
(``MeteringRefusal``, 403; 503 for a budget the state store cannot decide now:
``store_away``), a budget used up (``BudgetExceeded``, 429 with its usage, limit and
reset). Pure data and sentences; ``refusal`` renders any of them as the one ``Refusal``
every engine answers (``core/refusal.py``).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Literal

from gateway.core.metering.models import ModelRefusal
from gateway.core.policy.model import Budget
from gateway.core.refusal import Refusal

__all__ = ["RETRY_AFTER_MAX", "STEP_REFUSALS", "BudgetExceeded", "LimitKind",
           "MeteringRefusal", "StepRefusal", "iso_time", "refusal", "store_away"]

RETRY_AFTER_MAX = 300
"""A refused call is told to retry (``Retry-After``) only if the budget has room again
within this many seconds (running calls settle, or its window ends): agents and SDKs
wait a ``Retry-After`` out silently, so a longer one would stall them for hours. Past
it the refusal is final for now (the provider's quota answer, which they stop on)."""
LimitKind = Literal["tokens", "requests", "cost_usd"]


def iso_time(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _span(seconds: float) -> str:
    seconds = max(0, math.ceil(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{days}d" if days else "", f"{hours}h" if hours else "",
             f"{minutes}m" if minutes else "", f"{secs}s" if secs and not days else ""]
    return "".join(parts) or "0s"


def _amount(kind: LimitKind, value: float) -> str:
    if kind == "cost_usd":
        return f"${value:,.2f}"
    return f"{int(value):,} {kind}"


@dataclass(frozen=True, slots=True)
class MeteringRefusal:
    """``403 metering_unavailable`` (the call's usage cannot be metered) or ``403
    minted_secret_refused`` (the provider would mint a secret for the sandbox)."""

    code: str
    reason: str
    rule: str
    status: int = 403
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class BudgetExceeded:
    """``429 budget_exceeded``: which budget, how much was used of what, when it resets.
    ``frees_in``: seconds until the budget has room for the call again (running calls
    settle, or the window ends); ``held``: what calls still running have reserved;
    ``asked``: what this call would reserve (0: the budget is used up whatever the
    call)."""

    budget: Budget
    subject: str
    kind: LimitKind
    used: float
    limit: float
    window_start: float
    resets_at: float
    frees_in: int
    held: float = 0
    asked: float = 0
    window_left: int = 0  # seconds until the window resets (0: frees_in)
    # the state store is away and this process may use only 1/alone of what is left
    # (the gateway processes counting this budget; 0: not that)
    alone: int = 0
    # what other gateway processes hold of the room as their shares, each to spend alone
    # should the store stop answering it (``state.unavailable: serve``)
    others: float = 0
    status: int = 429
    code: str = "budget_exceeded"

    @property
    def rule(self) -> str:
        """Where the budget is written (``file:line``)."""
        return self.budget.source

    @property
    def retry_after(self) -> int | None:
        """Seconds to wait before retrying, where waiting helps (room again within
        ``RETRY_AFTER_MAX``); None: final for now, answered without ``Retry-After``."""
        return self.frees_in if self.frees_in <= RETRY_AFTER_MAX else None

    @property
    def reason(self) -> str:
        """A sentence for the sandbox: budget, usage, limit, reset time."""
        b = self.budget
        who = (f'sandbox "{self.subject}"' if b.per == "sandbox"
               else f'policy "{self.subject}" (all its sandboxes)')
        window = (f"in the {b.window_text} window from {iso_time(self.window_start)}; it resets "
                  f"at {iso_time(self.resets_at)} (in {_span(self.window_left or self.frees_in)})")
        if self.alone:
            held = (f" ({_amount(self.kind, self.held)} held by calls still running)"
                    if self.held else "")
            asked = (f"; this call may use up to {_amount(self.kind, self.asked)}"
                     if self.asked else "")
            return (f'budget "{b.name}" ({b.source}) cannot be checked across the '
                    f"gateway's processes: its state store is away, so this process may "
                    f"use only its share (1/{self.alone}) of what was left for {who} when "
                    f"it last read the store, and this call does not fit in it "
                    f"({_amount(self.kind, self.used)} used{held} of "
                    f"{_amount(self.kind, self.limit)} as read here{asked}); "
                    f"retry in {_span(self.frees_in)}: the share is whole again once the "
                    f"store is back ({window})")
        shares = (f"{_amount(self.kind, self.others)} held as other gateway processes' "
                  "shares (what each may spend alone should the state store stop "
                  "answering it; a share follows what its process admitted in the last 5 "
                  "minutes)" if self.others else "")
        if self.used + self.held + self.others >= self.limit or not self.asked:
            held = "".join(f" and {part}" for part in (
                f"{_amount(self.kind, self.held)} held by calls still running"
                if self.held else "", shares) if part)
            return (f'budget "{b.name}" ({b.source}) is used up for {who}: '
                    f"{_amount(self.kind, self.used)} used{held} of "
                    f"{_amount(self.kind, self.limit)} {window}; retry then, or ask an "
                    "operator to raise the budget")
        left = self.limit - self.used - self.held - self.others
        more = "; ".join(part for part in (
            f"{_amount(self.kind, self.held)} more are held by calls still running"
            if self.held else "", shares) if part)
        held = f" ({more})" if more else ""
        lower = ("max_tokens (or max_output_tokens)" if self.kind == "tokens"
                 else "max_tokens or the input")
        return (f'budget "{b.name}" ({b.source}) has {_amount(self.kind, left)} left for '
                f"{who}{held}, and this call may use up to {_amount(self.kind, self.asked)} "
                f"(its output limit plus an input estimate); lower {lower}, or retry "
                f"once running calls end, or after the budget resets ({window})")


def store_away(budget: Budget, share: bool = False) -> MeteringRefusal:
    """``503 state_unavailable`` for a call on ``budget`` that the state store cannot
    decide across the gateway's processes now: under ``state.unavailable: refuse``, or
    (``share``) under ``serve`` when the store holds no share of the budget this process
    may spend alone (the store's own words, which may name its address, stay in the
    log)."""
    why = ("this gateway process holds no share of the budget it may spend alone "
           "(state.unavailable: serve holds one for the budgets a process admitted calls "
           "on in the last 5 minutes)" if share else
           "this gateway refuses budgeted calls until it does (state.unavailable: refuse)")
    return MeteringRefusal(
        "state_unavailable",
        f'budget "{budget.name}" ({budget.source}) cannot be checked across the '
        f"gateway's processes now: its state store does not answer, and {why}; retry "
        "later", budget.source, status=503, retry_after=5)


StepRefusal = ModelRefusal | BudgetExceeded | MeteringRefusal
STEP_REFUSALS = (ModelRefusal, BudgetExceeded, MeteringRefusal)
"""What the metering step refuses (``isinstance(step, STEP_REFUSALS)``)."""


def refusal(step: StepRefusal) -> Refusal:
    """The refusal every engine answers for a metering step's."""
    return Refusal(step.code, step.reason, step.rule, retry_after=step.retry_after,
                   resets_in=step.frees_in if isinstance(step, BudgetExceeded) else None)
