"""Keep a `PodIndex` current from the API server: list, then watch from the list's
resourceVersion, per sandbox namespace (kubernetes_asyncio's API client: config,
authentication, TLS).

Each namespace loops: list (replaces what the index holds for it), then watch with
bookmarks (`allowWatchBookmarks`: the resourceVersion advances while nothing changes,
so a resumed watch is rarely too old), resuming from the last version seen when the
server ends a stream, and listing again when it answers `410 Gone` (the version was
compacted away: events were lost, only a list is the truth again). Any other failure
(connection refused or cut, a 5xx, an unreadable event) is retried after a backoff
(0.5 s doubling to 10 s).

`stale()` says why the index cannot be trusted now, or None: a namespace that was
never listed, or one the API server has said nothing about for longer than
`stale_after` (its pods may have been deleted and their addresses given to others
meanwhile). The gate then refuses new connections and requests of pods
(`identity_unavailable`) and `/readyz` says why. Staleness counts from the last word
*heard* (a list, a stream opened, an event or bookmark), not from a failed attempt: a
server gone silent behind a dropped route fails no attempt until a read timeout, so a
stream silent for half of `stale_after` is reopened from its version (a quiet namespace
on a server that sends bookmarks once a minute costs a watch request per half
`stale_after`; a busy one costs none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from gateway.services.identity.kubernetes.pods import PodIndex, pod_from

__all__ = ["PodWatcher"]

log = logging.getLogger("sandbox_gateway.kubernetes")

WATCH_SECONDS = (240, 300)  # the server ends each watch after this long (randomised)
BACKOFF = (0.5, 10.0)


class WatchFailed(Exception):
    """A list or watch answered with an error status (`code`: the HTTP status)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class PodWatcher:
    """One list+watch loop per namespace feeding `index`. `core` is kubernetes_asyncio's
    CoreV1Api. (The gate's sweep, every half second, ends connections of pods that
    changed: nothing here needs to tell it.)"""

    def __init__(self, core: Any, namespaces: tuple[str, ...], index: PodIndex, *,
                 selector: str = "", stale_after: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.namespaces = namespaces
        self.index = index
        self.selector = selector
        self.stale_after = stale_after
        self.clock = clock
        self.listed: dict[str, float] = {}  # namespace -> when it was last listed
        self.heard: dict[str, float] = {}  # namespace -> the API server's last word on it
        self.broken: dict[str, str] = {}  # namespace -> why its last attempt failed
        # A stream silent this long is reopened: a live server answers well within
        # stale_after, a vanished one never does.
        self.silence = max(0.2, stale_after / 2)
        self._tasks: list[asyncio.Task[None]] = []

    # -- what the gate and /readyz ask ---------------------------------------------------

    def stale(self) -> str | None:
        """Why pod identities cannot be trusted now, or None."""
        now = self.clock()
        for namespace in self.namespaces:
            if namespace not in self.listed:
                why = self.broken.get(namespace, "not listed yet")
                return f"the pods of namespace {namespace!r} are not listed yet ({why})"
            silent = now - self.heard[namespace]
            if silent > self.stale_after:
                why = self.broken.get(namespace, "its watch stream went silent")
                return (f"the pod watch of namespace {namespace!r} has heard nothing from "
                        f"the API server for {silent:.0f}s (more than "
                        f"identity.kubernetes.stale_after, {self.stale_after:g}s): {why}")
        return None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(ns), name=f"pod-watch-{ns}")
                       for ns in self.namespaces]

    async def wait_listed(self, timeout: float) -> bool:
        """Wait until every namespace was listed once (False: not within `timeout`)."""
        deadline = self.clock() + timeout
        while len(self.listed) < len(self.namespaces):
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    # -- the loop --------------------------------------------------------------------------

    async def _run(self, namespace: str) -> None:
        delay = BACKOFF[0]
        while True:
            try:
                resume: str | None = await self._list(namespace)
                delay = BACKOFF[0]
                while resume is not None:
                    resume = await self._watch(namespace, resume)
                log.info("pods of %s: resourceVersion too old (410 Gone); listing again",
                         namespace)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is retried; staleness fails closed
                why = self.broken[namespace] = _describe(exc)
                log.warning("pod watch of namespace %s: %s; retrying in %.1fs",
                            namespace, why, delay)
                await asyncio.sleep(delay * (0.8 + 0.4 * random.random()))  # noqa: S311 (jitter)
                delay = min(BACKOFF[1], delay * 2)

    async def _list(self, namespace: str) -> str:
        """List the namespace's pods into the index; returns the list's resourceVersion."""
        response = await self.core.list_namespaced_pod(
            namespace, label_selector=self.selector or None, _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(total=30))
        async with response:
            if response.status != 200:
                raise WatchFailed(response.status, await _message(response))
            body = await response.json()
        pods = [pod_from(item) for item in body.get("items") or ()]
        self.index.replace(namespace, pods)
        self.listed[namespace] = self._heard(namespace)
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, namespace: str, version: str) -> str | None:
        """Apply the events of one watch stream from `version`. Returns the version to
        resume from, or None when it is too old (410: list again)."""
        response = await self.core.list_namespaced_pod(
            namespace, label_selector=self.selector or None, watch=True,
            allow_watch_bookmarks=True, resource_version=version,
            timeout_seconds=random.randint(*WATCH_SECONDS),  # noqa: S311 (spread)
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(sock_connect=10, sock_read=self.silence))
        async with response:
            if response.status == 410:
                return None
            if response.status != 200:
                raise WatchFailed(response.status, await _message(response))
            self._heard(namespace)  # (a stream is open: the index is current)
            position = [version]
            try:
                return await self._events(namespace, response, position)
            except TimeoutError:  # silent for self.silence: reopen, proving it is there
                _abort(response)
                return position[0]
            except BaseException:
                _abort(response)
                raise

    async def _events(self, namespace: str, response: Any, position: list[str]) -> str | None:
        """Apply a watch stream's events; see `_watch`. `position[0]` follows the version
        reached (where a stream given up resumes)."""
        async for line in response.content:
            if not line.strip():
                continue  # (not a word: a stream of blank lines goes stale)
            event = json.loads(line)
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    return None
                raise WatchFailed(int(obj.get("code") or 500), str(obj.get("message")))
            self._heard(namespace)
            version = str((obj.get("metadata") or {}).get("resourceVersion") or position[0])
            position[0] = version
            if kind == "BOOKMARK":
                continue
            pod = pod_from(obj)
            if kind == "DELETED":
                self.index.remove(pod.namespace, pod.name)
            elif kind in ("ADDED", "MODIFIED"):
                self.index.put(pod)
        return position[0]

    def _heard(self, namespace: str) -> float:
        """The API server said something about `namespace` now: current again."""
        now = self.heard[namespace] = self.clock()
        self.broken.pop(namespace, None)
        return now


def _abort(response: Any) -> None:
    """Drop a stream given up half-read (silent, an error, or stop()) at once: a TLS
    close would wait for a server that is busy streaming, or gone."""
    connection = response.connection
    if connection is not None and connection.transport is not None:
        connection.transport.abort()


async def _message(response: Any) -> str:
    """The `message` of an API error's Status body (short), or its reason phrase."""
    try:
        text = await response.text()
        return str(json.loads(text).get("message") or response.reason)[:200]
    except (ValueError, aiohttp.ClientError, AttributeError):
        return str(response.reason)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, WatchFailed):
        return f"the API server answered {exc}"
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return "the API server did not answer in time"
    if isinstance(exc, aiohttp.ClientError | OSError):
        return f"cannot reach the API server ({type(exc).__name__}: {exc})"[:240]
    return f"{type(exc).__name__}: {exc}"[:240]
