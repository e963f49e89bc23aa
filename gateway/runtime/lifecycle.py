"""A running gateway's lifecycle after its start: readiness (`/readyz`: ready, degraded,
refusing and why), the drain (no new connections, in-flight work finished within
`shutdown.drain`) and the stop (every task, service and file closed in order)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from gateway.observability import logs
from gateway.runtime.building import Building
from gateway.runtime.listening import Listening
from gateway.runtime.startup import FD_RESERVE, open_fds

if TYPE_CHECKING:

    pass

log = logging.getLogger("sandbox_gateway")

__all__ = ["Lifecycle"]


class Lifecycle(Listening, Building):
    """Readiness, the drain and the stop of a gateway `Gateway.start` started."""

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: shutting down"
        if self.policy_set is None:
            return False, "policies not loaded"
        if not self._listening:
            return False, "proxy listener not up"
        if self.fd_limit and open_fds() > self.fd_limit - FD_RESERVE:
            return False, (f"out of file descriptors ({open_fds()} of {self.fd_limit} open); "
                           "new connections would fail")
        gate = self.gate
        full = self.memory.refusing if self.memory is not None else None
        if full is not None:
            return False, f"at capacity: {full}; new connections are refused 503 at_capacity"
        if gate is not None and gate.open_connections >= gate.max_connections:
            return False, (f"at capacity: {gate.open_connections} open connections, the "
                           "limit derived from the open-files limit; new connections are "
                           "refused 503 at_capacity")
        if self.proxy is not None and self.proxy.problem is not None:
            return False, (f"{self.proxy.problem}: every upstream dial goes through it "
                           "(network.upstream_proxy.check_ready)")
        stale = self.pods.stale() if self.pods is not None else None
        if stale is not None:
            return True, (f"ready for tokens; pods are not identified: {stale} (their "
                          "connections are refused 503 identity_unavailable)")
        problem = self.auditor.problem
        store = self.state_health.problem
        if store is not None and self.state_health.refusing is not None:
            return False, (f"state store unavailable ({store}): new tunnels and requests are "
                           "refused 503 state_unavailable (state.unavailable: refuse)")
        if problem is None and store is not None:  # (started: listening)
            return True, (f"degraded: state store: {store}; revocations hold on every worker "
                          "of this gateway, what could not be written is written when the "
                          "store is back (state.unavailable: serve)")
        if problem is None and self.state.warning is not None:
            return True, f"ready; {self.state.warning}"
        if problem is not None:
            if self.auditor.refusing is not None:
                return False, (f"audit lines cannot be written ({problem}): new exchanges "
                               "are refused 503 audit_unavailable (audit.on_failure: refuse)")
            return True, (f"ready; audit lines cannot be written ({problem}): serving on, "
                          "lines beyond audit.buffer are dropped (audit.on_failure: continue)")
        return True, "ready"

    def degraded(self) -> list[str]:
        """What serves on in a degraded way now (`/readyz`'s `degraded`)."""
        if self.draining or self.policy_set is None or not self._listening:
            return []
        out = []
        if self.state_health.problem is not None:
            out.append("state store")
        if self.auditor.problem is not None and self.auditor.refusing is None:
            out.append("audit")
        if self.pods is not None and self.pods.stale() is not None:
            out.append("pod identities")
        return out

    def in_flight(self) -> int:
        """Requests and streams still being served (what a drain waits for)."""
        count = sum(1 for conn in self.doors.h1.connections if conn.exchange is not None) \
            if self.doors is not None else 0
        return count + (self.adapter.in_flight() if self.adapter is not None else 0)

    async def drain(self, timeout: float | None = None) -> None:
        """Graceful shutdown, first half: readiness goes 503 at once, no new connections
        are accepted, idle connections close, and in-flight requests and streams run to
        completion for at most `shutdown.drain` seconds."""
        self.draining = True
        self._listening = False
        await self._close_listeners()
        limit = self.config.shutdown.drain if timeout is None else timeout
        deadline = time.monotonic() + limit
        if self.doors is not None:
            self.doors.h1.draining = True
        while time.monotonic() < deadline:
            if self.doors is not None:
                self.doors.h1.close_idle()
            if self.in_flight() == 0:
                break
            await asyncio.sleep(0.05)
        left = self.in_flight()
        if left:
            log.warning("drain: %d request(s) still in flight after %gs; cutting them off",
                        left, limit)

    async def stop(self) -> None:
        self._listening = False
        self.draining = True  # (also without a drain first: long admin answers end)
        if self.admin_server is not None:
            self.admin_server.should_exit = True
        if self.mitmproxy is not None:
            await self._close_listeners()
            if self.doors is not None:
                self.doors.close_all()
            self.mitmproxy.shutdown()
            if self.mitmproxy.task is not None:
                self._tasks.append(self.mitmproxy.task)
        await self._stop_dns()
        if self.pods is not None:
            await self.pods.close()
        await self.reloader.stop()
        await self.key_watcher.stop()
        if self.sweeper is not None:
            await self.sweeper.stop()
        for task in self._loops:  # (the memory guard, the upstream proxy's probe: they
            task.cancel()         # never end by themselves, and waiting held a stop 5 s)
        ended = await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops.clear()
        for result in ended:  # (a loop that had failed: said, as before)
            if isinstance(result, Exception):
                raise result
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, timeout=5)
        self._tasks.clear()
        if self.admin_bounds is not None:  # (uvicorn closed its own and the listener)
            self.admin_bounds.close()  # connections past its cap waiting for a probe
        if self.mcp_oauth is not None:
            await self.mcp_oauth.close()
        if self.approvals is not None:
            await self.approvals.close()  # (notifications still being sent: cancelled)
        if self.request_log is not None:
            await self.request_log.aclose()  # (its last lines, before the store closes)
        if self.issued is not None:
            await self.issued.stop()
        await self.tokens.revocations.stop()  # (a last try at what the store has not got)
        if self.relay is not None:
            await self.relay.close()
        await self.state.close()
        await self.credentials.close()  # the secret cache and the minted values' cache
        if self._vault_http is not None:
            await self._vault_http.close()
        logs.SOURCES.remove(self._log_source)
        await self.auditor.aclose()
        if self.otel is not None:  # (what is queued exported by the exporter process)
            await self.otel.close()
        if self.doors is not None:
            self.leaves.close()
        if self._tmp is not None:
            self._tmp.cleanup()
