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

How a file is read: ``read_document`` composes one reader per section, each a function
taking the section's YAML node and the file's ``Nodes`` (positions, and the load's shared
``Problems``) and returning model objects: ``read_policy`` (its own keys, extends, tokens,
subjects), ``read_credentials``, ``read_rules`` (``Rule`` objects, with ``read_mcp`` and
``read_ask`` for a rule's ``mcp:`` and ``ask:``, ``read_dlp`` for its ``dlp:``),
``read_budgets``, ``read_ask``, ``read_dlp`` (a policy's ``dlp:``, inherited through
``extends``: its own, else the first parent's that has one). Then
``build.py`` checks what the files define against each other and compiles the rules
(``compile_policy``: the matcher).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

import yaml
from yaml.nodes import Node

from gateway.core.policy.compiled import PolicySet
from gateway.services.policy.agents import add_agent_presets
from gateway.services.policy.build import build_policy_set
from gateway.services.policy.files import (
    outside_error,
    policy_files,
    resolves_outside,
    source_name,
    unreadable,
)
from gateway.services.policy.nodes import Nodes
from gateway.services.policy.problems import PolicyError, Problems, clipped
from gateway.services.policy.raw import CredentialDef, RawPolicy
from gateway.services.policy.read_ask import read_ask
from gateway.services.policy.read_budgets import read_budgets
from gateway.services.policy.read_credentials import read_credentials
from gateway.services.policy.read_dlp import read_dlp
from gateway.services.policy.read_policy import (
    POLICY_KEYS,
    read_extends,
    read_policy,
    read_subjects,
    read_telemetry,
    read_tokens,
)
from gateway.services.policy.read_rules import read_egress
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


def read_document(nodes: Nodes, node: Node,
                  credentials: dict[str, CredentialDef]) -> RawPolicy | None:
    """One policy document: its own keys, then each section by its reader (the order in
    which a line's problems are told). Credentials go to ``credentials``, the load's."""
    keys = nodes.mapping(node, POLICY_KEYS, "a policy")
    if keys is None:
        return None
    policy = read_policy(nodes, node, keys)
    if "extends" in keys:
        policy.extends = read_extends(nodes, keys["extends"][1])
    if "credentials" in keys:
        read_credentials(nodes, keys["credentials"][1], policy.given_name, credentials)
    if "egress" in keys:
        policy.rules = read_egress(nodes, keys["egress"][1], policy.name)
    if "budgets" in keys:
        policy.budgets = read_budgets(nodes, keys["budgets"][1], policy.given_name)
    if "tokens" in keys:
        policy.token_ttl = read_tokens(nodes, keys["tokens"][1])
    if "subjects" in keys:
        policy.subjects = read_subjects(nodes, keys["subjects"][1])
    if "ask" in keys:
        policy.ask = read_ask(nodes, keys["ask"][1], rule=False)
    if "dlp" in keys:
        policy.dlp = read_dlp(nodes, keys["dlp"][1], rule=False)
    if "telemetry" in keys:
        policy.telemetry_content = read_telemetry(nodes, keys["telemetry"][1])
    return policy


class _Load:
    """One load: the policies every file read holds, the credentials they define (names
    are global across files) and every problem found, said together by ``finish``."""

    def __init__(self) -> None:
        self.problems = Problems()
        self.policies: list[RawPolicy] = []
        self.credentials: dict[str, CredentialDef] = {}

    def add(self, file: str, text: str) -> None:
        self.policies.extend(self.read(file, text))

    def read(self, file: str, text: str, *, preset: bool = False) -> list[RawPolicy]:
        """The policies of a file's YAML documents (``preset``: a shipped agent preset)."""
        nodes = Nodes(file, self.problems, preset=preset)
        try:
            documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 1
            problem = exc.problem or exc.context or "syntax error"
            self.problems.add(file, line, f"invalid YAML: {clipped(problem)}")
            return []
        except yaml.YAMLError as exc:
            self.problems.add(file, 1, f"invalid YAML: {clipped(str(exc))}")
            return []
        documents = [d for d in documents if d is not None]
        if not documents:
            self.problems.add(file, 1, "empty policy file; add version: v1, name: and egress:")
        read = [read_document(nodes, document, self.credentials) for document in documents]
        return [policy for policy in read if policy is not None]

    def finish(self, revision: str = "") -> PolicySet:
        """The agent presets the policies extend, then the checked, compiled set."""
        add_agent_presets(self.policies, partial(self.read, preset=True))
        return build_policy_set(self.policies, self.credentials, self.problems, revision)


def load_policy_texts(files: Mapping[str, str], *, revision: str | None = None) -> PolicySet:
    """Load policies from ``{file name: YAML text}`` (raises PolicyError).

    ``revision`` defaults to the content hash of the texts (pure, no I/O).
    """
    load = _Load()
    for file, text in files.items():
        load.add(file, text)
    if revision is None:
        revision = content_hash({name: text.encode("utf-8") for name, text in files.items()})
    return load.finish(revision)


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
    load = _Load()
    for path in paths:
        name = f"{prefix}/{path.name}"
        real = resolves_outside(directory, path)
        if real is not None:
            load.problems.add(name, 1, outside_error(path.name, real, directory))
            continue
        try:  # the file checked, not the link again (it may be swapped meanwhile)
            data = Path(os.path.realpath(path)).read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            load.problems.add(name, 1, unreadable(exc))
            continue
        raw[path.name] = data
        load.add(name, text)
    policy_set = load.finish()
    return replace(policy_set, revision=policy_revision(directory, raw))
