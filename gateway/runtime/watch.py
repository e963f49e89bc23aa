"""The supervisor of `run --workers N` once everything is prepared: it starts the workers,
restarts one that exits on its own (with backoff), relays token revocations between them
(`relay.py`: every worker holds one before the admin API answers, whatever the state
store does), forwards SIGTERM/SIGINT and exits when every worker has stopped.

`workers.run_supervisor` prepares what the workers share (in the full gateway: config,
policies, CA, keys, state file, reserved ports) and then replaces itself with this
module (`exec`, same pid, so the workers' parent-death signal still points at it). A
fresh interpreter that imports only the standard library (on CPython's own allocator:
`allocator.without`) holds about 14 MiB for the life of the gateway instead of the
~45 MiB the preparing process had loaded (crypto, policy compiler, YAML, the CLI). The
plan comes on an inherited pipe (never in argv, which every user can read); the reserved
ports are inherited descriptors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gateway.runtime.relay import Relay

TYPE_CHECKING = False  # (not `typing`'s: the supervisor never imports typing, 0.5 MiB)
if TYPE_CHECKING:
    from typing import Any

READY_TIMEOUT = 60.0
RESTART_BACKOFF = (1.0, 30.0)
STABLE = 60.0  # a worker that ran this long before it died starts its backoff over


def next_restart(previous: int, ran_for: float) -> tuple[int, float]:
    """(the slot's restart count, seconds to wait before starting it again): doubling
    from 1 s to at most 30 s while a worker keeps dying soon after it started, from 1 s
    again for one that had run `STABLE` seconds (a crash a day is not a crash loop)."""
    count = 1 if ran_for >= STABLE else previous + 1
    return count, min(RESTART_BACKOFF[1], RESTART_BACKOFF[0] * 2 ** (count - 1))


class Watcher:
    """Starts, watches and stops the worker processes of one plan (see `plan` in
    `workers.run_supervisor`)."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.count = int(plan["workers"])
        self.config_path: str | None = plan["config_path"]
        self.env = {**os.environ, **plan["env"]}
        self.runtime = Path(plan["runtime"])
        self.remove_runtime = bool(plan["remove_runtime"])
        self.metrics_dir = Path(plan["metrics_dir"])
        self.stop_timeout = float(plan["stop_timeout"])
        self.held: list[int] = [int(fd) for fd in plan["held"]]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts: dict[int, int] = {}
        self.started: dict[int, float] = {}
        self.stopping = False
        self.relay = Relay()

    def _spawn(self, index: int) -> None:
        link = self.relay.attach(index)  # (a new link; the snapshot waits on it)
        cmd = [sys.executable, "-m", "gateway", "run", "--worker-index", str(index),
               "--supervisor", str(os.getpid()), "--relay-fd", str(link.fileno())]
        if self.config_path:
            cmd += ["--config", self.config_path]
        (self.runtime / f"ready-{index}").unlink(missing_ok=True)
        try:
            self.procs[index] = subprocess.Popen(cmd, env=self.env, pass_fds=(link.fileno(),))
            self.started[index] = time.monotonic()
        finally:
            link.close()

    def pause(self, seconds: float) -> None:
        """Wait `seconds` (or until told to stop), relaying revocations meanwhile."""
        deadline = time.monotonic() + seconds
        while not self.stopping and (left := deadline - time.monotonic()) > 0:
            self.relay.pump(min(left, 0.2))

    def start(self) -> bool:
        for index in range(self.count):
            self._spawn(index)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and not self.stopping:
            if all((self.runtime / f"ready-{i}").exists() for i in range(self.count)):
                return True
            if any(p.poll() is not None for p in self.procs.values()):
                return False
            self.relay.pump(0.05)
        return False

    def watch(self) -> int:
        """Until told to stop: restart workers that exit on their own."""
        while not self.stopping:
            for index, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None or self.stopping:
                    continue
                self.forget(proc.pid)
                self.restarts[index], wait = next_restart(
                    self.restarts.get(index, 0), time.monotonic() - self.started[index])
                print(f"sandbox-gateway: worker {index} exited with {code}; restarting in "
                      f"{wait:.0f}s", file=sys.stderr, flush=True)
                self.relay.detach(index)  # (not waited for; its successor reads a snapshot)
                self.pause(wait)
                if not self.stopping:
                    self._spawn(index)
            self.relay.pump(0.2)
        return self.stop(self.stop_timeout)

    def forget(self, pid: int) -> None:
        """A worker died: its live gauges (open connections, audit and state-store health,
        ...) leave the sums at once; a killed worker never took its connections off the
        gauge itself. Its counters stay (they count what happened)."""
        from prometheus_client import multiprocess  # (only when a worker dies)

        multiprocess.mark_process_dead(pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]

    def request_stop(self, *_: object) -> None:
        self.stopping = True

    def stop(self, timeout: float = 15.0) -> int:
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (time.monotonic() < deadline
               and any(proc.poll() is None for proc in self.procs.values())):
            self.relay.pump(0.05)  # (draining workers may still revoke)
        worst = 0
        for proc in self.procs.values():
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            worst = worst or (code if code not in (0, -signal.SIGTERM) else 0)
        self.relay.close()
        for fd in self.held:
            os.close(fd)
        self.held = []
        if self.remove_runtime:
            import shutil  # (here: with bz2 and lzma, 0.7 MiB the supervisor holds no longer)

            shutil.rmtree(self.runtime, ignore_errors=True)
        return worst


def main(argv: list[str]) -> int:
    """`python -m gateway.runtime.watch <fd>`: the plan is JSON on pipe `fd`."""
    with os.fdopen(int(argv[1]), encoding="utf-8") as pipe:
        plan = json.load(pipe)
    watcher = Watcher(plan)
    signal.signal(signal.SIGTERM, watcher.request_stop)
    signal.signal(signal.SIGINT, watcher.request_stop)
    if not watcher.start():
        stopping = watcher.stopping
        watcher.stop()
        if stopping:
            return 0
        print("sandbox-gateway: a worker failed to start (see its messages above)",
              file=sys.stderr)
        return 2
    print(plan["banner"], file=sys.stderr, flush=True)
    return watcher.watch()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
