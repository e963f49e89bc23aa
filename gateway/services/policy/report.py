"""Rendering for ``policy test`` (text, JUnit XML) and ``policy diff`` (text, JSON, markdown).

Pure: results in, strings out. Markdown is sized for a pull-request comment: compact
tables, at most ``MAX_GROUPS`` replay groups per section (JSON always has them all).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

from gateway.services.policy.diff import CredentialChange, PolicyDiff, RuleChange, SetDiff
from gateway.services.policy.replay import CATEGORIES, ReplayGroup, ReplayReport
from gateway.services.policy.testing import CaseResult

__all__ = [
    "MARKDOWN_LIMIT",
    "MAX_GROUPS",
    "diff_json",
    "diff_markdown",
    "diff_text",
    "junit_xml",
    "test_text",
]

MAX_GROUPS = 25
MARKDOWN_LIMIT = 60_000
TITLES = {
    "newly_denied": "Newly denied",
    "newly_allowed": "Newly allowed",
    "changed": "Other changes",
}
_HINTS = {
    "newly_denied": "allowed under the base, denied now",
    "newly_allowed": "denied under the base, allowed now",
    "changed": "allowed both ways, but by another rule, credential or mode",
}

# --------------------------------------------------------------------------------------
# policy test
# --------------------------------------------------------------------------------------


def _case_lines(result: CaseResult) -> list[str]:
    case = result.case
    status = "PASS" if result.passed else "FAIL"
    lines = [f"  {status}  {case.name}" + ("" if result.passed else f"  ({case.source})")]
    if not result.passed:
        lines.append(f"        {case.method} {case.url} as policy {case.policy}")
        for name, expected, got in result.diff:
            lines.append(f"        - {name}: {expected}")
            lines.append(f"        + {name}: {got}")
        lines.append(f"          reason: {result.reason}")
    return lines


def test_text(results: Sequence[CaseResult], files: int) -> str:
    """Test-runner output: each case PASS/FAIL grouped by file, a diff per failure, counts."""
    lines: list[str] = []
    current = None
    for result in results:
        file = result.case.source.rsplit(":", 1)[0]
        if file != current:
            current = file
            lines.append(file)
        lines.extend(_case_lines(result))
    failed = sum(not r.passed for r in results)
    lines.append(f"{len(results) - failed} passed, {failed} failed "
                 f"({len(results)} cases in {files} file(s))")
    return "\n".join(lines)


def junit_xml(results: Sequence[CaseResult], seconds: Sequence[float] = ()) -> str:
    """JUnit XML (one testsuite per test file) for CI test reporters."""
    root = ET.Element("testsuites", name="sandbox-gateway policy test")
    suites: dict[str, ET.Element] = {}
    counts: dict[str, list[int]] = {}
    total_time = 0.0
    for i, result in enumerate(results):
        case = result.case
        file, _, line = case.source.rpartition(":")
        suite = suites.get(file)
        if suite is None:
            suite = suites[file] = ET.SubElement(root, "testsuite", name=file)
            counts[file] = [0, 0]
        elapsed = seconds[i] if i < len(seconds) else 0.0
        total_time += elapsed
        counts[file][0] += 1
        element = ET.SubElement(
            suite, "testcase", name=case.name, classname=f"policy.{case.policy}", file=file,
            line=line, time=f"{elapsed:.6f}",
        )
        if not result.passed:
            counts[file][1] += 1
            message = "; ".join(f"{n}: expected {e}, got {g}" for n, e, g in result.diff)
            failure = ET.SubElement(element, "failure", message=message, type="PolicyTest")
            failure.text = "\n".join(_case_lines(result)[1:])
        if case.model is not None:
            props = ET.SubElement(element, "properties")
            ET.SubElement(props, "property", name="model", value=case.model)
            ET.SubElement(props, "property", name="model_checked",
                          value=str(result.model_checked).lower())
    for file, suite in suites.items():
        suite.set("tests", str(counts[file][0]))
        suite.set("failures", str(counts[file][1]))
        suite.set("errors", "0")
    root.set("tests", str(len(results)))
    root.set("failures", str(sum(not r.passed for r in results)))
    root.set("errors", "0")
    root.set("time", f"{total_time:.6f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, "unicode") + "\n"


# --------------------------------------------------------------------------------------
# policy diff
# --------------------------------------------------------------------------------------


def _rule_line(change: RuleChange) -> str:
    where = change.new_source or change.old_source or ""
    if change.kind == "changed":
        fields = "; ".join(f"{f}: {a} -> {b}" for f, a, b in change.fields)
        return f"~ {change.label}  {fields}  ({change.old_source} -> {change.new_source})"
    sign = "+" if change.kind == "added" else "-"
    return f"{sign} {change.label}  {change.summary}  ({where})"


def _credential_line(change: CredentialChange) -> str:
    if change.kind == "changed":
        fields = "; ".join(f"{f}: {a} -> {b}" for f, a, b in change.fields)
        return f"~ credential {change.name}  {fields}"
    sign = "+" if change.kind == "added" else "-"
    return f"{sign} credential {change.name}  {change.summary}"


def _policy_lines(p: PolicyDiff) -> list[str]:
    head = {"added": "policy added", "removed": "policy removed", "changed": "changed"}[p.kind]
    lines = [f"policy {p.name}: {head}"]
    for field, old, new in p.fields:
        lines.append(f"  ~ {field}: {old} -> {new}")
    lines.extend("  " + _rule_line(c) for c in p.rules)
    if p.affects:
        lines.append(f"  (inherited by {', '.join(p.affects)})")
    return lines


def _example(group: ReplayGroup, markdown: bool = False) -> list[str]:
    out = []
    for e in group.examples:
        who = f", sandbox {e.sandbox}" if e.sandbox else ""
        model = f", model {e.model}" if e.model else ""
        if markdown:
            out.append(f"{_code(e.describe())} \u00d7{e.count}{_md(who + model)}: "
                       f"{_md(e.base.short())} → {_md(e.new.short())}")
        else:
            out.append(f"{e.describe()} x{e.count}{who}{model}: "
                       f"{e.base.short()} -> {e.new.short()}")
    return out


def diff_text(diff: SetDiff, replay: ReplayReport | None) -> str:
    """Plain text for a terminal."""
    lines = [f"policy diff: {diff.base_label} ({diff.base_revision}) -> "
             f"{diff.head_label} ({diff.head_revision})"]
    if diff.empty:
        lines.append("no rule-level changes")
    for p in diff.policies:
        lines.extend(_policy_lines(p))
    lines.extend(_credential_line(c) for c in diff.credentials)
    if replay is not None:
        lines.append("")
        lines.append(_replay_summary(replay))
        for category in CATEGORIES:
            groups = replay.groups(category)
            if not groups:
                continue
            lines.append(f"{TITLES[category]} ({_HINTS[category]}): "
                         f"{sum(g.count for g in groups):,} request(s) in {len(groups)} "
                         "group(s)")
            for group in groups:
                lines.append(f"  {group.policy}  {group.host}  {group.count:,} request(s)")
                lines.extend("    " + e for e in _example(group))
                lines.append(f"    now: {group.reason}")
        if not replay.changed:
            lines.append("no recorded request changes its decision")
    return "\n".join(lines)


def _replay_summary(replay: ReplayReport) -> str:
    text = (f"replayed {replay.lines:,} audit line(s) ({replay.requests:,} requests, "
            f"{replay.distinct:,} distinct) in {replay.seconds:.1f} s")
    skipped = [f"{n:,} {why}" for why, n in sorted(replay.skipped.items()) if n]
    if skipped:
        text += "; skipped: " + ", ".join(skipped)
    return text


def diff_json(diff: SetDiff, replay: ReplayReport | None) -> str:
    """Everything, machine-readable."""
    out: dict[str, Any] = diff.to_dict()
    if replay is not None:
        out["replay"] = replay.to_dict()
    return json.dumps(out, indent=2)


def _md(text: str) -> str:
    """Table-cell-safe text (pipes escaped, newlines flattened)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return "`" + _md(text).replace("`", "'") + "`"


class _Comment:
    """Markdown lines with a size budget: table rows past it are counted, not written."""

    def __init__(self, limit: int) -> None:
        self.lines: list[str] = []
        self.size = 0
        self.limit = limit
        self.omitted = 0

    def add(self, *lines: str) -> None:
        for line in lines:
            self.lines.append(line)
            self.size += len(line) + 1

    def row(self, line: str) -> None:
        if self.size + len(line) > self.limit:
            self.omitted += 1
        else:
            self.add(line)


def diff_markdown(diff: SetDiff, replay: ReplayReport | None, limit: int = MARKDOWN_LIMIT
                  ) -> str:
    """A pull-request comment: rule changes per policy, then replayed changes.

    At most ``MAX_GROUPS`` groups per replay section, and table rows stop at ``limit``
    characters (GitHub refuses comments over 65,536); the comment says what it left out.
    """
    out = _Comment(limit)
    out.add(
        "<!-- sandbox-gateway-policy-diff -->",
        f"### Policy diff: {_code(diff.base_label)} ({_code(diff.base_revision)}) → "
        f"{_code(diff.head_label)} ({_code(diff.head_revision)})",
        "",
    )
    if diff.empty:
        out.add("No rule-level changes.")
    else:
        out.add("| policy | change | rule / credential | details |", "|---|---|---|---|")
        for p in diff.policies:
            if p.kind != "changed":
                out.row(f"| {_code(p.name)} | policy {p.kind} | | {_md(p.source or '')} |")
            for field, old, new in p.fields:
                out.row(f"| {_code(p.name)} | {field} | | {_code(old)} → {_code(new)} |")
            for c in p.rules:
                if c.kind == "changed":
                    details = "<br>".join(f"{f}: {_code(a)} → {_code(b)}" for f, a, b in c.fields)
                    details += f"<br>{_md(c.new_source or '')}"
                else:
                    details = f"{_md(c.summary)} ({_md(c.new_source or c.old_source or '')})"
                out.row(f"| {_code(p.name)} | rule {c.kind} | {_code(c.label)} | {details} |")
            if p.affects:
                out.row(f"| {_code(p.name)} | inherited by | | "
                        f"{', '.join(_code(a) for a in p.affects)} |")
        for cred in diff.credentials:
            if cred.kind == "changed":
                details = "<br>".join(f"{f}: {_code(a)} → {_code(b)}" for f, a, b in cred.fields)
            else:
                details = _md(cred.summary)
            out.row(f"| | credential {cred.kind} | {_code(cred.name)} | {details} |")
    if replay is not None:
        out.add("", f"**Replay**: {_md(_replay_summary(replay))}", "")
        if not replay.changed:
            out.add("No recorded request changes its decision.")
        for category in CATEGORIES:
            groups = replay.groups(category)
            if not groups:
                continue
            total = sum(g.count for g in groups)
            out.add(
                f"#### {TITLES[category]}: {total:,} request(s), {len(groups)} group(s)",
                f"_{_HINTS[category]}_", "",
                "| policy | host | requests | examples | now |", "|---|---|---:|---|---|",
            )
            for group in groups[:MAX_GROUPS]:
                examples = "<br>".join(_example(group, markdown=True))
                out.row(f"| {_code(group.policy)} | {_code(group.host)} | "
                        f"{group.count:,} | {examples} | {_md(group.reason)} |")
            out.omitted += max(0, len(groups) - MAX_GROUPS)
            out.add("")
    if out.omitted:
        out.add(f"_{out.omitted} more row(s) left out to fit a comment; "
                "`--format json` lists everything._")
    return "\n".join(out.lines).rstrip() + "\n"
