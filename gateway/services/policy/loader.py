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
file (``shown``): a file in the directory may be no policy at all.

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

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.config import ConfigError, parse_duration
from gateway.core.policy.compiled import PolicySet
from gateway.core.policy.model import Mode, Subject
from gateway.services.policy.agents import PREFIX, TELEMETRY, add_agent_presets, variant
from gateway.services.policy.build import build_policy_set
from gateway.services.policy.files import (
    outside_error,
    policy_files,
    resolves_outside,
    source_name,
    unreadable,
)
from gateway.services.policy.nodes import NAME, RawPolicy
from gateway.services.policy.problems import PolicyError, clipped, quoted, shown
from gateway.services.policy.read_credentials import CredentialReader
from gateway.services.policy.read_rules import RuleReader
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
                "budgets", "tokens", "subjects", "ask")


class _Parser(RuleReader, CredentialReader):
    """A policy file: its documents, each a policy of rules, budgets and credentials."""

    def parse_file(self, file: str, text: str) -> None:
        try:
            documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            problem = exc.problem or exc.context or "syntax error"
            self.errors.append((file, line, f"invalid YAML: {clipped(problem)}"))
            return
        except yaml.YAMLError as exc:
            self.errors.append((file, 1, f"invalid YAML: {clipped(str(exc))}"))
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
                         f"unsupported version {quoted(version)}; use version: v1")
        name: str | None = None
        if "name" not in keys:
            self.err(file, node, "missing name; add name: <policy name>")
        else:
            name_node = keys["name"][1]
            name = self.string(file, name_node, "name")
            if name is not None and not NAME.fullmatch(name) and not (
                    self.preset and name.startswith(PREFIX)):
                self.err(
                    file,
                    name_node,
                    f'invalid policy name {shown(name)}; use letters, digits, ".", "_", "-"',
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
                self.err(file, mode_node, f"invalid mode {quoted(value)}; use enforce or report")
        line = node.start_mark.line + 1
        policy = RawPolicy(
            name=name or f"<unnamed policy at {file}:{line}>",
            mode=mode,
            file=file,
            line=line,
            named=name is not None,
        )
        if "extends" in keys:
            ext_node = keys["extends"][1]
            policy.extends_line = ext_node.start_mark.line + 1
            policy.extends = self.parse_extends(file, ext_node)
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
        if "tokens" in keys:
            policy.token_ttl = self.parse_tokens(file, keys["tokens"][1])
        if "subjects" in keys:
            policy.subjects = self.parse_subjects(file, keys["subjects"][1])
        if "ask" in keys:
            policy.ask = self.parse_ask(file, keys["ask"][1], rule=False)
        self.policies.append(policy)

    def parse_subjects(self, file: str, node: Node) -> list[Subject]:
        """``subjects: [{namespace: sandboxes, service_account: "agent-*"}]``: the
        Kubernetes workloads that may be this policy's sandboxes (globs)."""
        if not isinstance(node, SequenceNode) or not node.value:
            self.err(file, node, "subjects must be a non-empty list, e.g. subjects: "
                     "[{namespace: sandboxes, service_account: agent}]")
            return []
        subjects: list[Subject] = []
        for item in node.value:
            keys = self.mapping(file, item, ("namespace", "service_account"), "a subject")
            if keys is None:
                continue
            if "namespace" not in keys:
                self.err(file, item, "a subject needs a namespace (a glob: \"*\" for any)")
                continue
            namespace = self.string(file, keys["namespace"][1], "subjects.namespace")
            account = (self.string(file, keys["service_account"][1],
                                   "subjects.service_account")
                       if "service_account" in keys else None)
            if namespace is not None and ("service_account" not in keys or account):
                subjects.append(Subject(namespace, account))
        return subjects

    def parse_tokens(self, file: str, node: Node) -> float | None:
        """``tokens: {ttl: 8h}``: the lifetime of this policy's tokens when the mint
        names none (capped by the gateway's tokens.max_ttl when minted)."""
        keys = self.mapping(file, node, ("ttl",), "tokens")
        if not keys or "ttl" not in keys:
            return None
        value_node = keys["ttl"][1]
        value = self.scalar(value_node) if isinstance(value_node, ScalarNode) else None
        try:
            ttl = parse_duration(value, "ttl")
        except ConfigError as exc:
            self.err(file, value_node, f"tokens.{exc}")
            return None
        if not 60 <= ttl <= 30 * 86400:
            self.err(file, value_node, "tokens.ttl must be from 1m to 30d")
            return None
        return ttl

    def parse_extends(self, file: str, node: Node) -> list[tuple[str, Node]]:
        """Policy names, or an agent preset with its switch: ``{agent/codex: {telemetry:
        allow}}`` (see policy/agents)."""
        if not isinstance(node, SequenceNode):
            self.err(file, node, 'extends must be a list, e.g. extends: ["base"]')
            return []
        items: list[tuple[str, Node]] = []
        for item in node.value:
            if isinstance(item, MappingNode) and len(item.value) == 1:
                key_node, options = item.value[0]
                agent = self.scalar(key_node) if isinstance(key_node, ScalarNode) else None
                if not isinstance(agent, str) or not agent.startswith(PREFIX):
                    self.err(file, item, "only an agent preset takes options in extends "
                             "(- agent/codex: {telemetry: allow})")
                    continue
                keys = self.mapping(file, options, ("telemetry",), "agent preset options")
                telemetry = "deny"
                if keys and "telemetry" in keys:
                    value_node = keys["telemetry"][1]
                    value = (self.scalar(value_node) if isinstance(value_node, ScalarNode)
                             else None)
                    if value not in TELEMETRY:
                        self.err(file, value_node,
                                 f"invalid telemetry {quoted(value)}; use deny or allow")
                        continue
                    telemetry = value
                items.append((variant(agent, telemetry), item))
                continue
            name = self.string(file, item, "extends item")
            if name is not None:
                items.append((name, item))
        return items

    def finish(self, revision: str = "") -> PolicySet:
        """The agent presets the policies extend, then the checked, compiled set."""
        add_agent_presets(self, self.parse_file)
        return build_policy_set(self, revision)


def load_policy_texts(files: Mapping[str, str], *, revision: str | None = None) -> PolicySet:
    """Load policies from ``{file name: YAML text}`` (raises PolicyError).

    ``revision`` defaults to the content hash of the texts (pure, no I/O).
    """
    parser = _Parser()
    for file, text in files.items():
        parser.parse_file(file, text)
    if revision is None:
        revision = content_hash({name: text.encode("utf-8") for name, text in files.items()})
    return parser.finish(revision)


def load_policy_text(name: str, text: str) -> PolicySet:
    """Load one YAML text as if it were the file ``name`` (for tests and tools)."""
    return load_policy_texts({name: text})


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
    prefix = source_name(directory)
    raw: dict[str, bytes] = {}
    parser = _Parser()
    for path in paths:
        name = f"{prefix}/{path.name}"
        real = resolves_outside(directory, path)
        if real is not None:
            parser.errors.append((name, 1, outside_error(path.name, real, directory)))
            continue
        try:  # the file checked, not the link again (it may be swapped meanwhile)
            data = Path(os.path.realpath(path)).read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            parser.errors.append((name, 1, unreadable(exc)))
            continue
        raw[path.name] = data
        parser.parse_file(name, text)
    policy_set = parser.finish()
    return replace(policy_set, revision=policy_revision(directory, raw))
