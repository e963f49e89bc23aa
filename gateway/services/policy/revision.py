"""Which revision a policy set was loaded from (provenance), and git's cheap change key.

``policy_revision`` answers, in order:

1. **git**: the policies directory is inside a git checkout (a clone, a worktree, a
   git-sync ``current -> .worktrees/<sha>`` or ``rev-<sha>`` link): ``git rev-parse
   HEAD``, with ``-dirty`` appended when a policy file differs from that commit
   (modified, staged, untracked or ignored ``*.yaml``/``*.yml`` at the top level);
2. **git-sync without git**: git does not answer for the checkout (the sidecar's
   volume mounted at another path, no git binary, or the files owned by the
   sidecar's uid: git refuses another user's repository, and the gateway does not
   override that), but the resolved directory is a git-sync worktree named after
   its commit (``rev-<sha>`` or ``.worktrees/<sha>``): that sha;
3. **a ``REVISION`` file** in the directory: a ConfigMap key, or a pod annotation
   projected as a file (downward API), e.g. the commit CI deployed from;
4. otherwise a **content hash** of the loaded files: ``sha256:`` + 12 hex digits of
   sha256 over the sorted (relative path, bytes) pairs.

Only ``content_hash`` is pure. Everything else reads files or runs ``git``; the
loader and reloader call it, never the matcher. ``git_state`` is the reloader's
per-poll key: a few ``stat``/small reads, no subprocess, so that a commit (HEAD
moving with unchanged files) is noticed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "REVISION_FILE",
    "GitRefError",
    "content_hash",
    "export_ref",
    "git_revision",
    "git_state",
    "gitsync_revision",
    "policy_revision",
    "revision_file",
    "run_git",
]

log = logging.getLogger("gateway.policy")

REVISION_FILE = "REVISION"
_REVISION_TEXT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_GIT_TIMEOUT = 10.0
# git hooks and CI set these; they would point git at another repository.
_GIT_ENV_DROP = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR",
                 "GIT_OBJECT_DIRECTORY", "GIT_NAMESPACE", "GIT_PREFIX")
_POLICY_PATHSPECS = (":(glob)*.yaml", ":(glob)*.yml")


def content_hash(files: Mapping[str, bytes]) -> str:
    """``sha256:<12 hex>`` over sorted (relative path, bytes); framing makes it unambiguous."""
    digest = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        encoded = name.encode("utf-8", "surrogateescape")
        digest.update(b"%d:%s\0%d:" % (len(encoded), encoded, len(data)))
        digest.update(data)
    return "sha256:" + digest.hexdigest()[:12]


def _git_command(directory: str | os.PathLike[str], args: tuple[str, ...]
                 ) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in _GIT_ENV_DROP}
    env["GIT_TERMINAL_PROMPT"] = "0"
    argv = ["git", "-c", "core.fsmonitor=false", "--no-optional-locks", "-C",
            os.fspath(directory), *args]
    return argv, env


def run_git(directory: str | os.PathLike[str], *args: str, stdin: bytes | None = None
            ) -> subprocess.CompletedProcess[bytes]:
    """Run ``git -C directory args`` with a clean environment (raises OSError, Timeout).

    Read-only commands only, ``--no-optional-locks``, no fsmonitor. A repository owned
    by another user is left to git's own refusal ("dubious ownership"): running git on
    it would run that user's repository config (filters) inside the gateway. git-sync's
    checkouts, owned by the sidecar's uid, are named by ``gitsync_revision`` instead.
    """
    argv, env = _git_command(directory, args)
    return subprocess.run(argv, input=stdin, capture_output=True, env=env,
                          timeout=_GIT_TIMEOUT, check=False)


class GitRefError(ValueError):
    """A git ref cannot be read (not a checkout, unknown ref, git failed)."""


def _checked(directory: str | os.PathLike[str], *args: str, stdin: bytes | None = None
             ) -> bytes:
    try:
        done = run_git(directory, *args, stdin=stdin)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GitRefError(f"cannot run git: {exc}") from None
    if done.returncode != 0:
        raise GitRefError(done.stderr.decode(errors="replace").strip()
                          or f"git {args[0]} failed")
    return done.stdout


def _blobs(directory: str | os.PathLike[str], shas: list[str]) -> list[bytes]:
    """The contents of ``shas`` in order, in one ``git cat-file --batch``."""
    out = _checked(directory, "cat-file", "--batch", stdin="".join(s + "\n" for s in shas)
                   .encode())
    blobs: list[bytes] = []
    pos = 0
    for sha in shas:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        if len(header) != 3 or header[0].decode() != sha or header[1] != b"blob":
            raise GitRefError(f"unexpected git cat-file answer for {sha}")
        size = int(header[2])
        blobs.append(out[end + 1:end + 1 + size])
        pos = end + 1 + size + 1
    return blobs


def export_ref(directory: str | os.PathLike[str], ref: str, into: str | os.PathLike[str]
               ) -> tuple[str, bool]:
    """Write the policy files of ``directory`` as they are at ``ref`` into ``into``.

    ``directory`` is the policies directory in the working tree; the same path in the
    commit is read with ``git ls-tree`` and ``git cat-file`` (not ``git archive``, whose
    export-ignore/export-subst attributes could hide or rewrite files): its top-level
    ``*.yaml``/``*.yml`` blobs, as the loader reads a directory (symlinks are skipped).
    Returns (commit sha, whether the directory exists at ``ref``).
    """
    if ref.startswith("-"):
        raise GitRefError(f"invalid git ref {ref!r}")
    try:
        lines = _checked(directory, "rev-parse", "--show-toplevel", "--show-prefix"
                         ).decode().split("\n")
    except GitRefError as exc:
        raise GitRefError(f"{os.fspath(directory)} is not in a git checkout ({exc})") from None
    top, prefix = lines[0], lines[1].strip().rstrip("/") if len(lines) > 1 else ""
    try:
        sha = _checked(directory, "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"
                       ).decode().strip()
    except GitRefError:
        raise GitRefError(f"unknown git ref {ref!r} in {top} (fetch it first, e.g. "
                          "git fetch origin main; actions/checkout needs fetch-depth: 0)"
                          ) from None
    tree = f"{sha}:{prefix}" if prefix else f"{sha}^{{tree}}"
    try:
        listing = _checked(directory, "ls-tree", "-z", "--full-tree", tree)
    except GitRefError:
        return sha, False  # no such directory in that commit
    names: list[str] = []
    shas: list[str] = []
    for entry in listing.split(b"\0"):
        if not entry:
            continue
        meta, _, raw_name = entry.partition(b"\t")
        mode, kind, object_id = meta.decode().split()
        name = raw_name.decode("utf-8", "surrogateescape")
        if (kind == "blob" and mode in ("100644", "100755") and not name.startswith(".")
                and name.endswith((".yaml", ".yml"))):
            names.append(name)
            shas.append(object_id)
    target = Path(into)
    for name, data in zip(names, _blobs(directory, shas) if shas else [], strict=True):
        (target / name).write_bytes(data)
    return sha, True


def git_revision(directory: str | os.PathLike[str]) -> str | None:
    """``<HEAD sha>`` or ``<sha>-dirty`` if ``directory`` is in a git checkout, else None."""
    try:
        head = run_git(directory, "rev-parse", "--verify", "-q", "HEAD^{commit}")
        if head.returncode != 0:
            return None
        sha = head.stdout.decode(errors="replace").strip()
        if not _SHA.fullmatch(sha):
            return None
        status = run_git(directory, "status", "--porcelain", "--untracked-files=all",
                     "--ignored=matching", "--", *_POLICY_PATHSPECS)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("git unavailable for %s: %s", directory, exc)
        return None
    if status.returncode != 0:
        # HEAD is known but the state of the files is not: say so rather than claim clean.
        return f"{sha}-dirty"
    return f"{sha}-dirty" if status.stdout.strip() else sha


def gitsync_revision(directory: str | os.PathLike[str]) -> str | None:
    """The commit in a git-sync worktree path (``rev-<sha>/`` or ``.worktrees/<sha>/``)."""
    parts = Path(os.path.realpath(directory)).parts
    for i, part in enumerate(parts):
        if part.startswith("rev-") and _SHA.fullmatch(part[4:]):
            return part[4:]
        if i > 0 and parts[i - 1] == ".worktrees" and _SHA.fullmatch(part):
            return part
    return None


def revision_file(directory: str | os.PathLike[str]) -> str | None:
    """The first line of ``directory/REVISION`` if it is a plausible revision string."""
    path = Path(directory) / REVISION_FILE
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(directory)):
        log.warning("%s: ignored: a symbolic link out of the policies directory", path)
        return None
    try:
        with real.open("rb") as handle:
            head = handle.read(256)
    except OSError:
        return None
    line = head.decode("utf-8", "replace").strip().split("\n", 1)[0].strip()
    if _REVISION_TEXT.fullmatch(line):
        return line
    log.warning("%s: ignored: not a revision (letters, digits, ._:/@+- up to 128)", path)
    return None


def policy_revision(directory: str | os.PathLike[str], files: Mapping[str, bytes]) -> str:
    """The revision of the set loaded from ``directory`` (``files``: name -> bytes read)."""
    return (
        git_revision(directory)
        or gitsync_revision(directory)
        or revision_file(directory)
        or content_hash(files)
    )


def _read_small(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(512).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _stat_key(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"


def _find_git_dir(directory: str) -> tuple[str, str] | None:
    """(git dir, common dir) of the checkout holding ``directory``, walking up."""
    current = os.path.realpath(directory)
    while True:
        dot_git = os.path.join(current, ".git")
        if os.path.isdir(dot_git):
            return dot_git, dot_git
        if os.path.isfile(dot_git):
            text = _read_small(dot_git)
            if text.startswith("gitdir:"):
                git_dir = os.path.join(current, text[len("gitdir:"):].strip())
                common = _read_small(os.path.join(git_dir, "commondir"))
                common_dir = os.path.join(git_dir, common) if common else git_dir
                return os.path.normpath(git_dir), os.path.normpath(common_dir)
            return None
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def git_state(directory: str | os.PathLike[str]) -> tuple[str, ...]:
    """A cheap key that changes when the checkout's HEAD commit may have changed.

    HEAD's content and, for a branch, the stat of its ref file and of packed-refs:
    a commit, checkout or reset changes one of them. Empty outside a checkout.
    """
    found = _find_git_dir(os.fspath(directory))
    if found is None:
        return ()
    git_dir, common_dir = found
    head = _read_small(os.path.join(git_dir, "HEAD"))
    key = [git_dir, head]
    if head.startswith("ref:"):
        ref = head[4:].strip()
        key.append(_stat_key(os.path.join(common_dir, *ref.split("/"))))
        key.append(_stat_key(os.path.join(common_dir, "packed-refs")))
    return tuple(key)
