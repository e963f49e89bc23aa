"""Telling people what is asked: webhooks (a Slack-compatible incoming webhook, or the
approval as JSON), each POST signed so a receiver can tell it came from the gateway.

Signature: ``X-Sandbox-Gateway-Timestamp: <unix seconds>`` and
``X-Sandbox-Gateway-Signature: v1=<hex HMAC-SHA256 of "<timestamp>." + body>``, keyed by
the value of the notifier's `secret` (a name in the gateway's secret store); a receiver
recomputes it and refuses a timestamp older than a few minutes. No token or key is ever
in a notification: what is asked, by which sandbox and policy, why the policy refused,
and how to answer (for an MCP server's OAuth consent: its authorization URL, which
carries a PKCE challenge and a `state`, never a code, token or client secret). A Slack
message shows what a sandbox could have chosen (its request's host and path, the reason
naming them) only inside inline code spans, escaped for Slack's mrkdwn (`code`), so a
hostile path can neither link, mention nor break out. Sent with the gateway's own HTTP
client (`TokenHttp`: the public roots plus `network.upstream_ca`, `network.resolve`,
and `network.upstream_proxy` when set).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import unicodedata
from collections.abc import Callable, Mapping
from urllib.parse import quote

from gateway.config import Notifier
from gateway.core.approvals import Approval
from gateway.core.ports import SILENT, Secrets, Telemetry
from gateway.services.minting.errors import MintFailed
from gateway.services.minting.http import TokenHttp

__all__ = ["SIGNATURE", "TIMESTAMP", "Webhooks", "body_for", "code", "consent_url", "link_url",
           "sign", "slack_text"]

log = logging.getLogger("sandbox_gateway.approvals")

SIGNATURE = "X-Sandbox-Gateway-Signature"
TIMESTAMP = "X-Sandbox-Gateway-Timestamp"
ATTEMPTS = 3
TIMEOUT = 5.0  # seconds per attempt


def sign(key: bytes, timestamp: str, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp`."""
    return "v1=" + hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def code(text: str, limit: int = 300) -> str:
    """`text` as one Slack mrkdwn inline code span that forms nothing: no link, no
    ``<!channel>`` or ``<@U…>`` mention, no way out of the span. ``&``, ``<`` and ``>``
    are escaped as Slack requires, a backtick is shown as U+02CB (modifier letter
    grave), control and format characters (newlines, bidi overrides) as
    ``\\xNN``/``\\uNNNN``; cut at `limit` characters."""
    cut = text[:limit] + ("…" if len(text) > limit else "")
    shown = "".join(_char(c) for c in cut) or "(none)"
    return f"`{shown}`"


def _char(c: str) -> str:
    if c == "`":
        return "\u02cb"
    if c in _SLACK_ESCAPES:
        return _SLACK_ESCAPES[c]
    category = unicodedata.category(c)
    if category in ("Cc", "Cf", "Zl", "Zp"):
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return c


_SLACK_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


def slack_text(approval: Approval) -> str:
    """The Slack message of `approval`: every value a sandbox could have chosen (what it
    asks, the policy's reason naming it, its id and policy) in an inline code span
    (`code`); no mention. One link only, an OAuth consent's authorization URL (built
    by the gateway; `link_url` escapes what a hostile authorization server's endpoint
    could carry)."""
    answer = f"sandbox-gateway approvals approve {approval.id} (or deny)"
    url = consent_url(approval)
    how = f"Answer: {code(answer)} or {code(f'POST /v1/approvals/{approval.id}')}" \
        if url is None else (f"Consent: <{link_url(url)}|open this link and sign in> "
                             f"(decline: {code(f'sandbox-gateway approvals deny {approval.id}')})")
    return (f":raised_hand: sandbox {code(approval.sandbox)} (policy {code(approval.policy)}) "
            f"asks for {code(approval.asked.describe())}\n"
            f"Why the policy refused it: {code(approval.reason, 500)}\n"
            f"Waiting {round(approval.expires - approval.created)}s. {how}")


def consent_url(approval: Approval) -> str | None:
    """The authorization URL of an OAuth consent approval (None: another kind)."""
    url = (approval.consent or {}).get("url") if approval.asked.kind == "oauth" else None
    return url if isinstance(url, str) and url.startswith("https://") else None


def link_url(url: str) -> str:
    """`url` as the target of a Slack link: every character outside the URL syntax
    (spaces, ``<``, ``>``, ``|``, backticks, controls, non-ASCII) percent-encoded, so
    it can neither end the link nor name another; ``&`` escaped as Slack requires."""
    return quote(url, safe=":/?#[]@!$&'()*+,;=%-._~").replace("&", "&amp;")


def body_for(notifier: Notifier, approval: Approval) -> bytes:
    """What `notifier` is sent about `approval` (an OAuth consent: its authorization
    URL to open, `answer.open`; it can only be declined here)."""
    if notifier.format == "slack":
        return json.dumps({"text": slack_text(approval), "unfurl_links": False,
                           "unfurl_media": False}).encode()
    url = consent_url(approval)
    answer = {"api": f"POST /v1/approvals/{approval.id}",
              "cli": f"sandbox-gateway approvals approve {approval.id} (or deny)"} \
        if url is None else {"open": url, "decline": f"sandbox-gateway approvals deny "
                             f"{approval.id}"}
    return json.dumps({"type": "approval.requested", "approval": approval.to_doc(),
                       "answer": answer}).encode()


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
