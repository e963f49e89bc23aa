"""The compiled, indexed policy matcher and the pure decision function.

Index: exact hosts (and IPs) in a dict; wildcard patterns in a dict keyed by their
literal suffix. A decision walks the request host's label suffixes (O(labels)),
so its cost does not grow with the number of rules. Walking from the longest
suffix to the shortest yields candidates already ordered by specificity: exact
host, then wildcards with longer literal suffixes, then (same suffix) globs before
``*.`` before ``**.``; for one host pattern, rules that name ``paths`` before rules that
do not (a telemetry path rule is never judged by the host's inference rule), then file
order.

Tunnel level (``Request.method is None``, at CONNECT time): allowed if any rule
matches host and port (no ``ports`` = 443 and 80). ``inspect`` is False (pass
through, no TLS interception) only if some matching rule is host-only or
``protocol: tcp`` and no matching rule has a credential or ``inspect: true``.
``Decision.rule`` is the rule behind that choice: when it is a ``protocol: tcp``
rule the caller relays raw bytes. A ``scheme == "tcp"`` request (content known
not to be HTTP/TLS) only matches ``protocol: tcp`` rules; other schemes match both.

Request level: only ``protocol: http`` rules; port must be listed, or be the
scheme's default (https 443, http 80) when the rule has no ``ports``. Among the
rules whose host, port, method and path match, the first (by specificity) that
binds a credential wins, else the first one; but a rule naming ``paths`` is not
overridden by a later credential rule without them (a keyless call on a listed path
stays keyless). A credential rule only matches hosts its credential is bound to. A
suspicious path (see ``paths``) matches no rule that names ``paths`` or a credential
(where its reading would matter: path globs, the model and metering checks); a host-wide
rule without either allows the host's every path and matches it (npm's scoped packages
are ``/@scope%2fname``), unless a deny rule on paths comes first: that one refuses it
(``/x/../admin`` must not slip past a deny of ``/admin/**``).

``action: deny`` rules: a matching deny rule refuses, unless an allow rule before it
(more specific, or earlier in the file) already matched. At tunnel level a deny rule
without ``methods``/``paths`` refuses the tunnel the same way; one with them makes the
tunnel intercepted, so its requests are seen.

With ``mode: report`` a deny becomes ``report``: allowed, with the would-deny reason.
With ``mode: learn`` (report's sibling, for writing a policy from traffic) a deny
becomes ``report`` too, and: a tunnel is intercepted (not raw TCP), so its requests are
seen and recorded one by one; a request gets the credential bound to its host when
exactly one of the policy's credentials is (those its file defines or its rules name;
``Decision.rule`` then a stand-in naming the policy's file and ``mode: learn``), so an
agent's calls work and its audit line names the credential a rule would need. What is
never allowed stays refused elsewhere: the destination check (metadata, private ranges)
when connecting, leak markers and secrets in the exchange.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gateway.core.addresses import special_literal
from gateway.core.dlp.policy import Dlp, resolve
from gateway.core.policy.hosts import HostPattern
from gateway.core.policy.model import (
    DEFAULT_HTTP_PORT,
    DEFAULT_HTTPS_PORT,
    Credential,
    Decision,
    Mode,
    Request,
    Rule,
)
from gateway.core.policy.paths import normalize_path

__all__ = ["Matcher"]

_TUNNEL_DEFAULT_PORTS = frozenset((DEFAULT_HTTPS_PORT, DEFAULT_HTTP_PORT))
_MAX_SHOWN = 100


def _clip(text: str, limit: int = _MAX_SHOWN) -> str:
    """Shorten user-supplied text for a reason string."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Entry:
    """One rule compiled for matching, with its allow decisions: built here, with the index,
    so that deciding allocates nothing (their reason text is formatted when first read)."""

    __slots__ = (
        "allow",
        "binds",
        "credential",
        "deny",
        "forces_inspect",
        "host_level",
        "methods",
        "passthrough",
        "paths",
        "ports",
        "rule",
        "tcp",
        "tunnel_allow",
    )

    def __init__(self, rule: Rule, binds: tuple[HostPattern, ...] | None, dlp: Dlp | None,
                 sets: dict[frozenset[Any], frozenset[Any]]) -> None:
        self.rule = rule
        self.tcp = rule.protocol == "tcp"
        self.ports = _shared(rule.ports, sets)
        self.methods = _shared(rule.methods, sets)
        self.paths = rule.path_set
        self.credential = rule.credential
        self.binds = binds
        # (a policy's dlp: applies to every HTTP rule that does not turn it off: read)
        self.passthrough = self.tcp or (rule.host_only and resolve(dlp, rule.dlp) is None)
        self.forces_inspect = rule.credential is not None or rule.inspect or rule.mcp is not None
        self.deny = rule.denies
        self.host_level = rule.methods is None and rule.paths is None
        # request level: inject its credential; tunnel level: inspect unless it can pass
        # through (one decision for both where they agree: a host-only rule's)
        self.allow = Decision.allowed_by(rule, False, rule.credential)
        self.tunnel_allow = (self.allow if self.passthrough and rule.credential is None
                             else Decision.allowed_by(rule, not self.passthrough, None))

    @property
    def tunnel_inspect(self) -> Decision:
        """The tunnel-level allow of a pass-through rule whose host also has a deny rule
        on paths or methods: intercepted, so that rule can see the requests."""
        return Decision.allowed_by(self.rule, True, None)

    def bound(self, host: str) -> bool:
        """False if this rule's credential may not go to ``host``."""
        binds = self.binds
        if binds is None:
            return True
        for pattern in binds:  # noqa: SIM110 - no generator on the hot path
            if pattern.matches(host):
                return True
        return False


def _shared[T](values: tuple[T, ...] | None,
                sets: dict[frozenset[Any], frozenset[Any]]) -> frozenset[T] | None:
    """``values`` as a frozenset, one object for every rule that lists the same (ports,
    methods: a few distinct lists however many rules)."""
    if values is None:
        return None
    key = frozenset(values)
    return sets.setdefault(key, key)


def _by_paths(entries: list[_Entry]) -> tuple[_Entry, ...]:
    """One host pattern's entries: rules with ``paths`` first, then file order."""
    return tuple(sorted(entries, key=lambda e: e.paths is None))


class Matcher:
    """The compiled index of one policy's rules (build with ``compile_policy``)."""

    __slots__ = ("_credentials", "_exact", "_wild", "mode", "name", "source")

    def __init__(
        self,
        name: str,
        mode: Mode,
        source: str,
        rules: Iterable[Rule],
        credentials: Mapping[str, Credential],
        *,
        dlp: Dlp | None = None,
    ) -> None:
        self.name = name
        self.mode = mode
        self.source = source
        rules_tuple = tuple(rules)
        named = {r.credential for r in rules_tuple if r.credential}
        self._credentials = tuple(c for c in credentials.values()
                                  if c.policy == name or c.name in named) if mode == "learn" else ()
        exact: dict[str, list[_Entry]] = {}
        wild: dict[str, list[tuple[HostPattern, list[_Entry]]]] = {}
        sets: dict[frozenset[Any], frozenset[Any]] = {}
        for rule in rules_tuple:
            binds: tuple[HostPattern, ...] | None = None
            if rule.credential is not None:
                cred = credentials.get(rule.credential)
                if cred is None:
                    raise ValueError(
                        f"rule {rule.source} references unknown credential {rule.credential!r}"
                    )
                binds = cred.host_patterns
            entry = _Entry(rule, binds, dlp, sets)
            pattern = rule.host_pattern
            if pattern.is_wildcard:
                bucket = wild.get(pattern.suffix)
                if bucket is None:
                    wild[pattern.suffix] = [(pattern, [entry])]
                    continue
                for known, entries in bucket:
                    if known.text == pattern.text:
                        entries.append(entry)
                        break
                else:
                    bucket.append((pattern, [entry]))
            else:
                exact.setdefault(pattern.text, []).append(entry)
        self._exact: dict[str, tuple[_Entry, ...]] = {k: _by_paths(v) for k, v in exact.items()}
        # a suffix's entries in one flat tuple, pattern by pattern (fewer objects to keep,
        # and for the cyclic collector to walk, than a tuple per pattern)
        self._wild: dict[str, tuple[_Entry, ...]] = {}
        for suffix, bucket in wild.items():
            if len(bucket) > 1:
                bucket.sort(key=lambda pe: pe[0].rank)  # stable: file order within a rank
            self._wild[suffix] = tuple(e for _, entries in bucket for e in _by_paths(entries))

    @property
    def learnable(self) -> tuple[Credential, ...]:
        """``mode: learn``: the credentials it may inject where no rule does (those the
        policy's file defines or its rules name); empty in other modes."""
        return self._credentials

    def candidates(self, host: str) -> tuple[_Entry, ...] | list[_Entry]:
        """Entries whose host pattern matches ``host``, most specific first."""
        exact = self._exact.get(host, ())
        wild = self._wild
        if not wild:
            return exact
        found: list[_Entry] | None = None
        start = 0
        while True:
            bucket = wild.get(host[start:] if start else host)
            if bucket is not None:
                for entry in bucket:
                    if entry.rule.host_pattern.matches(host):
                        if found is None:
                            found = list(exact)
                        found.append(entry)
            dot = host.find(".", start)
            if dot < 0:
                break
            start = dot + 1
        return exact if found is None else found

    def _refused(self, entry: _Entry) -> Decision:
        """The refusal of a matching ``action: deny`` rule."""
        rule = entry.rule
        why = rule.reason or f"{rule.describe()}; remove or narrow that rule to allow this"
        return self._deny(_clip(f"refused by rule {rule.source}: {why}", 400), rule)

    def _deny(self, reason: str, rule: Rule | None) -> Decision:
        if self.mode != "enforce":
            return Decision("report", reason, rule, False, None)
        return Decision("deny", reason, rule, False, None)

    def _no_host(self, host: str) -> Decision:
        shown = _clip(host)
        special = special_literal(host)
        if special is not None and special.hard:
            # A rule would not help: the destination check refuses these addresses always.
            return self._deny(
                f"{shown} is a {special.label} address ({special.cidr}): the gateway never "
                "connects to it, whatever a policy or network.allow_cidrs says; no rule can "
                "allow it",
                None,
            )
        also = (f"; {shown} is not a public address ({special.label}, {special.cidr}), so "
                "the gateway's network.allow_cidrs must also include it"
                if special is not None else "")
        return self._deny(
            f'no rule in policy "{self.name}" allows host "{shown}"; add an egress rule '
            f"with host: {shown} to {self.source}{also}",
            None,
        )

    def decide_tunnel(self, request: Request) -> Decision:
        """Decide a tunnel (CONNECT / transparent connection) on host and port alone."""
        decision = self._decide_tunnel(request)
        if self.mode != "learn" or decision.result != "report" or request.scheme == "tcp":
            return decision
        return Decision("report", decision.reason, decision.rule, True, None)

    def decide_request(self, request: Request) -> Decision:
        """Decide one HTTP request inside an allowed tunnel (or plain HTTP)."""
        decision = self._decide_request(request)
        if self.mode != "learn" or decision.result != "report":
            return decision
        bound = [c for c in self._credentials if c.binds(request.host)]
        if len(bound) != 1:
            return decision
        name = bound[0].name
        stand_in = Rule(host=request.host, source=f"{self.source} (mode: learn)",
                        policy=self.name, ports=(request.port,), credential=name)
        return Decision("report", decision.reason, stand_in, False, name)

    def _decide_tunnel(self, request: Request) -> Decision:
        host = request.host
        port = request.port
        tcp_only = request.scheme == "tcp"
        first_pass: _Entry | None = None
        first_inspect: _Entry | None = None
        first_forced: _Entry | None = None
        first_deny: _Entry | None = None
        closest: _Entry | None = None
        level = -1
        for entry in self.candidates(host):
            if tcp_only and not entry.tcp:
                if level < 0:
                    closest, level = entry, 0
                continue
            ports = entry.ports
            if (port not in _TUNNEL_DEFAULT_PORTS) if ports is None else (port not in ports):
                if level < 1:
                    closest, level = entry, 1
                continue
            if not entry.bound(host):
                if level < 2:
                    closest, level = entry, 2
                continue
            if entry.deny:
                if entry.host_level and first_pass is None and first_inspect is None:
                    return self._refused(entry)
                if first_deny is None:
                    first_deny = entry
                continue
            if entry.passthrough:
                if first_pass is None:
                    first_pass = entry
            else:
                if first_inspect is None:
                    first_inspect = entry
                if entry.forces_inspect and first_forced is None:
                    first_forced = entry
        if first_forced is not None:
            return first_forced.tunnel_allow
        if first_pass is not None:
            if first_deny is not None and not first_deny.host_level:
                return first_pass.tunnel_inspect  # the deny rule's requests must be seen
            return first_pass.tunnel_allow
        if first_inspect is not None:
            return first_inspect.tunnel_allow
        if first_deny is not None:
            return self._refused(first_deny)
        if closest is None:
            return self._no_host(host)
        rule = closest.rule
        if level == 0:
            return self._deny(
                f'raw TCP to "{_clip(host)}" port {port} needs a rule with protocol: tcp; '
                f"add one with host: {_clip(host)} and ports: [{port}] to {self.source}",
                rule,
            )
        if level == 1:
            return self._deny(self._port_reason(host, port, None, rule), rule)
        return self._deny(self._unbound_reason(host, rule), rule)

    def _unbound_reason(self, host: str, rule: Rule) -> str:
        shown = _clip(host)
        return (
            f"credential {rule.credential} of rule {rule.source} is not bound to "
            f"{shown}; narrow the rule's host or add {shown} to the credential's hosts"
        )

    def _port_reason(self, host: str, port: int, scheme: str | None, rule: Rule) -> str:
        shown = _clip(host)
        if rule.ports is None:
            defaults = "443 (https) and 80 (http)"
            via = f" ({scheme})" if scheme else ""
            return (
                f"port {port}{via} is not allowed for {shown} by rule {rule.source}, which "
                f"allows only the default ports {defaults}; add ports: [{port}] to it"
            )
        listed = _clip(", ".join(str(p) for p in rule.ports), 60)
        return (
            f"port {port} is not allowed for {shown} by rule {rule.source} "
            f"(ports: {listed}); add {port} to its ports"
        )

    def _decide_request(self, request: Request) -> Decision:
        host = request.host
        port = request.port
        scheme = request.scheme
        method = request.method
        candidates = self.candidates(host)
        if not candidates:
            return self._no_host(host)
        path, problem = normalize_path(request.path)
        if scheme == "https":
            default_port = DEFAULT_HTTPS_PORT
        elif scheme == "http":
            default_port = DEFAULT_HTTP_PORT
        else:
            default_port = -1
        first: _Entry | None = None
        closest: _Entry | None = None
        level = -1
        for entry in candidates:
            if entry.tcp:
                if level < 0:
                    closest, level = entry, 0
                continue
            ports = entry.ports
            if (port != default_port) if ports is None else (port not in ports):
                if level < 1:
                    closest, level = entry, 1
                continue
            if not entry.bound(host):
                if level < 2:
                    closest, level = entry, 2
                continue
            methods = entry.methods
            if methods is not None and method not in methods:
                if level < 3:
                    closest, level = entry, 3
                continue
            paths = entry.paths
            if problem is not None and entry.deny and paths is not None:
                pass  # a deny rule on paths refuses what it cannot read: fail closed
            elif ((problem is not None and (paths is not None or entry.credential is not None))
                    or (paths is not None and not paths.matches(path))):
                if level < 4:
                    closest, level = entry, 4
                continue
            if entry.deny:
                return self._refused(entry) if first is None else first.allow
            if entry.credential is not None:
                if first is not None and first.paths is not None and entry.paths is None:
                    return first.allow  # a path rule is not overridden by a host-wide one
                return entry.allow
            if first is None:
                first = entry
        if first is not None:
            return first.allow
        assert closest is not None
        rule = closest.rule
        shown = _clip(host)
        if problem is not None:
            reason = (
                f'path "{_clip(path)}" {problem}, so no rule matches it (closest: rule '
                f"{rule.source}); send the normalised path"
            )
        elif level == 0:
            reason = (
                f"{shown} is allowed only for raw TCP by rule {rule.source} (protocol: tcp); "
                f"add an egress rule with host: {shown} for HTTP to {self.source}"
            )
        elif level == 1:
            reason = self._port_reason(host, port, scheme, rule)
        elif level == 2:
            reason = self._unbound_reason(host, rule)
        elif level == 3:
            shown_method = _clip(method or "", 20)
            listed = _clip(", ".join(rule.methods or ()), 60)
            reason = (
                f"method {shown_method} is not allowed for {shown} by rule {rule.source} "
                f"(methods: {listed}); add {shown_method} to its methods"
            )
        else:
            listed = _clip(", ".join(rule.paths or ()), 80)
            reason = (
                f'path "{_clip(path, 80)}" is not allowed for {shown} by rule {rule.source} '
                f"(paths: {listed}); add a matching pattern to its paths"
            )
        return self._deny(reason, rule)
