"""Load policy files: read, parse with line numbers, validate, resolve ``extends``, compile.

Every problem found is reported as ``"file:line: message"`` (all of them, not only
the first) in one ``PolicyError``; the message says what to change.

A directory is read non-recursively: ``*.yaml`` / ``*.yml`` at its top level,
following symlinks that stay inside it, skipping dotfiles and dot-directories. That
reads Kubernetes ConfigMap mounts (``name.yaml -> ..data/name.yaml``) through their
top-level names; a symlink out of the directory is an error naming the link. A file may
hold several policies as YAML documents separated by ``---``. Files are named
``<directory name>/<file>`` (``policies/agents.yaml:4``) in rule sources and errors,
never by the host's absolute path, and errors quote at most a short, clipped piece of a
file (``_shown``): a file in the directory may be no policy at all.

Decisions documented here: ``protocol: tcp`` rules must list ``ports`` (raw TCP
has no default port); a missing ``egress`` is the same as an empty one (deny all);
a preset credential may override the preset's ``hosts`` and ``inject``; ``models`` is
only valid on a rule with ``credential:`` (it restricts inference calls the gateway
injects a key into); ``budgets`` are inherited through ``extends`` like rules, an own
budget replacing an inherited one of the same name, and are counted per deciding policy.
A credential with ``type:`` is minted by the gateway (``policy/minted.py`` lists the
types and their fields); it takes no ``preset``/``secret``/``inject``, its ``hosts``
default to the type's, and fields that hold secrets name them in the store.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.config import ConfigError, parse_duration
from gateway.services.policy.compiled import Policy, PolicySet, compile_policy
from gateway.services.policy.hosts import HostPattern, HostPatternError, compile_host_pattern
from gateway.services.policy.injection import Injection
from gateway.services.policy.methods import check_method
from gateway.services.policy.minted import (
    MINTED_PREFIX,
    TYPES,
    Field,
    MintSpec,
    Option,
    aws_hosts,
    cache_key,
)
from gateway.services.policy.model import (
    Budget,
    BudgetScope,
    Credential,
    MeteringRule,
    Mode,
    Protocol,
    Rule,
)
from gateway.services.policy.paths import PathPatternError, validate_path_pattern
from gateway.services.policy.presets import PRESETS
from gateway.services.policy.revision import content_hash, policy_revision

__all__ = [
    "PolicyError",
    "load_policy_dir",
    "load_policy_text",
    "load_policy_texts",
    "outside_error",
    "policy_files",
    "resolves_outside",
    "source_name",
]

_POLICY_KEYS = ("version", "name", "description", "mode", "extends", "egress", "credentials",
                "budgets")
_RULE_KEYS = ("host", "ports", "methods", "paths", "credential", "inspect", "protocol", "models",
              "metering", "allow_minted_secrets")
_METERING_KEYS = ("required", "reserve")
_BUDGET_KEYS = ("name", "per", "window", "tokens", "requests", "cost_usd", "credentials",
                "description")
_MIN_WINDOW = 60
_MODEL_GLOB = re.compile(r"[!-~]{1,200}")  # printable ASCII, no spaces
_CREDENTIAL_KEYS = ("preset", "secret", "hosts", "inject", "description", "type")
_SECRET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,126}")
_AWS_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_GITHUB_LEVELS = ("read", "write", "admin")
_INJECT_KEYS = ("header", "bearer", "query", "basic")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")


class PolicyError(Exception):
    """One or more problems in the policy files, each ``"file:line: message"``."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


_KEY_SHOWN = 40  # characters of a key an error quotes
_SHOWN = 64  # characters of any other value from a file an error quotes
_REPR = re.compile(r"'(?:[^'\\\n]|\\.)*'" + r'|"(?:[^"\\\n]|\\.)*"')  # quoted values


def _printable(text: str, limit: int) -> str:
    clean = "".join(c if c.isprintable() else "?" for c in text)  # no controls, no bidi
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def _shown(value: object, limit: int = _SHOWN) -> str:
    """A value from a policy file as an error quotes it: in double quotes, printable
    characters only, at most ``limit`` of them. Errors never echo more of a file than
    that: a file in the directory may be no policy at all (or hold a secret)."""
    text = value if isinstance(value, str) else repr(value)
    return '"' + _printable(text.replace('"', "'"), limit) + '"'


def _repr(value: object, limit: int = _SHOWN) -> str:
    """``repr(value)`` of a value from a file, clipped like ``_shown``."""
    text = repr(value)
    if len(text) <= limit and text.isprintable():
        return text
    return _printable(text, limit - 1) + (text[0] if text[0] in "'\"" else "")


def _clipped(message: str) -> str:
    """A library's error about a value (host and path patterns, durations, YAML), its
    quoted values clipped like ``_repr`` and the whole bounded."""
    out = _REPR.sub(lambda m: m.group() if len(m.group()) <= _SHOWN else
                    _printable(m.group(), _SHOWN - 1) + m.group()[0], message)
    return _printable(out, 300)


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


@dataclass
class _RawRule:
    fields: dict[str, Any]
    file: str
    line: int
    credential_node: Node | None = None
    host_pattern: HostPattern | None = None


@dataclass
class _RawBudget:
    budget: Budget
    file: str
    line: int
    credential_nodes: list[tuple[str, Node]] = field(default_factory=list)


@dataclass
class _RawPolicy:
    name: str
    mode: Mode
    file: str
    line: int
    named: bool = True
    extends: list[tuple[str, Node]] = field(default_factory=list)
    rules: list[_RawRule] = field(default_factory=list)
    extends_line: int = 0
    budgets: list[_RawBudget] = field(default_factory=list)


@dataclass
class _CredentialDef:
    credential: Credential
    where: str


class _Parser:
    """Walks composed YAML nodes, collecting errors with their file and line."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, int, str]] = []
        self.policies: list[_RawPolicy] = []
        self.credentials: dict[str, _CredentialDef] = {}
        self._constructor = SafeConstructor()

    # -- helpers -------------------------------------------------------------

    def err(self, file: str, node: Node | None, message: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1
        self.errors.append((file, line, message))

    def scalar(self, node: Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def mapping(
        self, file: str, node: Node, allowed: tuple[str, ...], what: str
    ) -> dict[str, tuple[Node, Node]] | None:
        """Keys of a mapping node with their key/value nodes; unknown keys reported."""
        if not isinstance(node, MappingNode):
            self.err(file, node, f"{what} must be a mapping (key: value)")
            return None
        out: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                self.err(file, key_node, f"{what} keys must be strings")
                continue
            if key in out:
                first = out[key][0].start_mark.line + 1
                self.err(file, key_node, f"duplicate key {_shown(key, _KEY_SHOWN)} "
                         f"(first at line {first})")
                continue
            if key not in allowed:
                self.err(
                    file,
                    key_node,
                    f"unknown key {_shown(key, _KEY_SHOWN)} in {what}{_suggest(key, allowed)}; "
                    f"known keys: {', '.join(allowed)}",
                )
                continue
            out[key] = (key_node, value_node)
        return out

    def string(self, file: str, node: Node, what: str) -> str | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, str) or not value:
            self.err(file, node, f"{what} must be a non-empty string")
            return None
        return value

    def string_list(self, file: str, node: Node, what: str) -> list[tuple[str, Node]] | None:
        if not isinstance(node, SequenceNode):
            self.err(file, node, f'{what} must be a list, e.g. {what}: ["..."]')
            return None
        items: list[tuple[str, Node]] = []
        for item in node.value:
            value = self.string(file, item, f"each entry of {what}")
            if value is not None:
                items.append((value, item))
        return items

    def boolean(self, file: str, node: Node, what: str) -> bool | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if not isinstance(value, bool):
            self.err(file, node, f"{what} must be true or false")
            return None
        return value

    # -- documents -----------------------------------------------------------

    def parse_file(self, file: str, text: str) -> None:
        try:
            documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            problem = exc.problem or exc.context or "syntax error"
            self.errors.append((file, line, f"invalid YAML: {_clipped(problem)}"))
            return
        except yaml.YAMLError as exc:
            self.errors.append((file, 1, f"invalid YAML: {_clipped(str(exc))}"))
            return
        documents = [d for d in documents if d is not None]
        if not documents:
            self.errors.append((file, 1, "empty policy file; add version: v1, name: and egress:"))
        for document in documents:
            self.parse_policy(file, document)

    def parse_policy(self, file: str, node: Node) -> None:
        keys = self.mapping(file, node, _POLICY_KEYS, "a policy")
        if keys is None:
            return
        if "version" not in keys:
            self.err(file, node, "missing version; add version: v1")
        else:
            version_node = keys["version"][1]
            version = self.scalar(version_node) if isinstance(version_node, ScalarNode) else None
            if version != "v1":
                self.err(file, version_node,
                         f"unsupported version {_repr(version)}; use version: v1")
        name: str | None = None
        if "name" not in keys:
            self.err(file, node, "missing name; add name: <policy name>")
        else:
            name_node = keys["name"][1]
            name = self.string(file, name_node, "name")
            if name is not None and not _NAME.fullmatch(name):
                self.err(
                    file,
                    name_node,
                    f'invalid policy name {_shown(name)}; use letters, digits, ".", "_", "-"',
                )
                name = None
        if "description" in keys:
            self.string(file, keys["description"][1], "description")
        mode: Mode = "enforce"
        if "mode" in keys:
            mode_node = keys["mode"][1]
            value = self.scalar(mode_node) if isinstance(mode_node, ScalarNode) else None
            if value == "report":
                mode = "report"
            elif value != "enforce":
                self.err(file, mode_node, f"invalid mode {_repr(value)}; use enforce or report")
        line = node.start_mark.line + 1
        policy = _RawPolicy(
            name=name or f"<unnamed policy at {file}:{line}>",
            mode=mode,
            file=file,
            line=line,
            named=name is not None,
        )
        if "extends" in keys:
            ext_node = keys["extends"][1]
            policy.extends_line = ext_node.start_mark.line + 1
            items = self.string_list(file, ext_node, "extends")
            policy.extends = items or []
        if "credentials" in keys:
            self.parse_credentials(file, keys["credentials"][1], name or "")
        if "egress" in keys:
            egress = keys["egress"][1]
            if isinstance(egress, ScalarNode) and self.scalar(egress) is None:
                pass  # "egress:" with nothing = deny all
            elif not isinstance(egress, SequenceNode):
                self.err(file, egress, "egress must be a list of rules (- host: ...)")
            else:
                for rule_node in egress.value:
                    rule = self.parse_rule(file, rule_node)
                    if rule is not None:
                        policy.rules.append(rule)
        if "budgets" in keys:
            self.parse_budgets(file, keys["budgets"][1], policy)
        self.policies.append(policy)

    def parse_rule(self, file: str, node: Node) -> _RawRule | None:
        keys = self.mapping(file, node, _RULE_KEYS, "an egress rule")
        if keys is None:
            return None
        ok = True
        fields: dict[str, Any] = {}
        raw = _RawRule(fields=fields, file=file, line=node.start_mark.line + 1)
        if "host" not in keys:
            self.err(file, node, "egress rule has no host; add host: <name>")
            ok = False
        else:
            host_node = keys["host"][1]
            host = self.string(file, host_node, "host")
            if host is None:
                ok = False
            else:
                try:
                    raw.host_pattern = compile_host_pattern(host)
                    fields["host"] = raw.host_pattern.text
                except HostPatternError as exc:
                    self.err(file, host_node, _clipped(str(exc)))
                    ok = False
        if "ports" in keys:
            ports = self.parse_ports(file, keys["ports"][1])
            ok = ok and ports is not None
            fields["ports"] = ports
        if "methods" in keys:
            methods = self.parse_methods(file, keys["methods"][1])
            ok = ok and methods is not None
            fields["methods"] = methods
        if "paths" in keys:
            paths = self.parse_paths(file, keys["paths"][1])
            ok = ok and paths is not None
            fields["paths"] = paths
        if "credential" in keys:
            raw.credential_node = keys["credential"][1]
            credential = self.string(file, raw.credential_node, "credential")
            ok = ok and credential is not None
            fields["credential"] = credential
        if "inspect" in keys:
            inspect = self.boolean(file, keys["inspect"][1], "inspect")
            ok = ok and inspect is not None
            fields["inspect"] = bool(inspect)
        protocol: Protocol = "http"
        if "protocol" in keys:
            protocol_node = keys["protocol"][1]
            value = self.scalar(protocol_node) if isinstance(protocol_node, ScalarNode) else None
            if value == "tcp":
                protocol = "tcp"
            elif value != "http":
                self.err(file, protocol_node, f"invalid protocol {_repr(value)}; use http or tcp")
                ok = False
        fields["protocol"] = protocol
        if "models" in keys:
            models_node = keys["models"][1]
            models = self.parse_models(file, models_node)
            ok = ok and models is not None
            fields["models"] = models
            if "credential" not in keys:
                self.err(
                    file,
                    models_node,
                    "models needs credential: on the same rule (the allowlist applies to "
                    "inference calls the gateway injects a key into); add credential: or "
                    "remove models",
                )
                ok = False
        for key in ("metering", "allow_minted_secrets"):
            if key not in keys:
                continue
            value_node = keys[key][1]
            if key == "metering":
                metering = self.parse_metering(file, value_node)
                ok = ok and metering is not None
                fields["metering"] = metering
            else:
                allow = self.boolean(file, value_node, key)
                ok = ok and allow is not None
                fields["allow_minted_secrets"] = bool(allow)
            if "credential" not in keys:
                self.err(file, value_node, f"{key} needs credential: on the same rule (it "
                         "applies to inference calls the gateway injects a key into); add "
                         f"credential: or remove {key}")
                ok = False
        if protocol == "tcp":
            clashing: list[str] = [k for k in ("methods", "paths", "credential", "models")
                                   if k in keys]
            if fields.get("inspect"):
                clashing.append("inspect")
            if clashing:
                self.err(
                    file,
                    keys["protocol"][1],
                    f"protocol: tcp cannot be combined with {', '.join(clashing)} (raw TCP is "
                    "not inspected); remove them or use protocol: http",
                )
                ok = False
            if "ports" not in keys:
                self.err(
                    file,
                    keys["protocol"][1],
                    "protocol: tcp needs explicit ports (e.g. ports: [22])",
                )
                ok = False
        return raw if ok else None

    def parse_ports(self, file: str, node: Node) -> tuple[int, ...] | None:
        if not isinstance(node, SequenceNode) or not node.value:
            self.err(file, node, "ports must be a non-empty list of numbers, e.g. ports: [443]")
            return None
        ports: list[int] = []
        ok = True
        for item in node.value:
            value = self.scalar(item) if isinstance(item, ScalarNode) else None
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                self.err(file, item, f"invalid port {_repr(value)}; use a number from 1 to 65535")
                ok = False
            elif value not in ports:
                ports.append(value)
        return tuple(ports) if ok else None

    def parse_methods(self, file: str, node: Node) -> tuple[str, ...] | None:
        items = self.string_list(file, node, "methods")
        if items is None:
            return None
        if not items and isinstance(node, SequenceNode) and not node.value:
            self.err(file, node, "methods is empty; list methods (e.g. [GET]) or omit it for all")
            return None
        methods: list[str] = []
        ok = len(items) == len(node.value) if isinstance(node, SequenceNode) else False
        for value, item in items:
            method, problem = check_method(value)
            if method is None:
                self.err(file, item, problem or f'invalid method "{value[:32]}"')
                ok = False
            elif method not in methods:
                methods.append(method)
        return tuple(methods) if ok else None

    def parse_paths(self, file: str, node: Node) -> tuple[str, ...] | None:
        items = self.string_list(file, node, "paths")
        if items is None:
            return None
        if isinstance(node, SequenceNode) and not node.value:
            self.err(file, node, 'paths is empty; list path patterns (e.g. ["/v1/**"]) or omit it')
            return None
        ok = isinstance(node, SequenceNode) and len(items) == len(node.value)
        paths: list[str] = []
        for value, item in items:
            try:
                validate_path_pattern(value)
            except PathPatternError as exc:
                self.err(file, item, _clipped(str(exc)))
                ok = False
                continue
            if value not in paths:
                paths.append(value)
        return tuple(paths) if ok else None

    def parse_models(self, file: str, node: Node) -> tuple[str, ...] | None:
        items = self.string_list(file, node, "models")
        if items is None:
            return None
        if isinstance(node, SequenceNode) and not node.value:
            self.err(file, node, 'models is empty; list model globs (e.g. ["gpt-4o-mini"]) '
                     "or omit it to allow every model")
            return None
        ok = isinstance(node, SequenceNode) and len(items) == len(node.value)
        models: list[str] = []
        for value, item in items:
            if not _MODEL_GLOB.fullmatch(value):
                self.err(file, item, f"invalid model pattern {_repr(value)}; use a model name "
                         'or a glob such as "claude-sonnet-*" (printable ASCII, no spaces)')
                ok = False
            elif value not in models:
                models.append(value)
        return tuple(models) if ok else None

    def parse_metering(self, file: str, node: Node) -> MeteringRule | None:
        """``metering: required | optional`` or ``{required: bool, reserve: tokens}``."""
        if isinstance(node, ScalarNode):
            value = self.scalar(node)
            if value in ("required", "optional"):
                return MeteringRule(required=value == "required")
            self.err(file, node, f"invalid metering {str(value)[:32]!r}; use required, "
                     "optional or {required: true, reserve: <output tokens>}")
            return None
        keys = self.mapping(file, node, _METERING_KEYS, "metering")
        if keys is None:
            return None
        required: bool | None = True
        if "required" in keys:
            required = self.boolean(file, keys["required"][1], "metering.required")
        reserve: int | None = None
        if "reserve" in keys:
            reserve_node = keys["reserve"][1]
            value = self.scalar(reserve_node) if isinstance(reserve_node, ScalarNode) else None
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                self.err(file, reserve_node, "metering.reserve must be a positive whole number "
                         "of output tokens (what a call without max_tokens reserves)")
                return None
            reserve = value
        if required is None:
            return None
        return MeteringRule(required=required, reserve=reserve)

    def parse_budgets(self, file: str, node: Node, policy: _RawPolicy) -> None:
        if isinstance(node, ScalarNode) and self.scalar(node) is None:
            return
        if not isinstance(node, SequenceNode):
            self.err(file, node, "budgets must be a list (- name: ..., per: ..., window: ...)")
            return
        seen: dict[str, int] = {}
        for item in node.value:
            raw = self.parse_budget(file, item, policy.name if policy.named else "")
            if raw is None:
                continue
            name = raw.budget.name
            if name in seen:
                self.err(file, item, f'duplicate budget "{name}" (first at line {seen[name]}); '
                         "budget names must be unique within a policy")
                continue
            seen[name] = raw.line
            policy.budgets.append(raw)

    def parse_budget(self, file: str, node: Node, policy: str) -> _RawBudget | None:
        keys = self.mapping(file, node, _BUDGET_KEYS, "a budget")
        if keys is None:
            return None
        ok = True
        name: str | None = None
        if "name" not in keys:
            self.err(file, node, "budget has no name; add name: <budget name>")
            ok = False
        else:
            name = self.string(file, keys["name"][1], "name")
            if name is not None and not _NAME.fullmatch(name):
                self.err(file, keys["name"][1], f"invalid budget name {_shown(name)}; use "
                         'letters, digits, ".", "_", "-"')
                name = None
            ok = ok and name is not None
        per: BudgetScope = "sandbox"
        if "per" not in keys:
            self.err(file, node, "budget has no per; add per: sandbox (each sandbox its own "
                     "allowance) or per: policy (one allowance for all its sandboxes)")
            ok = False
        else:
            value = self.scalar(keys["per"][1]) if isinstance(keys["per"][1], ScalarNode) else None
            if value == "policy":
                per = "policy"
            elif value != "sandbox":
                self.err(file, keys["per"][1], f"invalid per {_repr(value)}; use sandbox or policy")
                ok = False
        window: int | Literal["month"] | None = None
        window_text = ""
        if "window" not in keys:
            self.err(file, node, "budget has no window; add e.g. window: 24h (or month)")
            ok = False
        else:
            window_node = keys["window"][1]
            raw_window = self.scalar(window_node) if isinstance(window_node, ScalarNode) else None
            window_text = str(raw_window)
            if raw_window == "month":
                window = "month"
            else:
                try:
                    seconds = parse_duration(raw_window, "window")
                except ConfigError as exc:
                    self.err(file, window_node, f"{_clipped(str(exc))}, or month")
                    seconds = 0.0
                if seconds and (seconds < _MIN_WINDOW or seconds != int(seconds)):
                    self.err(file, window_node, f"window {_repr(window_text)} must be whole "
                             "seconds, at least 1m")
                elif seconds:
                    window = int(seconds)
            ok = ok and window is not None
        limits: dict[str, int | float] = {}
        for key in ("tokens", "requests", "cost_usd"):
            if key not in keys:
                continue
            value_node = keys[key][1]
            value = self.scalar(value_node) if isinstance(value_node, ScalarNode) else None
            whole = isinstance(value, int) and not isinstance(value, bool)
            real = key == "cost_usd" and isinstance(value, float) and math.isfinite(value)
            number: int | float | None = value if whole or real else None
            if number is None or number <= 0:
                kind = "a positive number" if key == "cost_usd" else "a positive whole number"
                self.err(file, value_node, f"{key} must be {kind}, got {_repr(value)}")
                ok = False
            else:
                limits[key] = number
        if not any(k in keys for k in ("tokens", "requests", "cost_usd")):
            self.err(file, node, "budget sets no limit; add tokens:, requests: or cost_usd:")
            ok = False
        credential_nodes: list[tuple[str, Node]] = []
        if "credentials" in keys:
            items = self.string_list(file, keys["credentials"][1], "credentials")
            cred_node = keys["credentials"][1]
            if items is None or (isinstance(cred_node, SequenceNode) and not cred_node.value):
                if items is not None:
                    self.err(file, cred_node, "credentials is empty; list credential names or "
                             "omit it for every credential of the policy")
                ok = False
            else:
                credential_nodes = items
        if "description" in keys:
            self.string(file, keys["description"][1], "description")
        if not ok or name is None or window is None:
            return None
        tokens, requests = limits.get("tokens"), limits.get("requests")
        cost = limits.get("cost_usd")
        budget = Budget(
            name=name, per=per, window=window, window_text=window_text,
            tokens=int(tokens) if tokens is not None else None,
            requests=int(requests) if requests is not None else None,
            cost_usd=float(cost) if cost is not None else None,
            credentials=tuple(dict.fromkeys(c for c, _ in credential_nodes)) or None,
            source=f"{file}:{node.start_mark.line + 1}", policy=policy,
        )
        return _RawBudget(budget, file, node.start_mark.line + 1, credential_nodes)

    def parse_credentials(self, file: str, node: Node, policy: str) -> None:
        if isinstance(node, ScalarNode) and self.scalar(node) is None:
            return
        if not isinstance(node, MappingNode):
            self.err(
                file, node, "credentials must be a mapping of name: {preset: ..., secret: ...}"
            )
            return
        seen_here: set[str] = set()
        for key_node, value_node in node.value:
            name = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                self.err(
                    file,
                    key_node,
                    f"invalid credential name {_repr(name)}; use letters, digits, '.', '_', '-'",
                )
                continue
            where = f"{file}:{key_node.start_mark.line + 1}"
            if name in self.credentials or name in seen_here:
                first = self.credentials[name].where if name in self.credentials else file
                self.err(
                    file,
                    key_node,
                    f'duplicate credential "{name}" (first defined at {first}); credential names '
                    "are global across all policy files",
                )
                continue
            seen_here.add(name)
            credential = self.parse_credential(file, name, value_node, policy, where)
            if credential is not None:
                self.credentials[name] = _CredentialDef(credential, where)

    def parse_credential(
        self, file: str, name: str, node: Node, policy: str, where: str
    ) -> Credential | None:
        type_node = _value_of(node, "type")
        if type_node is not None:
            return self.parse_minted(file, name, node, type_node, policy, where)
        keys = self.mapping(file, node, _CREDENTIAL_KEYS, f'credential "{name}"')
        if keys is None:
            return None
        ok = True
        preset_name: str | None = None
        hosts: tuple[str, ...] | None = None
        injection: Injection | None = None
        secret: str | None = None
        if "preset" in keys:
            preset_node = keys["preset"][1]
            preset_name = self.string(file, preset_node, "preset")
            if preset_name is not None and preset_name not in PRESETS:
                known = tuple(PRESETS)
                self.err(
                    file,
                    preset_node,
                    f"unknown preset {_shown(preset_name)}{_suggest(preset_name, known)}; "
                    f"presets: {', '.join(known)}",
                )
                preset_name = None
            ok = preset_name is not None
        if "secret" not in keys:
            self.err(file, node, f'credential "{name}" has no secret; add secret: <secret name>')
            ok = False
        else:
            secret = self.string(file, keys["secret"][1], "secret")
            if secret is not None and secret.startswith(MINTED_PREFIX):
                self.err(file, keys["secret"][1], f'secret names starting "{MINTED_PREFIX}" '
                         "are the gateway's own (minted values); rename the secret")
                secret = None
            ok = ok and secret is not None
        if "description" in keys:
            self.string(file, keys["description"][1], "description")
        if "hosts" in keys:
            hosts = self.parse_credential_hosts(file, keys["hosts"][1])
            ok = ok and hosts is not None
        if "inject" in keys:
            injection = self.parse_inject(file, keys["inject"][1])
            ok = ok and injection is not None
        if "preset" not in keys and ("hosts" not in keys or "inject" not in keys):
            self.err(
                file,
                node,
                f'credential "{name}" needs preset: (one of {", ".join(PRESETS)}) '
                "or both hosts: and inject:",
            )
            ok = False
        if not ok or secret is None:
            return None
        if preset_name is not None:
            preset = PRESETS[preset_name]
            hosts = hosts or preset.hosts
            injection = injection or preset.injection
        assert hosts is not None and injection is not None
        return Credential(
            name=name,
            secret=secret,
            hosts=hosts,
            injection=injection,
            preset=preset_name,
            source=where,
            policy=policy,
        )

    def parse_minted(
        self, file: str, name: str, node: Node, type_node: Node, policy: str, where: str
    ) -> Credential | None:
        """A credential the gateway mints (``type:``): its fields checked by its type."""
        type_name = self.string(file, type_node, "type")
        if type_name is None:
            return None
        kind = TYPES.get(type_name)
        if kind is None:
            known = tuple(TYPES)
            self.err(file, type_node, f"unknown credential type {_shown(type_name)}"
                     f"{_suggest(type_name, known)}; types: {', '.join(known)} (or no type: "
                     "and preset:/secret: for a key from the secret store)")
            return None
        allowed = ("type", "hosts", "description", *(f.name for f in kind.fields))
        keys = self.mapping(file, node, allowed, f'credential "{name}" (type {type_name})')
        if keys is None:
            return None
        ok = True
        options: dict[str, Option] = {}
        for spec_field in kind.fields:
            if spec_field.name not in keys:
                if spec_field.required:
                    self.err(file, node, f'credential "{name}" (type {type_name}) has no '
                             f"{spec_field.name}; add {spec_field.name}: "
                             f"<{_FIELD_HINTS[spec_field.kind]}>")
                    ok = False
                elif spec_field.default is not None:
                    options[spec_field.name] = spec_field.default
                continue
            value = self.parse_field(file, keys[spec_field.name][1], spec_field)
            if value is None:
                ok = False
            else:
                options[spec_field.name] = value
        if "description" in keys:
            self.string(file, keys["description"][1], "description")
        hosts: tuple[str, ...] | None = None
        if "hosts" in keys:
            hosts = self.parse_credential_hosts(file, keys["hosts"][1])
            ok = ok and hosts is not None
        if not ok:
            return None
        if not self.check_minted(file, name, node, type_name, options, keys):
            return None
        if hosts is None:
            hosts = kind.hosts
            if type_name == "aws-sigv4":
                hosts = aws_hosts(str(options["service"]), str(options["region"]))
            if not hosts:
                self.err(file, node, f'credential "{name}" (type {type_name}) has no hosts; '
                         "add hosts: [<the API hosts this token may be sent to>]")
                return None
        spec = MintSpec.of(type_name, options)
        return Credential(name=name, secret=cache_key(name, spec), hosts=hosts,
                          injection=kind.carriers, places=kind.places, signs=kind.signs,
                          challenge=kind.challenge, mint=spec, source=where, policy=policy)

    def parse_field(self, file: str, node: Node, spec: Field) -> Option | None:
        """One field of a minted credential, checked by its kind (None: reported)."""
        what = spec.name
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        if spec.kind in ("text", "path"):
            if isinstance(value, int) and not isinstance(value, bool) and spec.kind == "text":
                return str(value)
            return self.string(file, node, what)
        if spec.kind == "secret":
            text = self.string(file, node, what)
            if text is not None and not _SECRET_NAME.fullmatch(text):
                self.err(file, node, f"{what}: {_shown(text)} is not a secret name; name the "
                         "secret in the store that holds it (letters, digits, '.', '_', '-')")
                return None
            return text
        if spec.kind == "url":
            text = self.string(file, node, what)
            if text is None:
                return None
            parts = urlsplit(text)
            if parts.scheme != "https" or not parts.hostname or parts.query or \
                    parts.fragment or parts.username or parts.password:
                self.err(file, node, f"{what}: {_shown(text)} must be an https:// URL without "
                         "query or credentials (the gateway's own calls use TLS only)")
                return None
            return text.rstrip("/")
        if spec.kind == "id":
            if isinstance(value, str) and value.isdigit():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self.err(file, node, f"{what} must be a positive whole number")
                return None
            return value
        if spec.kind == "flag":
            return self.boolean(file, node, what)
        if spec.kind == "choice":
            if value not in spec.choices:
                self.err(file, node, f"invalid {what} {_repr(value)}; use one of "
                         f"{', '.join(spec.choices)}")
                return None
            return str(value)
        if spec.kind == "duration":
            try:
                seconds = parse_duration(value, what)
            except ConfigError as exc:
                self.err(file, node, _clipped(str(exc)))
                return None
            return int(seconds)
        if spec.kind == "texts":
            items = self.string_list(file, node, what)
            if items is None:
                return None
            if not items or (isinstance(node, SequenceNode) and len(items) != len(node.value)):
                if not items:
                    self.err(file, node, f"{what} is empty; list at least one or omit it")
                return None
            return tuple(v for v, _ in items)
        keys = self.mapping_of_strings(file, node, what)
        return None if keys is None else tuple(sorted(keys.items()))

    def mapping_of_strings(self, file: str, node: Node, what: str) -> dict[str, str] | None:
        if not isinstance(node, MappingNode) or not node.value:
            self.err(file, node, f"{what} must be a non-empty mapping (name: value)")
            return None
        out: dict[str, str] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
            value = self.scalar(value_node) if isinstance(value_node, ScalarNode) else None
            if not isinstance(key, str) or not isinstance(value, str) or not key or not value:
                self.err(file, key_node, f"{what} maps names to strings")
                return None
            out[key] = value
        return out

    def check_minted(self, file: str, name: str, node: Node, type_name: str,
                     options: dict[str, Option], keys: dict[str, tuple[Node, Node]]) -> bool:
        """Rules across the fields of one type (which combinations make a credential)."""
        where = f'credential "{name}" (type {type_name})'

        def fail(message: str, key: str | None = None) -> bool:
            self.err(file, keys[key][1] if key is not None and key in keys else node,
                     f"{where}: {message}")
            return False

        if type_name == "github-app":
            for perm, level in _pairs(options.get("permissions")):
                if level not in _GITHUB_LEVELS:
                    return fail(f"permission {_printable(str(perm), _SHOWN)}: {_repr(level)} "
                                f"is not one of {', '.join(_GITHUB_LEVELS)}", "permissions")
        elif type_name == "aws-sigv4":
            for key in ("service", "region"):
                if not _AWS_NAME.fullmatch(str(options[key])):
                    return fail(f"{key} {_repr(options[key])} is not an AWS {key} name "
                                "(e.g. bedrock, us-east-1)", key)
            pair = [k for k in ("access_key_id", "secret_access_key") if k in options]
            if len(pair) == 1:
                return fail("access_key_id and secret_access_key go together (the names of "
                            "the two secrets holding the key pair)", pair[0])
            web = options.get("web_identity") is True
            if web and pair:
                return fail("web_identity: true takes no access keys: the role is assumed "
                            "with the pod's web identity token", "web_identity")
            if not web and not pair:
                return fail("needs a key pair (access_key_id: and secret_access_key: secret "
                            "names, optionally role_arn:) or web_identity: true with role_arn:")
            role = options.get("role_arn")
            if web and role is None:
                return fail("web_identity: true needs role_arn: (the role to assume)")
            if role is not None and not str(role).startswith("arn:"):
                return fail(f"role_arn {_repr(str(role))} must be an ARN "
                            "(arn:aws:iam::<account>:role/<name>)", "role_arn")
            duration = options.get("duration")
            if isinstance(duration, int) and not 900 <= duration <= 43200:
                return fail("duration must be between 15m and 12h (STS limits)", "duration")
        elif type_name == "gcp-service-account":
            web = options.get("workload_identity") is True
            if web == ("key" in options):
                return fail("needs exactly one of key: (the secret holding the service "
                            "account's JSON key) or workload_identity: true")
        return True

    def parse_credential_hosts(self, file: str, node: Node) -> tuple[str, ...] | None:
        items = self.string_list(file, node, "hosts")
        if items is None:
            return None
        if isinstance(node, SequenceNode) and not node.value:
            self.err(file, node, "hosts is empty; list the hosts this credential may be sent to")
            return None
        ok = isinstance(node, SequenceNode) and len(items) == len(node.value)
        hosts: list[str] = []
        for value, item in items:
            try:
                hosts.append(compile_host_pattern(value).text)
            except HostPatternError as exc:
                self.err(file, item, _clipped(str(exc)))
                ok = False
        return tuple(hosts) if ok else None

    def parse_inject(self, file: str, node: Node) -> Injection | None:
        keys = self.mapping(file, node, _INJECT_KEYS, "inject")
        if keys is None:
            return None
        if len(keys) != 1:
            self.err(
                file,
                node,
                "inject needs exactly one of {header: NAME}, {bearer: true}, {query: NAME}, "
                "{basic: USER}",
            )
            return None
        ((kind, (_, value_node)),) = keys.items()
        if kind == "bearer":
            value = self.boolean(file, value_node, "bearer")
            if value is not True:
                if value is False:
                    self.err(file, value_node, "bearer: false injects nothing; use bearer: true")
                return None
            return Injection("bearer")
        text = self.string(file, value_node, kind)
        if text is None:
            return None
        if kind in ("header", "query") and not _HEADER.fullmatch(text):
            self.err(file, value_node, f"invalid {kind} name {_shown(text)}")
            return None
        if kind == "header":
            return Injection("header", text)
        if kind == "query":
            return Injection("query", text)
        return Injection("basic", text)


_FIELD_HINTS = {"text": "value", "secret": "secret name", "url": "https URL",
                "id": "number", "texts": "list", "mapping": "mapping", "flag": "true|false",
                "path": "file path", "duration": "duration", "choice": "choice"}


def _value_of(node: Node, key: str) -> Node | None:
    """The value node of ``key`` in a mapping node, if present."""
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.value == key:
                found: Node = value_node
                return found
    return None


def _pairs(value: Option | None) -> list[tuple[str, str]]:
    return [p for p in value if isinstance(p, tuple)] if isinstance(value, tuple) else []


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


def _build(parser: _Parser, revision: str = "") -> PolicySet:
    """Cross-file checks, extends resolution and compilation (raises PolicyError)."""
    errors = parser.errors
    by_name: dict[str, _RawPolicy] = {}
    for raw in parser.policies:
        if raw.name in by_name:
            first = by_name[raw.name]
            errors.append(
                (
                    raw.file,
                    raw.line,
                    f'duplicate policy name "{raw.name}" (also in {first.file}:{first.line}); '
                    "policy names must be unique across files",
                )
            )
            continue
        by_name[raw.name] = raw
    credentials = {name: d.credential for name, d in parser.credentials.items()}
    known_credentials = tuple(credentials)

    own_rules: dict[str, list[Rule]] = {}
    for raw in by_name.values():
        rules: list[Rule] = []
        for raw_rule in raw.rules:
            cred_name = raw_rule.fields.get("credential")
            if cred_name is not None:
                cred = credentials.get(cred_name)
                node = raw_rule.credential_node
                line = raw_rule.line if node is None else node.start_mark.line + 1
                if cred is None:
                    errors.append(
                        (
                            raw.file,
                            line,
                            f"unknown credential {_shown(cred_name)}"
                            f"{_suggest(cred_name, known_credentials)}; define it under "
                            "credentials: in any policy file",
                        )
                    )
                    continue
                assert raw_rule.host_pattern is not None
                if not _can_reach(raw_rule.host_pattern, cred.host_patterns):
                    errors.append(
                        (
                            raw.file,
                            line,
                            f'credential "{cred_name}" is only sent to {", ".join(cred.hosts)}, '
                            f"which host {raw_rule.host_pattern.text} never reaches; fix the "
                            "rule's host or use another credential",
                        )
                    )
                    continue
            source = f"{raw_rule.file}:{raw_rule.line}"
            rules.append(Rule(source=source, policy=raw.name, **raw_rule.fields))
        own_rules[raw.name] = rules

    resolved: dict[str, list[Rule]] = {}
    known_policies = tuple(name for name, raw in by_name.items() if raw.named)

    def resolve(name: str, stack: list[str]) -> list[Rule]:
        if name in resolved:
            return resolved[name]
        raw = by_name[name]
        out: list[Rule] = list(own_rules[name])
        seen = {id(r) for r in out}
        for parent, node in raw.extends:
            line = node.start_mark.line + 1
            if parent not in known_policies:
                errors.append(
                    (
                        raw.file,
                        line,
                        f'policy "{name}" extends unknown policy {_shown(parent)}'
                        f"{_suggest(parent, known_policies)}",
                    )
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
    if errors:
        raise PolicyError(_format(errors))

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
        )
    files = tuple(dict.fromkeys(raw.file for raw in parser.policies))
    return PolicySet(policies=policies, credentials=credentials, files=files, revision=revision)


def _budgets(
    by_name: Mapping[str, _RawPolicy],
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
            for cred, node in raw_budget.credential_nodes:
                line = node.start_mark.line + 1
                if cred not in credentials:
                    errors.append((raw.file, line, f'budget "{raw_budget.budget.name}" names '
                                   f"unknown credential {_shown(cred)}{_suggest(cred, known)}"))
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


def _format(errors: list[tuple[str, int, str]]) -> list[str]:
    """``file:line: message`` lines, grouped by file in line order, duplicates dropped."""
    order = {file: i for i, (file, _, _) in reversed(list(enumerate(errors)))}
    ranked = sorted(dict.fromkeys(errors), key=lambda e: (order[e[0]], e[1]))
    return [f"{file}:{line}: {message}" for file, line, message in ranked]


def load_policy_texts(files: Mapping[str, str], *, revision: str | None = None) -> PolicySet:
    """Load policies from ``{file name: YAML text}`` (raises PolicyError).

    ``revision`` defaults to the content hash of the texts (pure, no I/O).
    """
    parser = _Parser()
    for file, text in files.items():
        parser.parse_file(file, text)
    if revision is None:
        revision = content_hash({name: text.encode("utf-8") for name, text in files.items()})
    return _build(parser, revision)


def load_policy_text(name: str, text: str) -> PolicySet:
    """Load one YAML text as if it were the file ``name`` (for tests and tools)."""
    return load_policy_texts({name: text})


def policy_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The policy files of a directory: top-level ``*.yaml``/``*.yml``, no dotfiles, sorted.

    Subdirectories are never read: ``tests/`` holds ``policy test`` cases, not policies.
    """
    base = Path(directory)
    out: list[Path] = []
    for name in sorted(os.listdir(base)):
        if name.startswith(".") or not name.endswith((".yaml", ".yml")):
            continue
        path = base / name
        if path.is_file():
            out.append(path)
    return out


def source_name(directory: str | os.PathLike[str]) -> str:
    """How sources name the policies directory: by its own name, never by the host's
    absolute path (a rule's source reaches refusal bodies, explain output and audit
    lines): ``policies/agents.yaml:4``."""
    return os.path.basename(os.path.abspath(os.fspath(directory))) or "policies"


def resolves_outside(directory: str | os.PathLike[str], path: str | os.PathLike[str]
                     ) -> str | None:
    """Where ``path`` really is if a symlink (of the file or of a directory on its way)
    takes it out of ``directory``; None when it stays inside (a Kubernetes ConfigMap's
    ``name.yaml -> ..data/name.yaml -> ..2026_…/name.yaml`` does)."""
    base = os.path.realpath(directory)
    real = os.path.realpath(path)
    return None if Path(real).is_relative_to(base) else real


def outside_error(name: str, real: str, directory: str | os.PathLike[str]) -> str:
    """The message for a file that a symlink takes out of the policies directory."""
    return (f"{name} is a symbolic link to {real}, outside the policies directory "
            f"{os.path.realpath(directory)}; the gateway reads policy files only inside "
            "it: copy the file into the directory, or point the link at a file inside it "
            "(as a ConfigMap's ..data links do)")


def _unreadable(exc: OSError | UnicodeDecodeError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"cannot read: not UTF-8 text (byte {exc.start})"
    return f"cannot read: {exc.strerror or type(exc).__name__}"


def load_policy_dir(directory: str | os.PathLike[str]) -> PolicySet:
    """Load every policy file in ``directory`` (raises PolicyError listing every problem).

    Files are named ``<directory name>/<file>`` in sources and errors (``source_name``).
    A file that a symlink takes out of the directory is an error, never read.
    The set's ``revision`` comes from git, a ``REVISION`` file or the bytes read here
    (``revision.policy_revision``), computed once the files are valid.
    """
    try:
        paths = policy_files(directory)
    except OSError as exc:
        raise PolicyError(
            [f"{os.fspath(directory)}:0: cannot read policy directory: {exc.strerror or exc}"]
        ) from None
    if not paths:
        raise PolicyError(
            [f"{os.fspath(directory)}:0: no policy files (*.yaml, *.yml) in this directory"]
        )
    shown = source_name(directory)
    raw: dict[str, bytes] = {}
    parser = _Parser()
    for path in paths:
        name = f"{shown}/{path.name}"
        real = resolves_outside(directory, path)
        if real is not None:
            parser.errors.append((name, 1, outside_error(path.name, real, directory)))
            continue
        try:  # the file checked, not the link again (it may be swapped meanwhile)
            data = Path(os.path.realpath(path)).read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            parser.errors.append((name, 1, _unreadable(exc)))
            continue
        raw[path.name] = data
        parser.parse_file(name, text)
    policy_set = _build(parser)
    return replace(policy_set, revision=policy_revision(directory, raw))
