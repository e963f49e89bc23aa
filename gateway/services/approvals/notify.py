"""Telling people what is asked: webhooks (a Slack-compatible incoming webhook, or the
approval as JSON), each POST signed so a receiver can tell it came from the gateway.

Signature: ``X-Sandbox-Gateway-Timestamp: <unix seconds>`` and
``X-Sandbox-Gateway-Signature: v1=<hex HMAC-SHA256 of "<timestamp>." + body>``, keyed by
the value of the notifier's `secret` (a name in the gateway's secret store); a receiver
recomputes it and refuses a timestamp older than a few minutes. No token or key is ever
in a notification: what is asked, by which sandbox and policy, why the policy refused,
and how to answer. Sent with the gateway's own HTTP client (`TokenHttp`: the public roots
plus `network.upstream_ca`, `network.resolve`, and `network.upstream_proxy` when set).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable, Mapping

from gateway.config import Notifier
from gateway.core.approvals import Approval
from gateway.core.ports import SILENT, Secrets, Telemetry
from gateway.services.minting.errors import MintFailed
from gateway.services.minting.http import TokenHttp

__all__ = ["SIGNATURE", "TIMESTAMP", "Webhooks", "body_for", "sign"]

log = logging.getLogger("sandbox_gateway.approvals")

SIGNATURE = "X-Sandbox-Gateway-Signature"
TIMESTAMP = "X-Sandbox-Gateway-Timestamp"
ATTEMPTS = 3
TIMEOUT = 5.0  # seconds per attempt


def sign(key: bytes, timestamp: str, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp`."""
    return "v1=" + hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def body_for(notifier: Notifier, approval: Approval) -> bytes:
    """What `notifier` is sent about `approval`."""
    answer = f"sandbox-gateway approvals approve {approval.id} (or deny)"
    if notifier.format == "slack":
        text = (f":raised_hand: sandbox *{approval.sandbox}* (policy *{approval.policy}*) "
                f"asks for `{approval.asked.describe()}`: {approval.reason}\n"
                f"Waiting {round(approval.expires - approval.created)}s. Answer: `{answer}` "
                f"or POST /v1/approvals/{approval.id}")
        return json.dumps({"text": text}).encode()
    return json.dumps({"type": "approval.requested", "approval": approval.to_doc(),
                       "answer": {"api": f"POST /v1/approvals/{approval.id}",
                                  "cli": answer}}).encode()


class Webhooks:
    """Sends notifications in the background (a slow receiver never holds a request
    longer: the ask waits for a person, not for the webhook)."""

    def __init__(self, notifiers: Mapping[str, Notifier], secrets: Secrets | None,
                 http: TokenHttp, telemetry: Telemetry = SILENT,
                 clock: Callable[[], float] = time.time) -> None:
        self.notifiers = notifiers
        self.secrets = secrets
        self.http = http
        self.telemetry = telemetry
        self.clock = clock
        self._tasks: set[asyncio.Task[None]] = set()

    def notify(self, names: tuple[str, ...], approval: Approval) -> None:
        for name in names:
            notifier = self.notifiers.get(name)
            if notifier is None:
                log.warning("approval %s: no notifier %r in approvals.notify; nobody was "
                            "told", approval.id, name)
                self.telemetry.count("approval_notifications", name, "unknown")
                continue
            task = asyncio.get_running_loop().create_task(self._send(name, notifier,
                                                                     approval))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, name: str, notifier: Notifier, approval: Approval) -> None:
        body = body_for(notifier, approval)
        headers = {"Content-Type": "application/json", "User-Agent": "sandbox-gateway"}
        key: bytes | None = None
        if notifier.secret is not None:
            try:
                if self.secrets is None:
                    raise RuntimeError("no secret store")
                key = (await self.secrets.get(notifier.secret)).reveal().encode()
            except Exception as exc:  # (the secret store's own errors name what failed)
                log.warning("approval %s: notifier %r not sent: its secret %r is not "
                            "available (%s)", approval.id, name, notifier.secret,
                            getattr(exc, "reason", type(exc).__name__))
                self.telemetry.count("approval_notifications", name, "failed")
                return
        for attempt in range(ATTEMPTS):
            if key is not None:
                stamp = str(int(self.clock()))
                headers[TIMESTAMP], headers[SIGNATURE] = stamp, sign(key, stamp, body)
            try:
                reply = await self.http.request("POST", notifier.url, headers=headers,
                                                data=body)
                if reply.status < 300:
                    self.telemetry.count("approval_notifications", name, "sent")
                    return
                problem = f"HTTP {reply.status}"
            except MintFailed as exc:  # (the client's fixed sentences)
                problem = str(exc)
            log.warning("approval %s: notifier %r failed (%s), attempt %d of %d",
                        approval.id, name, problem, attempt + 1, ATTEMPTS)
            await asyncio.sleep(0.5 * 2 ** attempt)
        self.telemetry.count("approval_notifications", name, "failed")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.http.close()
