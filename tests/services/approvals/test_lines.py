"""Ask mode's audit lines (`lines.py`): what each names, in the audit line's one shape."""

from __future__ import annotations

from gateway.core.approvals import Approval, Asked, Grant
from gateway.core.audit import record
from gateway.services.approvals.lines import approval_line, revoked_line

NOW = 1_800_000_000.0


def _approval(asked: Asked) -> Approval:
    return Approval(id="ap_1", sandbox="s1", policy="agent", asked=asked, reason="r",
                    created=NOW, expires=NOW + 60)


def test_an_approval_line_names_the_approval_and_what_was_asked() -> None:
    line = approval_line(_approval(Asked("host", "h.test", 443)), "ask", "held", NOW)
    assert (line["decision"], line["reason"], line["rule"]) == \
        ("ask", "approval ap_1: held", "approval:ap_1")
    assert (line["method"], line["host"], line["port"], line["engine"]) == \
        ("CONNECT", "h.test", 443, "approvals")  # (a host ask: the tunnel it held)
    assert (line["sandbox"], line["policy"]) == ("s1", "agent")
    assert set(line) >= set(record(identity=None, client=None, listener="admin", method=None,
                                   scheme=None, host=None, port=None, path=None,
                                   decision="d", reason="r", rule=None, status=None,
                                   error=None, bytes_in=None, bytes_out=None, started=NOW,
                                   path_taken=None, engine="approvals"))


def test_an_answer_names_the_grant_rule_it_made() -> None:
    asked = Asked("request", "h.test", 443, "POST", "/v1/x")
    line = approval_line(_approval(asked), "approve", "answered by a", NOW,
                         rule="grant:g_1")
    assert (line["method"], line["path"], line["rule"]) == ("POST", "/v1/x", "grant:g_1")


def test_a_revocation_names_the_grant_and_who_revoked_it() -> None:
    grant = Grant(id="g_1", approval="ap_1", scope="policy", policy="agent", sandbox=None,
                  asked=Asked("host", "h.test", 443), by="alice", note=None, created=NOW,
                  expires=None)
    line = revoked_line(grant, "carol", NOW)
    assert (line["decision"], line["reason"], line["rule"]) == \
        ("revoke", "grant g_1 (policy) revoked by carol", grant.source)
    assert (line["sandbox"], line["policy"]) == (None, "agent")
