"""Run a piece of work on several threads at once and fail with the first error any
of them raised (an assertion in a thread is otherwise lost)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def at_once(work: Callable[[], None], threads: int = 4) -> None:
    """`work` on `threads` threads started together; raises what the first one raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # (raised below, in the caller's thread)
            errors.append(exc)

    started = [threading.Thread(target=run) for _ in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()
    if errors:
        raise errors[0]
