"""Ask mode's webhooks (gateway/services/approvals/notify.py) to a local HTTP receiver:
the exact Slack payload for requests whose host and path a hostile sandbox chose (links,
@-mentions, `<!channel>`, backticks, newlines, bidi overrides): every such value inside
one inline code span, escaped for Slack's mrkdwn, and no mention anywhere."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from gateway.config import Notifier
from gateway.core.approvals import Approval, Asked
from gateway.net.resolver import new_event_loop
from gateway.services.approvals.notify import Webhooks
from gateway.services.minting.http import TokenHttp


class _Receiver(BaseHTTPRequestHandler):
    got: ClassVar[list[bytes]] = []

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_POST(self) -> None:
        type(self).got.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def receiver() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    _Receiver.got = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _approval(asked: Asked, reason: str, sandbox: str = "sbx-1") -> Approval:
    return Approval(id="ap_0123456789abcdef", sandbox=sandbox, policy="agent", asked=asked,
                    reason=reason, created=1000.0, expires=1060.0)


def _send(url: str, approval: Approval) -> dict[str, Any]:
    """What a Slack notifier at `url` receives about `approval` (sent for real)."""
    async def main() -> None:
        hooks = Webhooks({"slack": Notifier(url=url, format="slack")}, None, TokenHttp())
        hooks.notify(("slack",), approval)
        for _ in range(500):
            if _Receiver.got:
                break
            await asyncio.sleep(0.01)
        await hooks.close()

    asyncio.run(main(), loop_factory=new_event_loop)  # type: ignore[arg-type]
    [body] = _Receiver.got
    doc: dict[str, Any] = json.loads(body)
    return doc


TAIL = ("Waiting 60s. Answer: `sandbox-gateway approvals approve ap_0123456789abcdef "
        "(or deny)` or `POST /v1/approvals/ap_0123456789abcdef`")

# (case, asked, the policy's reason, the exact text Slack receives)
HOSTILE = [
    ("a link and a channel mention in the path",
     Asked("request", "allowed.test", 443, "GET", "/x<!channel>|<http://evil.test|click>"),
     'path "/x<!channel>|<http://evil.test|click>" is not allowed',
     ":raised_hand: sandbox `sbx-1` (policy `agent`) asks for "
     "`GET allowed.test:443/x&lt;!channel&gt;|&lt;http://evil.test|click&gt;`\n"
     "Why the policy refused it: `path \"/x&lt;!channel&gt;|&lt;http://evil.test|click&gt;\" "
     "is not allowed`\n" + TAIL),
    ("a backtick breaking out of the code span, a user mention",
     Asked("request", "allowed.test", 443, "POST", "/a`<@U0123ABC>`&amp;"),
     "method POST is not allowed",
     ":raised_hand: sandbox `sbx-1` (policy `agent`) asks for "
     "`POST allowed.test:443/a\u02cb&lt;@U0123ABC&gt;\u02cb&amp;amp;`\n"
     "Why the policy refused it: `method POST is not allowed`\n" + TAIL),
    ("a newline and a bidi override",
     Asked("request", "allowed.test", 443, "GET", "/a\n<!here>\u202ex"),
     "no rule",
     ":raised_hand: sandbox `sbx-1` (policy `agent`) asks for "
     "`GET allowed.test:443/a\\x0a&lt;!here&gt;\\u202ex`\n"
     "Why the policy refused it: `no rule`\n" + TAIL),
    ("a hostile host, and an empty reason",
     Asked("host", "<!everyone>.evil.test", 443), "",
     ":raised_hand: sandbox `sbx-1` (policy `agent`) asks for "
     "`&lt;!everyone&gt;.evil.test:443 (any request)`\n"
     "Why the policy refused it: `(none)`\n" + TAIL),
]


@pytest.mark.parametrize(("case", "asked", "reason", "text"), HOSTILE,
                         ids=[h[0] for h in HOSTILE])
def test_the_slack_payload_forms_no_link_mention_or_escape(
        receiver: str, case: str, asked: Asked, reason: str, text: str) -> None:
    doc = _send(receiver, _approval(asked, reason))
    assert doc == {"text": text, "unfurl_links": False, "unfurl_media": False}
    # Slack's control sequences (links, mentions) start with "<": none reaches Slack, and
    # every backtick pairs up (each value is one code span).
    assert "<" not in doc["text"] and ">" not in doc["text"]
    assert all(line.count("`") % 2 == 0 for line in doc["text"].split("\n"))


def test_a_long_path_is_cut(receiver: str) -> None:
    doc = _send(receiver, _approval(Asked("request", "a.test", 443, "GET", "/" + "x" * 1000),
                                    "no"))
    shown = re.search(r"asks for `([^`]*)`", doc["text"])
    assert shown is not None and len(shown.group(1)) == 301 and shown.group(1)[-1] == "…"


def test_a_consent_carries_its_url_as_the_one_link(receiver: str) -> None:
    """An OAuth consent's Slack message links its authorization URL (the one link);
    what a hostile authorization server's endpoint carries (a `|`, `>`, a space, a
    Slack mention) is percent-encoded, so it neither ends the link nor makes another."""
    url = "https://auth.test/authorize|<!channel> x>y?client_id=c&state=s"
    approval = replace(_approval(Asked("oauth", "mcp.test", 443, path="/mcp"), "consent"),
                       consent={"url": url, "resource": "https://mcp.test/mcp"})
    text = _send(receiver, approval)["text"]
    link = ("<https://auth.test/authorize%7C%3C!channel%3E%20x%3Ey?client_id=c&amp;state=s"
            "|open this link and sign in>")
    assert text.endswith(f"Waiting 60s. Consent: {link} (decline: `sandbox-gateway "
                         "approvals deny ap_0123456789abcdef`)"), text
    assert text.count("<") == 1 and text.count(">") == 1


def test_a_consent_without_an_https_url_has_no_link(receiver: str) -> None:
    approval = replace(_approval(Asked("oauth", "mcp.test", 443, path="/mcp"), "consent"),
                       consent={"url": "javascript:alert(1)"})
    text = _send(receiver, approval)["text"]
    assert "<" not in text and text.endswith(TAIL)
