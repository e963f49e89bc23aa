"""`ask:` in a policy or on a rule: what a person may approve that the policy does not
allow (see `gateway/core/approvals.py` for what is asked and the grants answers make)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_TIMEOUT", "Ask"]

DEFAULT_TIMEOUT = 60.0  # seconds a request is held for an answer
MAX_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class Ask:
    """``hosts``: ask for a host no rule names; ``requests``: for a method or path no
    rule allows on a host some rule names; ``models``: for a model a rule's `models:`
    allowlist refuses (policy level; a rule's ``ask`` asks for what the rule matches).
    ``timeout``: how long a request is held (``timed``: the policy named it, rather
    than taking the default; an MCP OAuth consent, whose default is longer, takes
    only a named one); ``notify``: the names of the gateway's notifiers
    (``approvals.notify`` in its config) told of each ask."""

    hosts: bool = False
    requests: bool = False
    models: bool = False
    timeout: float = DEFAULT_TIMEOUT
    notify: tuple[str, ...] = ()
    timed: bool = False

    def describe(self) -> str:
        what = [w for w, on in (("hosts", self.hosts), ("requests", self.requests),
                                ("models", self.models)) if on]
        notify = f", notify {', '.join(self.notify)}" if self.notify else ""
        return f"ask ({'/'.join(what) or 'this rule'}; timeout {self.timeout:g}s{notify})"
