"""Hot reload of the policies directory by polling a cheap fingerprint.

The fingerprint is, for the directory (resolved) and each top-level entry: the
name, the resolved target of symlinks (this catches Kubernetes ConfigMap
``..data`` swaps and git-sync swaps of a symlinked directory) and, for policy
files, inode, mtime_ns and size after resolving symlinks (this catches in-place
rewrites). Polling works the same on every filesystem and in every container,
unlike inotify, and costs a few ``stat`` calls per interval. It also holds the
``REVISION`` file's stat and the git checkout's HEAD key (``revision.git_state``):
a commit that leaves the files as they are still changes the set's revision
(``<sha>-dirty`` becomes the new ``<sha>``).

Every installed set carries its ``revision``; ``sandbox_gateway_policy_info
{revision}`` is 1 for the serving one (the previous revision's series is removed;
with worker processes, where prometheus_client cannot remove a series, it is set
to 0). A reload of unchanged files and commit keeps the revision.

A change loads the whole set in a worker thread. Success replaces the serving set
(``on_reload``); failure logs every error, calls ``on_error`` and keeps the last
good set: the gateway is never left without a policy.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from gateway.core.policy.compiled import PolicySet, learning
from gateway.observability.metrics import MULTIPROCESS, POLICY_INFO, POLICY_RELOADS, POLICY_RULES
from gateway.services.policy.loader import PolicyError, load_policy_dir
from gateway.services.policy.revision import REVISION_FILE, git_state
from gateway.services.polling import Poller

__all__ = ["Fingerprint", "PolicyReloader", "fingerprint"]

log = logging.getLogger("gateway.policy")

Fingerprint = tuple[tuple[str, ...], ...]


def fingerprint(directory: str | os.PathLike[str]) -> Fingerprint:
    """A cheap summary of the directory that changes whenever a load could differ."""
    base = os.fspath(directory)
    try:
        names = sorted(os.listdir(base))
    except OSError as exc:
        return (("<error>", base, str(exc.errno)),)
    out: list[tuple[str, ...]] = [("<dir>", os.path.realpath(base))]
    for name in names:
        path = os.path.join(base, name)
        is_link = os.path.islink(path)
        target = os.path.realpath(path) if is_link else ""
        if name.startswith(".") or not name.endswith((".yaml", ".yml")):
            if is_link:
                out.append((name, target))
            continue
        try:
            st = os.stat(path)
        except OSError as exc:
            out.append((name, target, "<error>", str(exc.errno)))
            continue
        out.append((name, target, str(st.st_ino), str(st.st_mtime_ns), str(st.st_size)))
    try:
        st = os.stat(os.path.join(base, REVISION_FILE))
        out.append(("<revision>", str(st.st_ino), str(st.st_mtime_ns), str(st.st_size)))
    except OSError:
        pass
    out.append(("<git>", *git_state(base)))
    return tuple(out)


class PolicyReloader(Poller):
    """Keeps a PolicySet in sync with a directory; ``load_now`` at startup, ``start`` after."""

    _poll_name = "policy-reloader"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        on_reload: Callable[[PolicySet], None] | None = None,
        on_error: Callable[[list[str]], None] | None = None,
        interval: float = 1.0,
        learn: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.learn = learn
        self.interval = interval
        self._on_reload = on_reload
        self._on_error = on_error
        self._current: PolicySet | None = None
        self._seen: Fingerprint | None = None
        self.last_errors: list[str] = []

    @property
    def current(self) -> PolicySet | None:
        """The last set that loaded without error (None before the first success)."""
        return self._current

    def _load(self) -> PolicySet:
        """The directory's set; every policy in ``mode: learn`` with ``learn``
        (``run --learn``, the config's ``learn: true``)."""
        policy_set = load_policy_dir(self.directory)
        return learning(policy_set) if self.learn else policy_set

    def load_now(self) -> PolicySet:
        """Load synchronously (startup). Raises PolicyError; callbacks are not called."""
        seen = fingerprint(self.directory)
        try:
            policy_set = self._load()
        except PolicyError as exc:
            self._seen = seen
            self._failed(exc.errors, notify=False)
            raise
        self._seen = seen
        self._succeeded(policy_set, notify=False)
        return policy_set

    async def check(self) -> bool:
        """Poll once: reload if the fingerprint changed. True if a new set was installed."""
        seen = fingerprint(self.directory)
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            policy_set = await asyncio.to_thread(self._load)
        except PolicyError as exc:
            self._failed(exc.errors, notify=True)
            return False
        except Exception as exc:  # a loader bug must not kill the reload loop
            log.exception("policy reload crashed")
            self._failed(
                [f"{self.directory}:0: internal error while loading: {exc!r}"], notify=True
            )
            return False
        self._succeeded(policy_set, notify=True)
        return True

    def start(self) -> asyncio.Task[None]:
        """Start polling as a task on the running loop."""
        return self._poll()

    def _succeeded(self, policy_set: PolicySet, *, notify: bool) -> None:
        previous = self._current.revision if self._current is not None else None
        self._current = policy_set
        self.last_errors = []
        POLICY_RELOADS.labels(result="ok").inc()
        POLICY_RULES.set(policy_set.rule_count)
        _publish_revision(previous, policy_set.revision)
        log.info(
            "policies loaded from %s: %d policies, %d rules, revision %s",
            self.directory,
            len(policy_set.policies),
            policy_set.rule_count,
            policy_set.revision,
        )
        if notify and self._on_reload is not None:
            self._on_reload(policy_set)

    def _failed(self, errors: list[str], *, notify: bool) -> None:
        self.last_errors = list(errors)
        POLICY_RELOADS.labels(result="error").inc()
        kept = "keeping the last good set" if self._current is not None else "no policy loaded"
        log.error("policy load from %s failed (%d errors; %s)", self.directory, len(errors), kept)
        for error in errors:
            log.error("%s", error)
        if notify and self._on_error is not None:
            self._on_error(list(errors))


def _publish_revision(previous: str | None, revision: str) -> None:
    """``sandbox_gateway_policy_info{revision}`` = 1 for ``revision``, the previous one gone."""
    if previous is not None and previous != revision:
        if MULTIPROCESS:
            POLICY_INFO.labels(revision=previous).set(0)
        else:
            POLICY_INFO.remove(previous)
    POLICY_INFO.labels(revision=revision).set(1)
