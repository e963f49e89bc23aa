"""What `policy learn` reads besides the lines, for the CLI and the console alike: the
shipped service presets as sets to test coverage against, the file that defines a policy
now, and the policies with the learned file in its place (the replay proof's head)."""

from __future__ import annotations

from pathlib import Path

from gateway.core.policy.compiled import PolicySet
from gateway.services.policy.agents import known_services
from gateway.services.policy.loader import (
    PolicyError,
    load_policy_dir,
    load_policy_text,
    load_policy_texts,
    policy_files,
)

__all__ = ["head_set", "policy_file", "preset_sets"]


def preset_sets() -> dict[str, PolicySet]:
    """Each shipped service preset, as the set of a policy `learn-probe` extending it."""
    return {name: load_policy_text("learn-probe.yaml", "version: v1\nname: learn-probe\n"
                                   f"extends: [{name}]\n") for name in known_services()}


def policy_file(directory: Path, policy: str) -> tuple[str, str | None]:
    """The file (a name in `directory`) defining `policy`, and its text; a new
    `<policy>.yaml` (None) when no file does or the directory does not load."""
    try:
        current = load_policy_dir(directory).get(policy)
    except PolicyError:
        current = None
    if current is not None:
        name = current.source.split("/", 1)[-1]
        return name, (directory / name).read_text(encoding="utf-8")
    return f"{policy}.yaml", None


def head_set(directory: Path | None, file: str, text: str) -> PolicySet:
    """The policies of `directory` with `file` replaced by the learned `text` (raises
    PolicyError)."""
    texts: dict[str, str] = {}
    if directory is not None and directory.is_dir():
        texts = {p.name: p.read_text(encoding="utf-8") for p in policy_files(directory)}
    texts[file] = text
    return load_policy_texts(texts)
