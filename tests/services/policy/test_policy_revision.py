"""Provenance: every loaded set names its revision (real git, git-sync, ConfigMap, hash)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.observability.metrics import REGISTRY
from gateway.services.policy import PolicyReloader, load_policy_dir, load_policy_text
from gateway.services.policy.revision import (
    GitRefError,
    content_hash,
    export_ref,
    git_revision,
    gitsync_revision,
    revision_file,
)

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git binary")


def policy(name: str, *hosts: str) -> str:
    rules = "".join(f"  - host: {h}\n" for h in hosts)
    return f"version: v1\nname: {name}\negress:\n{rules}"


def git(cwd: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", GIT_CONFIG_NOSYSTEM="1",
               HOME=str(cwd))
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          check=True)
    return done.stdout.strip()


def repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    return path


def commit(path: Path, message: str = "change") -> str:
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", message)
    return git(path, "rev-parse", "HEAD")


def info(revision: str) -> float | None:
    return REGISTRY.get_sample_value("sandbox_gateway_policy_info", {"revision": revision})


# --- content hash (pure) --------------------------------------------------------------


def test_content_hash_is_short_sorted_and_framed() -> None:
    a = content_hash({"a.yaml": b"x", "b.yaml": b"y"})
    assert a.startswith("sha256:") and len(a) == len("sha256:") + 12
    assert a == content_hash({"b.yaml": b"y", "a.yaml": b"x"})  # order of reading
    assert a != content_hash({"a.yaml": b"x", "b.yaml": b"y "})  # bytes
    assert a != content_hash({"a.yml": b"x", "b.yaml": b"y"})  # names
    # (name, bytes) framing: moving bytes across the boundary changes the hash
    assert content_hash({"ab": b"c"}) != content_hash({"a": b"bc"})


def test_outside_git_the_revision_is_the_content_hash(tmp_path: Path) -> None:
    assert git_revision(tmp_path) is None  # precondition: tmp is not in a checkout
    (tmp_path / "a.yaml").write_text(policy("a", "one.example.com"))
    loaded = load_policy_dir(tmp_path)
    assert loaded.revision == content_hash({"a.yaml": (tmp_path / "a.yaml").read_bytes()})
    # the same text loaded from memory under the same name: the same revision
    assert load_policy_text("a.yaml", policy("a", "one.example.com")).revision == loaded.revision
    # tests/ (policy test cases) is neither loaded nor hashed
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "cases.yaml").write_text("cases: [this is not a policy]\n")
    assert load_policy_dir(tmp_path).revision == loaded.revision


def test_revision_file_from_a_configmap_key_or_annotation(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(policy("a", "one.example.com"))
    (tmp_path / "REVISION").write_text("v1.4.2+9f1c2e7\n")
    assert revision_file(tmp_path) == "v1.4.2+9f1c2e7"
    assert load_policy_dir(tmp_path).revision == "v1.4.2+9f1c2e7"
    (tmp_path / "REVISION").write_text("not a revision; rm -rf /\n")
    assert revision_file(tmp_path) is None
    assert load_policy_dir(tmp_path).revision.startswith("sha256:")


def test_configmap_swap_changes_the_revision(tmp_path: Path) -> None:
    """The kubelet's layout: names -> ..data/name, ..data -> ..<timestamp>, swapped atomically."""
    for stamp, rev, host in (("..2026_01", "rev-one", "one.example.com"),
                             ("..2026_02", "rev-two", "two.example.com")):
        (tmp_path / stamp).mkdir()
        (tmp_path / stamp / "a.yaml").write_text(policy("a", host))
        (tmp_path / stamp / "REVISION").write_text(rev)
    os.symlink("..2026_01", tmp_path / "..data")
    os.symlink("..data/a.yaml", tmp_path / "a.yaml")
    os.symlink("..data/REVISION", tmp_path / "REVISION")
    reloader = PolicyReloader(tmp_path)
    assert reloader.load_now().revision == "rev-one"
    os.symlink("..2026_02", tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert asyncio.run(reloader.check()) is True
    assert reloader.current is not None and reloader.current.revision == "rev-two"


# --- real git -------------------------------------------------------------------------


def test_git_commit_dirty_and_clean(tmp_path: Path) -> None:
    root = repo(tmp_path / "repo")
    pdir = root / "deploy" / "policies"
    pdir.mkdir(parents=True)
    (pdir / "a.yaml").write_text(policy("a", "one.example.com"))
    (root / "README").write_text("x")
    sha = commit(root)
    assert load_policy_dir(pdir).revision == sha
    # unrelated files and policy tests do not make the policies dirty
    (root / "README").write_text("changed")
    (pdir / "tests").mkdir()
    (pdir / "tests" / "t.yaml").write_text("cases: []\n")
    assert load_policy_dir(pdir).revision == sha
    # a modified, an untracked, or an ignored policy file does
    (pdir / "a.yaml").write_text(policy("a", "two.example.com"))
    assert load_policy_dir(pdir).revision == f"{sha}-dirty"
    git(root, "checkout", "--", "deploy/policies/a.yaml")
    (pdir / "b.yaml").write_text(policy("b", "b.example.com"))
    assert load_policy_dir(pdir).revision == f"{sha}-dirty"
    (root / ".gitignore").write_text("b.yaml\n")
    assert load_policy_dir(pdir).revision == f"{sha}-dirty"
    (pdir / "b.yaml").unlink()
    assert load_policy_dir(pdir).revision == sha
    # git hooks export GIT_DIR; it must not point the check at another repository
    other = repo(tmp_path / "other")
    (other / "x").write_text("x")
    commit(other)
    os.environ["GIT_DIR"] = str(other / ".git")
    try:
        assert load_policy_dir(pdir).revision == sha
    finally:
        del os.environ["GIT_DIR"]


def test_reload_across_commits_and_the_info_metric(tmp_path: Path) -> None:
    root = repo(tmp_path / "repo")
    file = root / "a.yaml"
    file.write_text(policy("a", "one.example.com"))
    first = commit(root)
    reloaded: list[str] = []
    reloader = PolicyReloader(root, on_reload=lambda s: reloaded.append(s.revision))
    assert reloader.load_now().revision == first
    assert info(first) == 1.0

    async def scenario() -> None:
        assert await reloader.check() is False  # nothing changed: no reload, same revision
        # a rewrite with the same bytes reloads (new mtime) and keeps the revision
        os.utime(file, ns=(1, 1))
        assert await reloader.check() is True
        assert reloaded[-1] == first
        # edit: the checkout is dirty until the commit
        file.write_text(policy("a", "two.example.com"))
        assert await reloader.check() is True
        assert reloaded[-1] == f"{first}-dirty"
        # the commit changes no file, only HEAD: still picked up
        second = commit(root)
        assert await reloader.check() is True
        assert reloaded[-1] == second != first
        assert info(second) == 1.0
        assert info(first) is None and info(f"{first}-dirty") is None  # old series removed
        assert await reloader.check() is False
        assert reloader.current is not None and reloader.current.revision == second

    asyncio.run(scenario())


def _gitsync(root: Path, sha: str, layout: str) -> Path:
    """Check ``sha`` out as git-sync does and point ``root/current`` at it atomically."""
    name = f".worktrees/{sha}" if layout == "v4" else f"rev-{sha}"
    git(root, "worktree", "add", "-q", "--detach", name, sha)
    os.symlink(name, root / "current.tmp")
    os.replace(root / "current.tmp", root / "current")
    return root / name


@pytest.mark.parametrize("layout", ["v4", "v3"])
def test_gitsync_symlink_swap(tmp_path: Path, layout: str) -> None:
    """git-sync: ``current -> .worktrees/<sha>`` (v4) or ``rev-<sha>`` (v3), each a git
    worktree whose ``.git`` file points into the repository; a sync swaps the link."""
    root = repo(tmp_path / "git")
    (root / "policies").mkdir()
    (root / "policies" / "a.yaml").write_text(policy("a", "one.example.com"))
    first = commit(root)
    _gitsync(root, first, layout)
    pdir = root / "current" / "policies"
    reloader = PolicyReloader(pdir)
    assert reloader.load_now().revision == first
    (root / "policies" / "a.yaml").write_text(policy("a", "two.example.com"))
    second = commit(root)
    _gitsync(root, second, layout)
    assert asyncio.run(reloader.check()) is True
    assert reloader.current is not None
    assert reloader.current.revision == second
    assert [r.host for r in reloader.current.policies["a"].rules] == ["two.example.com"]
    assert asyncio.run(reloader.check()) is False  # the new link is the new fingerprint


@pytest.mark.parametrize("layout", ["v4", "v3"])
def test_gitsync_without_a_usable_git_dir(tmp_path: Path, layout: str) -> None:
    """The sidecar's volume mounted elsewhere: the worktree's .git file points at a path
    this container does not have. The commit still comes from git-sync's directory name."""
    root = repo(tmp_path / "git")
    (root / "policies").mkdir()
    (root / "policies" / "a.yaml").write_text(policy("a", "one.example.com"))
    sha = commit(root)
    worktree = _gitsync(root, sha, layout)
    (worktree / ".git").write_text("gitdir: /nonexistent/.git/worktrees/x\n")
    pdir = root / "current" / "policies"
    assert git_revision(pdir) is None
    assert gitsync_revision(pdir) == sha
    assert load_policy_dir(pdir).revision == sha


def test_export_ref(tmp_path: Path) -> None:
    root = repo(tmp_path / "repo")
    (root / "p").mkdir()
    (root / "p" / "a.yaml").write_text(policy("a", "one.example.com"))
    first = commit(root)
    (root / "p" / "a.yaml").write_text(policy("a", "two.example.com"))
    commit(root)
    out = tmp_path / "out"
    out.mkdir()
    sha, exists = export_ref(root / "p", "HEAD~1", out)
    assert (sha, exists) == (first, True)
    assert (out / "a.yaml").read_text() == policy("a", "one.example.com")
    # export-ignore (which `git archive` would honour), subdirectories and symlinks do not
    # change what is read: the top-level policy blobs, as the loader reads a directory
    (root / ".gitattributes").write_text("*.yaml export-ignore\n")
    (root / "p" / "tests").mkdir()
    (root / "p" / "tests" / "t.yaml").write_text("cases: []\n")
    os.symlink("a.yaml", root / "p" / "link.yaml")
    third = commit(root)
    again = tmp_path / "again"
    again.mkdir()
    assert export_ref(root / "p", "HEAD", again) == (third, True)
    assert sorted(p.name for p in again.iterdir()) == ["a.yaml"]
    missing = tmp_path / "missing"
    missing.mkdir()
    (root / "q").mkdir()
    assert export_ref(root / "q", "HEAD", missing) == (git(root, "rev-parse", "HEAD"), False)
    with pytest.raises(GitRefError, match="unknown git ref"):
        export_ref(root / "p", "no-such-branch", out)
    with pytest.raises(GitRefError, match="not in a git checkout"):
        export_ref(tmp_path / "missing", "HEAD", out)
    with pytest.raises(GitRefError, match="invalid git ref"):
        export_ref(root / "p", "--output=/tmp/x", out)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the repository away")
def test_a_repository_owned_by_another_user_is_not_run(tmp_path: Path) -> None:
    """git refuses another user's repository; the gateway keeps that refusal, so the
    repository's config (a clean filter here) never runs in the gateway. A git-sync
    checkout owned by the sidecar's uid is still named, by its directory."""
    root = repo(tmp_path / "git")
    (root / "policies").mkdir()
    (root / "policies" / "a.yaml").write_text(policy("a", "one.example.com"))
    sha = commit(root)
    _gitsync(root, sha, "v4")
    marker = tmp_path / "filter-ran"
    with (root / ".git" / "config").open("a") as config:
        config.write(f'[filter "evil"]\n\tclean = touch {marker}; cat\n')
    (root / ".gitattributes").write_text("*.yaml filter=evil\n")
    for where in (root, tmp_path / "git" / ".worktrees" / sha):
        (where / "policies" / "a.yaml").write_text(policy("a", "two.example.com"))
    subprocess.run(["chown", "-R", "65533:65533", str(tmp_path / "git")], check=True)
    assert load_policy_dir(root / "current" / "policies").revision == sha
    plain = load_policy_dir(root / "policies").revision
    assert plain.startswith("sha256:")  # not the commit: git did not vouch for the files
    assert not marker.exists()
