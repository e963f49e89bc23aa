"""`dlp:` as a policy file writes it (see `gateway/core/dlp/policy.py`), in a policy or
in a rule:

    dlp: {action: refuse, detectors: [default, keyword],
          allow: [{detector: pypi, hosts: [upload.pypi.org]}]}

`dlp: true` is the defaults (refuse, the default detectors); `dlp: false` turns detection
off (on a rule: for that rule). Problems are collected with
the file and line, like every other key; a detector name that is not known says the
closest one. Not wired into the loader yet (issue 43: the engines' body stage is being
restructured); `DlpReader` is mixed into the loader's parser like `AskReader`.
"""

from __future__ import annotations

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.core.dlp.catalogue import DEFAULT, DETECTORS
from gateway.core.dlp.policy import ACTIONS, Action, Dlp, DlpAllow
from gateway.services.policy.hosts import HostPattern, HostPatternError, compile_host_pattern
from gateway.services.policy.nodes import NodeReader
from gateway.services.policy.problems import clipped, quoted, suggest

__all__ = ["DlpReader"]

_KEYS = ("action", "detectors", "allow")
_ALLOW_KEYS = ("detector", "hosts")
DEFAULT_NAME = "default"  # in `detectors`: the detectors on by default


class DlpReader(NodeReader):
    """Reads `dlp:` (errors collected with file and line, as for every key)."""

    def parse_dlp(self, file: str, node: Node, *, rule: bool) -> Dlp | None:
        """A policy's or a rule's `dlp:` section; None if it has errors."""
        if isinstance(node, ScalarNode) and isinstance(self.scalar(node), bool):
            return Dlp() if self.scalar(node) else Dlp(enabled=False)
        if not isinstance(node, MappingNode):
            self.err(file, node, "dlp must be a mapping, e.g. dlp: {action: refuse}, or "
                     "true or false")
            return None
        before = len(self.errors)
        keys = self.mapping(file, node, _KEYS, "dlp")
        if keys is None:
            return None
        ok = len(self.errors) == before  # (an unknown key: reported, the section refused)
        action: Action | None = None
        if "action" in keys:
            action = self._action(file, keys["action"][1])
            ok = ok and action is not None
        detectors: tuple[str, ...] | None = None
        if "detectors" in keys:
            detectors = self._detectors(file, keys["detectors"][1])
            ok = ok and detectors is not None
        allow: list[DlpAllow] = []
        if "allow" in keys:
            allow_node = keys["allow"][1]
            if not isinstance(allow_node, SequenceNode):
                self.err(file, allow_node, "dlp.allow must be a list, e.g. allow: "
                         "[{detector: pypi, hosts: [upload.pypi.org]}]")
                ok = False
            else:
                for item in allow_node.value:
                    entry = self._allow(file, item)
                    ok = ok and entry is not None
                    if entry is not None:
                        allow.append(entry)
        if not ok:
            return None
        return Dlp(action=action if action is not None or rule else "refuse",
                   detectors=detectors, allow=tuple(allow))

    def _action(self, file: str, node: Node) -> Action | None:
        value = self.scalar(node) if isinstance(node, ScalarNode) else None
        for action in ACTIONS:
            if value == action:
                return action
        self.err(file, node, f"dlp.action must be one of {', '.join(ACTIONS)}, not "
                 f"{quoted(value)}{suggest(str(value), ACTIONS)}")
        return None

    def _detector(self, file: str, node: Node, what: str, *,
                  default_ok: bool) -> str | None:
        name = self.string(file, node, what)
        if name is None:
            return None
        known = (DEFAULT_NAME, *DETECTORS) if default_ok else tuple(DETECTORS)
        if name not in known:
            self.err(file, node, f"{what}: unknown detector {quoted(name)}"
                     f"{suggest(name, known)}; known detectors: {', '.join(known)}")
            return None
        return name

    def _detectors(self, file: str, node: Node) -> tuple[str, ...] | None:
        if not isinstance(node, SequenceNode) or not node.value:
            self.err(file, node, "dlp.detectors must be a non-empty list, e.g. detectors: "
                     "[default, keyword]")
            return None
        names: list[str] = []
        ok = True
        for item in node.value:
            name = self._detector(file, item, "dlp.detectors", default_ok=True)
            if name is None:
                ok = False
            else:
                names.extend(DEFAULT if name == DEFAULT_NAME else (name,))
        return tuple(dict.fromkeys(names)) if ok else None

    def _allow(self, file: str, node: Node) -> DlpAllow | None:
        before = len(self.errors)
        keys = self.mapping(file, node, _ALLOW_KEYS, "dlp.allow entry")
        if keys is None or len(self.errors) > before:
            return None
        missing = [k for k in _ALLOW_KEYS if k not in keys]
        if missing:
            self.err(file, node, f"dlp.allow entry needs {' and '.join(missing)}, e.g. "
                     "{detector: pypi, hosts: [upload.pypi.org]}")
            return None
        detector = self._detector(file, keys["detector"][1], "dlp.allow.detector",
                                  default_ok=False)
        hosts_node = keys["hosts"][1]
        items = self.string_list(file, hosts_node, "dlp.allow.hosts")
        if items is not None and not items:
            self.err(file, hosts_node, "dlp.allow.hosts must name at least one host")
            items = None
        patterns: list[HostPattern] = []
        for text, item in items or []:
            try:
                patterns.append(compile_host_pattern(text))
            except HostPatternError as exc:
                self.err(file, item, f"dlp.allow.hosts: {clipped(str(exc))}")
                items = None
        if detector is None or items is None:
            return None
        return DlpAllow(detector, tuple(patterns))
