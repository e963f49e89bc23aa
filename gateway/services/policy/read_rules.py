"""Egress rules and budgets as a policy file writes them (ports, methods, paths, models,
metering, budget windows and limits)."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from yaml.nodes import Node, ScalarNode, SequenceNode

from gateway.config import ConfigError, parse_duration
from gateway.core.policy.hosts import HostPatternError, compile_host_pattern
from gateway.core.policy.methods import check_method
from gateway.core.policy.model import (
    Budget,
    BudgetScope,
    MeteringRule,
    Protocol,
)
from gateway.core.policy.paths import PathPatternError, validate_path_pattern
from gateway.services.policy.nodes import NAME, RawBudget, RawPolicy, RawRule
from gateway.services.policy.problems import clipped, quoted, shown
from gateway.services.policy.read_ask import AskReader
from gateway.services.policy.read_mcp import McpReader

_RULE_KEYS = ("host", "ports", "methods", "paths", "credential", "inspect", "protocol", "models",
              "metering", "allow_minted_secrets", "action", "reason", "mcp", "ask",
              "unmetered")
# A shipped agent preset's rules may also be marked `telemetry: true` (on or off by the
# switch of whoever extends the preset: see policy/agents.py).
_PRESET_RULE_KEYS = (*_RULE_KEYS, "telemetry")
ALLOW_ONLY = ("credential", "inspect", "models", "metering", "allow_minted_secrets", "mcp",
              "ask", "unmetered")
_MAX_REASON = 300


_METERING_KEYS = ("required", "reserve", "max_input_tokens")


_BUDGET_KEYS = ("name", "per", "window", "tokens", "requests", "cost_usd", "credentials",
                "description")


_MIN_WINDOW = 60


_MODEL_GLOB = re.compile(r"[!-~]{1,200}")  # printable ASCII, no spaces


class RuleReader(McpReader, AskReader):
    """The rules and budgets of a policy document."""

    def parse_rule(self, file: str, node: Node) -> RawRule | None:
        keys = self.mapping(file, node, _PRESET_RULE_KEYS if self.preset else _RULE_KEYS,
                            "an egress rule")
        if keys is None:
            return None
        ok = True
        fields: dict[str, Any] = {}
        raw = RawRule(fields=fields, file=file, line=node.start_mark.line + 1)
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
                    self.err(file, host_node, clipped(str(exc)))
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
                self.err(file, protocol_node, f"invalid protocol {quoted(value)}; use http or tcp")
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
        for key in ("metering", "allow_minted_secrets", "unmetered"):
            if key not in keys:
                continue
            value_node = keys[key][1]
            if key == "metering":
                metering = self.parse_metering(file, value_node)
                ok = ok and metering is not None
                fields["metering"] = metering
            elif key == "unmetered":
                unmetered = self.parse_paths(file, value_node, "unmetered")
                ok = ok and unmetered is not None
                fields["unmetered"] = unmetered
            else:
                allow = self.boolean(file, value_node, key)
                ok = ok and allow is not None
                fields["allow_minted_secrets"] = bool(allow)
            if "credential" not in keys:
                self.err(file, value_node, f"{key} needs credential: on the same rule (it "
                         "applies to inference calls the gateway injects a key into); add "
                         f"credential: or remove {key}")
                ok = False
        if "mcp" in keys:
            mcp = self.parse_mcp(file, keys["mcp"][1])
            ok = ok and mcp is not None
            fields["mcp"] = mcp
        if "ask" in keys:
            ask_node = keys["ask"][1]
            ask = self.parse_ask(file, ask_node, rule=True)
            ok = ok and (ask is not None or self.scalar(ask_node) is False)
            fields["ask"] = ask
        if protocol == "tcp":
            clashing: list[str] = [k for k in ("methods", "paths", "credential", "models",
                                               "mcp") if k in keys]
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
        ok = self.parse_action(file, keys, raw) and ok
        return raw if ok else None

    def parse_action(self, file: str, keys: dict[str, tuple[Node, Node]], raw: RawRule) -> bool:
        """``action: allow | deny`` with its ``reason`` (deny only), and a preset's
        ``telemetry: true``."""
        ok = True
        if "action" in keys:
            node = keys["action"][1]
            value = self.scalar(node) if isinstance(node, ScalarNode) else None
            if value not in ("allow", "deny"):
                self.err(file, node, f"invalid action {quoted(value)}; use allow or deny")
                return False
            raw.fields["action"] = value
            clashing = [k for k in ALLOW_ONLY if k in keys]
            if value == "deny" and clashing:
                self.err(file, node, f"action: deny cannot be combined with "
                         f"{', '.join(clashing)} (a deny rule allows nothing); remove them")
                ok = False
        if "reason" in keys:
            node = keys["reason"][1]
            reason = self.string(file, node, "reason")
            if raw.fields.get("action") != "deny":
                self.err(file, node, "reason is for action: deny rules (it is what a refused "
                         "request is told); add action: deny or remove reason")
                ok = False
            elif reason is not None and not 0 < len(reason) <= _MAX_REASON:
                self.err(file, node, f"reason must be 1-{_MAX_REASON} characters")
                ok = False
            else:
                raw.fields["reason"] = reason
        if "telemetry" in keys:
            node = keys["telemetry"][1]
            telemetry = self.boolean(file, node, "telemetry")
            if "action" in keys:
                self.err(file, node, "a telemetry rule is allowed or denied by the preset's "
                         "switch: remove action")
                ok = False
            raw.telemetry = bool(telemetry)
        return ok

    def parse_ports(self, file: str, node: Node) -> tuple[int, ...] | None:
        if not isinstance(node, SequenceNode) or not node.value:
            self.err(file, node, "ports must be a non-empty list of numbers, e.g. ports: [443]")
            return None
        ports: list[int] = []
        ok = True
        for item in node.value:
            value = self.scalar(item) if isinstance(item, ScalarNode) else None
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
                self.err(file, item, f"invalid port {quoted(value)}; use a number from 1 to 65535")
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

    def parse_paths(self, file: str, node: Node, what: str = "paths") -> tuple[str, ...] | None:
        items = self.string_list(file, node, what)
        if items is None:
            return None
        if isinstance(node, SequenceNode) and not node.value:
            self.err(file, node, f'{what} is empty; list path patterns (e.g. ["/v1/**"]) or '
                     "omit it")
            return None
        ok = isinstance(node, SequenceNode) and len(items) == len(node.value)
        paths: list[str] = []
        for value, item in items:
            try:
                validate_path_pattern(value)
            except PathPatternError as exc:
                self.err(file, item, clipped(str(exc)))
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
                self.err(file, item, f"invalid model pattern {quoted(value)}; use a model name "
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
        counts: dict[str, int | None] = {"reserve": None, "max_input_tokens": None}
        what = {"reserve": "output tokens (what a call without max_tokens reserves)",
                "max_input_tokens": "input tokens (the context window of a model the "
                                    "catalogue does not know)"}
        for name in counts:
            if name not in keys:
                continue
            count_node = keys[name][1]
            value = self.scalar(count_node) if isinstance(count_node, ScalarNode) else None
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                self.err(file, count_node, f"metering.{name} must be a positive whole number "
                         f"of {what[name]}")
                return None
            counts[name] = value
        if required is None:
            return None
        return MeteringRule(required=required, reserve=counts["reserve"],
                            max_input_tokens=counts["max_input_tokens"])

    def parse_budgets(self, file: str, node: Node, policy: RawPolicy) -> None:
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

    def parse_budget(self, file: str, node: Node, policy: str) -> RawBudget | None:
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
            if name is not None and not NAME.fullmatch(name):
                self.err(file, keys["name"][1], f"invalid budget name {shown(name)}; use "
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
                self.err(file, keys["per"][1],
                         f"invalid per {quoted(value)}; use sandbox or policy")
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
                    self.err(file, window_node, f"{clipped(str(exc))}, or month")
                    seconds = 0.0
                if seconds and (seconds < _MIN_WINDOW or seconds != int(seconds)):
                    self.err(file, window_node, f"window {quoted(window_text)} must be whole "
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
                self.err(file, value_node, f"{key} must be {kind}, got {quoted(value)}")
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
        return RawBudget(budget, file, node.start_mark.line + 1, credential_nodes)
