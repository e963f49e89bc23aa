"""`sandbox-gateway approvals` prints what a sandbox or an MCP server chose as data: an MCP
tool's old and new text as JSON strings, and no control or format character (an escape
sequence, a bidi override) of any field reaches the terminal."""

from __future__ import annotations

import json
import time

from gateway.cli.approvals import _line

HOSTILE = "Read.\x1b[2J\x1b]8;;https://evil.example\x07click\x1b]8;;\x07 \u202eexe.txt\nok"


def test_a_tools_change_is_printed_as_data() -> None:
    approval = {
        "id": "ap_1", "sandbox": "sbx-1", "policy": "agent", "state": "pending",
        "expires": time.time() + 60, "reason": "tool changed \x1b[31mred",
        "what": "tool ev\x1bil changed on mcp.test:443/mcp",
        "change": {"old": {"description": "Read the weather.", "inputSchema": "{}"},
                   "new": {"description": HOSTILE, "inputSchema": "{}"}}}
    out = _line(approval)
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert f"new description: {json.dumps(HOSTILE)}" in out
    assert 'old description: "Read the weather."' in out
    assert json.loads(out.split("new description: ", 1)[1].splitlines()[0]) == HOSTILE
    assert "inputSchema" not in out  # (unchanged: not shown)
    assert "tool ev\\u001bil changed" in out and "\\u001b[31mred" in out
    # (other approvals print as before)
    plain = _line({**approval, "change": None, "what": "GET a.test:443/x", "reason": "r"})
    assert "GET a.test:443/x  pending (" in plain and plain.endswith("\n    why: r")
