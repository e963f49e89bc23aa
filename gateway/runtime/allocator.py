"""The memory allocator the gateway's processes run on: jemalloc where it is installed.

Why (issue 46, docs/operations.md "Memory after a burst"): with CPython's own small-object
allocator (pymalloc) a worker keeps 1.6-1.7x its idle RSS after 5,000 intercepted tunnels
have closed, because pymalloc returns a 1 MiB arena only once every object in it is gone
and a few hundred long-lived objects the burst allocated pin most of them. Every object
from jemalloc instead (`PYTHONMALLOC=malloc`, jemalloc preloaded) comes back to
1.1-1.2x: its slabs are pages, not megabytes, and it returns free pages by itself
(`dirty_decay_ms`, from a background thread) as well as when the memory guard asks
(`purge`). Its CPU per intercepted request measured as pymalloc's within this machine's
noise (paired runs: medians 0.98-1.02 of pymalloc's; glibc's malloc cost 4-19 % more;
docs/performance.md "Issue 46, item 3").

An allocator is chosen before the interpreter starts, so `sandbox-gateway run` (only
`run`: the other commands are short-lived) starts itself again, same pid and arguments,
with the environment `environment` returns (`gateway/__main__.py`); the workers of `run
--workers N` inherit it. It changes nothing when `PYTHONMALLOC` is already set (the
operator's choice: `PYTHONMALLOC=pymalloc` keeps CPython's allocator, `malloc` glibc's)
or when no libjemalloc is found (then pymalloc, as before). `MALLOC_CONF` set by the
operator is kept. Standard library only: this runs before the gateway is imported.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping

__all__ = ["JEMALLOC_CONF", "LIBRARIES", "current", "environment", "find_jemalloc",
           "purge", "restart", "without"]

# Debian's and the image's libjemalloc2 (multiarch), then other distributions' places.
LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)
# background_thread: free pages are returned by jemalloc's own thread, not on the event
# loop's; dirty_decay_ms: within about a second of being freed (muzzy 0: returned with
# MADV_DONTNEED, so the RSS and limits.memory see it at once, not lazily); narenas: the
# event loop's thread and the few resolver/executor threads need no more.
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,narenas:2"
_ARENAS_ALL = 4096  # MALLCTL_ARENAS_ALL: "arena.4096.purge" purges every arena


def find_jemalloc(candidates: tuple[str, ...] = LIBRARIES) -> str | None:
    """The path of an installed libjemalloc.so.2, or None."""
    return next((path for path in candidates if os.path.isfile(path)), None)


def environment(env: Mapping[str, str],
                library: Callable[[], str | None] = find_jemalloc) -> dict[str, str] | None:
    """The variables to add to `env` for the gateway to run on jemalloc, or None when
    nothing is to change: `PYTHONMALLOC` set (already done, or the operator's choice),
    or no libjemalloc installed."""
    if "PYTHONMALLOC" in env:
        return None
    path = library()
    if path is None:
        return None
    preload = env.get("LD_PRELOAD", "").strip()
    return {
        "PYTHONMALLOC": "malloc",
        "LD_PRELOAD": f"{path} {preload}".strip(),
        "MALLOC_CONF": env.get("MALLOC_CONF") or JEMALLOC_CONF,
    }


def without(env: Mapping[str, str],
            library: Callable[[], str | None] = find_jemalloc) -> dict[str, str]:
    """`env` for a process that runs on CPython's own allocator although `run` runs on
    jemalloc: `PYTHONMALLOC=malloc` and the installed libjemalloc in `LD_PRELOAD` taken
    out together (one without the other would be the C library's malloc), anything else
    the operator preloads kept. The supervisor of `run --workers N` (standard library
    only, a few MiB, no bursts) holds 1.9 MiB less on it; its workers are given `env`
    itself. Unchanged when `PYTHONMALLOC` is not `malloc` or jemalloc is not preloaded."""
    out = dict(env)
    path = library()
    preload = out.get("LD_PRELOAD", "").split()
    if out.get("PYTHONMALLOC") != "malloc" or path is None or path not in preload:
        return out
    del out["PYTHONMALLOC"]
    rest = " ".join(item for item in preload if item != path)
    if rest:
        out["LD_PRELOAD"] = rest
    else:
        del out["LD_PRELOAD"]
    return out


def restart(env: Mapping[str, str] | None = None) -> None:
    """Start this process again on jemalloc (`os.execve`: same pid, arguments, open
    descriptors); returns only when `environment` says there is nothing to change."""
    env = dict(os.environ if env is None else env)
    extra = environment(env)
    if extra is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],  # noqa: S606
              {**env, **extra})


@functools.cache
def _symbol(name: str) -> Callable[..., int] | None:
    import ctypes  # (here: the start `restart` serves needs none of it)

    try:
        found: Callable[..., int] | None = getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None
    return found


def current() -> str:
    """The allocator Python objects come from in this process: `jemalloc`, `mimalloc`,
    `malloc` (the C library's) or `pymalloc`."""
    if not os.environ.get("PYTHONMALLOC", "").startswith("malloc"):
        return "pymalloc"
    if _symbol("mallctl") is not None:
        return "jemalloc"
    return "mimalloc" if _symbol("mi_collect") is not None else "malloc"


def purge() -> bool:
    """Return the preloaded allocator's free pages to the kernel now: jemalloc's (this
    thread's cache flushed, every arena purged) or mimalloc's (`mi_collect(force)`);
    False when neither is this process's allocator."""
    ctl = _symbol("mallctl")
    if ctl is not None:
        ctl(b"thread.tcache.flush", None, None, None, 0)
        ctl(f"arena.{_ARENAS_ALL}.purge".encode(), None, None, None, 0)
        return True
    collect = _symbol("mi_collect")
    if collect is not None:
        collect(True)
        return True
    return False
