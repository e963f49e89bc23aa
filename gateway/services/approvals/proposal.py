"""An `always` grant, written as a policy change for people to review: the rule as a YAML
snippet, the policy file with the rule added as a patch, and, where the policies
directory is a git checkout, a branch with that change committed, ready for a pull
request. Live files, the checkout's index and its working tree are never touched: the
grant applies at once, and the rule applies once someone merges it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.core.approvals import Grant

__all__ = ["Proposal", "commit_file", "propose", "rule_snippet", "with_rule"]

_GIT_TIMEOUT = 20.0
_TOP_KEY = re.compile(r"^[A-Za-z_][\w-]*\s*:")


@dataclass(frozen=True, slots=True)
class Proposal:
    """`snippet`: the rule; `patch`: the file of the change; `branch`: the git branch
    carrying it (None: not a git checkout, or git failed: `problem` says why)."""

    snippet: str
    patch: Path
    branch: str | None
    problem: str | None = None

    def to_doc(self) -> dict[str, str | None]:
        return {"snippet": self.snippet, "patch": str(self.patch), "branch": self.branch,
                "problem": self.problem}


def rule_snippet(grant: Grant, indent: str = "  ") -> str:
    """The egress rule that allows what `grant` allows, with a comment naming it."""
    asked = grant.asked
    note = f": {grant.note}" if grant.note else ""
    lines = [f"# granted by {grant.by} (approval {grant.approval}, {grant.id}){note}"[:300],
             f"- host: {json.dumps(asked.host)}", f"  ports: [{asked.port}]"]
    if asked.kind == "request":
        lines += [f"  methods: [{asked.method}]", f"  paths: [{json.dumps(asked.path)}]"]
    return "".join(f"{indent}{line.replace(chr(10), ' ')}\n" for line in lines)


def with_rule(text: str, grant: Grant) -> str:
    """The policy file `text` with the grant's rule added at the end of its `egress:`
    list (an `egress:` written empty or as `[]` becomes a block)."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    at = next((i for i, line in enumerate(lines) if line.startswith("egress:")), None)
    if at is None:
        return "".join(lines) + "egress:\n" + rule_snippet(grant)
    head = lines[at].split("#", 1)[0].strip()
    if head in ("egress: []", "egress: null", "egress: ~"):
        lines[at] = "egress:\n"
    end = at + 1
    indent = "  "
    while end < len(lines) and not _TOP_KEY.match(lines[end]):
        stripped = lines[end].lstrip(" ")
        if stripped.startswith("- ") and end > at:
            indent = lines[end][:len(lines[end]) - len(stripped)] or ""
        end += 1
    while end > at + 1 and not lines[end - 1].strip():
        end -= 1  # (after the last rule, before the blank lines that end the block)
    return "".join(lines[:end]) + rule_snippet(grant, indent) + "".join(lines[end:])


def propose(directory: Path, source: str, grant: Grant, out: Path) -> Proposal:
    """Write the change that makes `grant` a rule of the policy file `source` (as the
    loader names it: ``<directory name>/<file>``) to ``out/<grant id>.patch``, and a
    branch ``sandbox-gateway/grant-<id>`` if `directory` is in a git checkout."""
    name = source.split("/", 1)[-1]
    path = directory / name
    before = path.read_text(encoding="utf-8")
    after = with_rule(before, grant)
    out.mkdir(parents=True, exist_ok=True)
    patch = out / f"{grant.id}.patch"
    patch.write_text("".join(difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        f"a/{name}", f"b/{name}")), encoding="utf-8")
    snippet = rule_snippet(grant)
    try:
        branch = _commit(directory, name, grant)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return Proposal(snippet, patch, None, f"no branch: {exc}"[:300])
    return Proposal(snippet, patch, branch)


def _git(directory: Path, *args: str, env: dict[str, str] | None = None,
         stdin: str | None = None, strip: bool = True) -> str:
    done = subprocess.run(["git", "-C", str(directory), *args], input=stdin,
                          capture_output=True, text=True, timeout=_GIT_TIMEOUT, env=env,
                          check=False)
    if done.returncode != 0:
        raise ValueError(f"git {args[0]}: {done.stderr.strip()[:200]}")
    return done.stdout.strip() if strip else done.stdout


def _commit(directory: Path, name: str, grant: Grant) -> str | None:
    """Commit the file `name` as HEAD has it, with the grant's rule, on a new branch off
    HEAD (`commit_file`). None: not a git checkout."""
    def change(committed: str | None) -> str:
        if committed is None:
            raise ValueError(f"{name} is not in HEAD")
        return with_rule(committed, grant)

    message = (f"Allow {grant.asked.describe()} for policy {grant.policy}\n\n"
               f"Granted always by {grant.by} in approval {grant.approval} ({grant.id})."
               + (f"\nNote: {grant.note}" if grant.note else ""))
    return commit_file(directory, name, change, f"sandbox-gateway/grant-{grant.id}", message)


def commit_file(directory: Path, name: str, change: Callable[[str | None], str],
                branch: str, message: str) -> str | None:
    """Commit the file `name` (in `directory`) as `change` makes it from HEAD's text (None:
    not in HEAD) on the new branch `branch` off HEAD, with plumbing (a private index): the
    checkout's own index and files stay as they are (uncommitted edits included). None:
    not a git checkout. Raises ValueError (git failed) or OSError."""
    inside = subprocess.run(["git", "-C", str(directory), "rev-parse", "--is-inside-work-tree"],
                            capture_output=True, text=True, timeout=_GIT_TIMEOUT, check=False)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return None
    prefix = _git(directory, "rev-parse", "--show-prefix")
    try:
        committed: str | None = _git(directory, "show", f"HEAD:{prefix}{name}", strip=False)
    except ValueError:
        committed = None
    blob = _git(directory, "hash-object", "-w", "--stdin", stdin=change(committed))
    with tempfile.TemporaryDirectory() as tmp:
        who = {"NAME": "sandbox-gateway", "EMAIL": "sandbox-gateway@localhost"}
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index"),
               **{f"GIT_{role}_{k}": v for role in ("AUTHOR", "COMMITTER")
                  for k, v in who.items()}}
        _git(directory, "read-tree", "HEAD", env=env)
        _git(directory, "update-index", "--add", "--cacheinfo", f"100644,{blob},{prefix}{name}",
             env=env)
        tree = _git(directory, "write-tree", env=env)
        commit = _git(directory, "commit-tree", tree, "-p", "HEAD", "-m", message, env=env)
    _git(directory, "update-ref", f"refs/heads/{branch}", commit, "")
    return branch
