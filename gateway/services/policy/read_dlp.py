"""`dlp:` as a policy file writes it (see `gateway/core/dlp/policy.py`), in a policy or
in a rule:

    dlp: {action: refuse, detectors: [default, keyword],
          allow: [{detector: pypi, hosts: [upload.pypi.org]}], answers: report}

`dlp: true` is the defaults (refuse, the default detectors); `dlp: false` turns detection
off (on a rule: for that rule). Problems are collected with
the file and line, like every other key; a detector name that is not known says the
closest one. The loader calls it for a policy and for a rule; a reader like the others:
``read_dlp(nodes, node, rule=...)``.
"""

from __future__ import annotations

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.core.dlp.catalogue import DEFAULT, DETECTORS
from gateway.core.dlp.policy import ACTIONS, Action, Dlp, DlpAllow
from gateway.core.policy.hosts import HostPattern, HostPatternError, compile_host_pattern
from gateway.services.policy.nodes import Nodes
from gateway.services.policy.problems import clipped, quoted, suggest

__all__ = ["read_dlp"]

_KEYS = ("action", "detectors", "allow", "answers")
ANSWERS = ("report", "off")  # `answers:`: flag credentials in answers, or not (default)
_ALLOW_KEYS = ("detector", "hosts")
DEFAULT_NAME = "default"  # in `detectors`: the detectors on by default


class _Reader:
    """Reads `dlp:` (problems collected with file and line, as for every key)."""

    def __init__(self, nodes: Nodes) -> None:
        self.nodes = nodes

    def parse_dlp(self, node: Node, *, rule: bool) -> Dlp | None:
        """A policy's or a rule's `dlp:` section; None if it has errors."""
        if isinstance(node, ScalarNode) and isinstance(self.nodes.scalar(node), bool):
            return Dlp() if self.nodes.scalar(node) else Dlp(enabled=False)
        if not isinstance(node, MappingNode):
            self.nodes.err(node, "dlp must be a mapping, e.g. dlp: {action: refuse}, or "
                     "true or false")
            return None
        before = len(self.nodes.problems.errors)
        keys = self.nodes.mapping(node, _KEYS, "dlp")
        if keys is None:
            return None
        # (an unknown key: reported, the section refused)
        ok = len(self.nodes.problems.errors) == before
        action: Action | None = None
        if "action" in keys:
            action = self._action(keys["action"][1])
            ok = ok and action is not None
        detectors: tuple[str, ...] | None = None
        if "detectors" in keys:
            detectors = self._detectors(keys["detectors"][1])
            ok = ok and detectors is not None
        allow: list[DlpAllow] = []
        if "allow" in keys:
            allow_node = keys["allow"][1]
            if not isinstance(allow_node, SequenceNode):
                self.nodes.err(allow_node, "dlp.allow must be a list, e.g. allow: "
                         "[{detector: pypi, hosts: [upload.pypi.org]}]")
                ok = False
            else:
                for item in allow_node.value:
                    entry = self._allow(item)
                    ok = ok and entry is not None
                    if entry is not None:
                        allow.append(entry)
        answers: bool | None = None
        if "answers" in keys:
            answers = self._answers(keys["answers"][1])
            ok = ok and answers is not None
        if not ok:
            return None
        return Dlp(action=action if action is not None or rule else "refuse",
                   detectors=detectors, allow=tuple(allow), answers=answers)

    def _answers(self, node: Node) -> bool | None:
        value = self.nodes.scalar(node) if isinstance(node, ScalarNode) else None
        if value is False:  # (YAML reads a bare `off` as false)
            value = "off"
        if value in ANSWERS:
            return value == "report"
        self.nodes.err(node, f"dlp.answers must be report or off (answers are never refused "
                       f"for what they hold), not {quoted(value)}"
                       f"{suggest(str(value), ANSWERS)}")
        return None

    def _action(self, node: Node) -> Action | None:
        value = self.nodes.scalar(node) if isinstance(node, ScalarNode) else None
        for action in ACTIONS:
            if value == action:
                return action
        self.nodes.err(node, f"dlp.action must be one of {', '.join(ACTIONS)}, not "
                 f"{quoted(value)}{suggest(str(value), ACTIONS)}")
        return None

    def _detector(self, node: Node, what: str, *,
                  default_ok: bool) -> str | None:
        name = self.nodes.string(node, what)
        if name is None:
            return None
        known = (DEFAULT_NAME, *DETECTORS) if default_ok else tuple(DETECTORS)
        if name not in known:
            self.nodes.err(node, f"{what}: unknown detector {quoted(name)}"
                     f"{suggest(name, known)}; known detectors: {', '.join(known)}")
            return None
        return name

    def _detectors(self, node: Node) -> tuple[str, ...] | None:
        if not isinstance(node, SequenceNode) or not node.value:
            self.nodes.err(node, "dlp.detectors must be a non-empty list, e.g. detectors: "
                     "[default, keyword]")
            return None
        names: list[str] = []
        ok = True
        for item in node.value:
            name = self._detector(item, "dlp.detectors", default_ok=True)
            if name is None:
                ok = False
            else:
                names.extend(DEFAULT if name == DEFAULT_NAME else (name,))
        return tuple(dict.fromkeys(names)) if ok else None

    def _allow(self, node: Node) -> DlpAllow | None:
        before = len(self.nodes.problems.errors)
        keys = self.nodes.mapping(node, _ALLOW_KEYS, "dlp.allow entry")
        if keys is None or len(self.nodes.problems.errors) > before:
            return None
        missing = [k for k in _ALLOW_KEYS if k not in keys]
        if missing:
            self.nodes.err(node, f"dlp.allow entry needs {' and '.join(missing)}, e.g. "
                     "{detector: pypi, hosts: [upload.pypi.org]}")
            return None
        detector = self._detector(keys["detector"][1], "dlp.allow.detector",
                                  default_ok=False)
        hosts_node = keys["hosts"][1]
        items = self.nodes.string_list(hosts_node, "dlp.allow.hosts")
        if items is not None and not items:
            self.nodes.err(hosts_node, "dlp.allow.hosts must name at least one host")
            items = None
        patterns: list[HostPattern] = []
        for text, item in items or []:
            try:
                patterns.append(compile_host_pattern(text))
            except HostPatternError as exc:
                self.nodes.err(item, f"dlp.allow.hosts: {clipped(str(exc))}")
                items = None
        if detector is None or items is None:
            return None
        return DlpAllow(detector, tuple(patterns))


def read_dlp(nodes: Nodes, node: Node, *, rule: bool) -> Dlp | None:
    """The ``Dlp`` of a policy or (``rule``) of a rule; None: reported."""
    return _Reader(nodes).parse_dlp(node, rule=rule)
