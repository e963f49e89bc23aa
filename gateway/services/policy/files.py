"""Which files of a policies directory are read (top-level `*.yaml`/`*.yml`, symlinks that
stay inside, no dotfiles) and how they are named (`<directory>/<file>`)."""

from __future__ import annotations

import os
from pathlib import Path


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


def unreadable(exc: OSError | UnicodeDecodeError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"cannot read: not UTF-8 text (byte {exc.start})"
    return f"cannot read: {exc.strerror or type(exc).__name__}"
