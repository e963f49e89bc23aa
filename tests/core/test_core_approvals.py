"""What is asked and what an answer means (gateway/core/approvals.py), as tables."""

from __future__ import annotations

import re
from typing import Any

import pytest

from gateway.core import approvals
from gateway.core.approvals import Approval, Asked, Grant
from gateway.core.policy import Request

NOW = 1_800_000_000.0


def _approval(**kw: Any) -> Approval:
    base: dict[str, Any] = {"id": "ap_1", "sandbox": "s1", "policy": "p", "reason": "r",
                            "asked": Asked("host", "h.test", 443), "created": NOW - 5,
                            "expires": NOW + 55}
    return Approval(**{**base, **kw})


@pytest.mark.parametrize(("request_", "host_known", "asked"), [
    (Request(None, "https", "h.test", 443, None), True, Asked("host", "h.test", 443)),
    (Request("GET", "https", "h.test", 443, "/a?b=c"), False, Asked("host", "h.test", 443)),
    (Request("POST", "https", "h.test", 443, "/a?b=c"), True,
     Asked("request", "h.test", 443, "POST", "/a")),
])
def test_what_is_asked(request_: Request, host_known: bool, asked: Asked) -> None:
    assert approvals.asked_for(request_, host_known) == asked


@pytest.mark.parametrize(("asked", "request_", "covered"), [
    (Asked("host", "h.test", 443), Request(None, "https", "h.test", 443, None), True),
    (Asked("host", "h.test", 443), Request("DELETE", "https", "h.test", 443, "/x"), True),
    (Asked("host", "h.test", 443), Request(None, "https", "h.test", 80, None), False),
    (Asked("host", "h.test", 443), Request(None, "https", "x.h.test", 443, None), False),
    (Asked("request", "h.test", 443, "GET", "/a"), Request("GET", "https", "h.test", 443,
                                                           "/a?q"), True),
    (Asked("request", "h.test", 443, "GET", "/a"), Request("GET", "https", "h.test", 443,
                                                           "/a/b"), False),
    (Asked("request", "h.test", 443, "GET", "/a"), Request("POST", "https", "h.test", 443,
                                                           "/a"), False),
    (Asked("request", "h.test", 443, "GET", "/a"), Request(None, "https", "h.test", 443,
                                                           None), False),
])
def test_what_an_approval_covers(asked: Asked, request_: Request, covered: bool) -> None:
    assert asked.covers(request_) is covered


@pytest.mark.parametrize(("decision", "kw", "state", "scope", "grant_for", "expires"), [
    ("approve", {}, "approved", "once", None, None),
    ("approve", {"scope": "sandbox"}, "approved", "sandbox", "s1", NOW + 3600),
    ("approve", {"scope": "policy", "duration": "15m"}, "approved", "policy", None,
     NOW + 900),
    ("approve", {"scope": "always"}, "approved", "always", None, None),
    ("deny", {"note": "no"}, "denied", None, None, None),
])
def test_answers(decision: str, kw: dict[str, Any], state: str, scope: str | None,
                 grant_for: str | None, expires: float | None) -> None:
    answered, grant = approvals.answer(_approval(), decision, by="alice", now=NOW, **kw)
    assert answered.state == state and answered.scope == scope and answered.by == "alice"
    assert answered.answered == NOW
    if scope in (None, "once"):
        assert grant is None and answered.grant is None
        return
    assert isinstance(grant, Grant) and answered.grant == grant.id
    assert grant.sandbox == grant_for and grant.expires == expires
    assert grant.policy == "p" and grant.asked == _approval().asked and grant.by == "alice"
    assert grant.source == f"grant:{grant.id}"


@pytest.mark.parametrize(("approval", "decision", "kw", "problem"), [
    (_approval(state="denied"), "approve", {}, "already answered (denied)"),
    (_approval(expires=NOW), "approve", {}, "timed out"),
    (_approval(), "maybe", {}, "approve or deny"),
    (_approval(), "approve", {"scope": "forever"}, "scope must be one of"),
    (_approval(), "approve", {"scope": "once", "duration": "1h"}, "takes no duration"),
    (_approval(), "approve", {"scope": "sandbox", "duration": "91d"}, "at most 90d"),
    (_approval(), "approve", {"scope": "sandbox", "duration": "soon"}, "not a duration"),
    # (JSON's NaN and Infinity reach here as floats: a grant's expiry must be a time)
    (_approval(), "approve", {"scope": "sandbox", "duration": float("nan")},
     "positive and finite"),
    (_approval(), "approve", {"scope": "policy", "duration": float("inf")},
     "positive and finite"),
    (_approval(), "approve", {"scope": "sandbox", "duration": "9" * 400},
     "positive and finite"),
    (_approval(), "approve", {"by": ""}, "say who answers"),
    (_approval(), "deny", {"note": "x" * 501}, "at most 500"),
])
def test_answers_that_cannot_be_given(approval: Approval, decision: str, kw: dict[str, Any],
                                      problem: str) -> None:
    kw = {"by": "alice", **kw}
    with pytest.raises(ValueError, match=re.escape(problem)):
        approvals.answer(approval, decision, now=NOW, **kw)


@pytest.mark.parametrize(("approval", "now", "state"), [
    (_approval(), NOW, "pending"),
    (_approval(), NOW + 55, "timeout"),  # (at its expiry: timed out)
    (_approval(), NOW + 3600, "timeout"),
    (_approval(state="approved", answered=NOW), NOW + 3600, "approved"),  # (answered: kept)
    (_approval(state="denied", answered=NOW), NOW + 3600, "denied"),
])
def test_an_approval_as_it_stands(approval: Approval, now: float, state: str) -> None:
    assert approval.at(now).state == state
    assert (approval.at(now) is approval) == (state == approval.state)


def test_records_round_trip() -> None:
    approval = _approval(asked=Asked("request", "h.test", 443, "GET", "/a"))
    assert Approval.from_doc(approval.to_doc()) == approval
    _, grant = approvals.answer(approval, "approve", scope="policy", by="a", now=NOW)
    assert grant is not None and Grant.from_doc(grant.to_doc()) == grant
    assert approval.asked.describe() == "GET h.test:443/a"


def test_an_oauth_consent_is_declined_here_and_given_elsewhere() -> None:
    """Kind oauth: an MCP server's consent, given by completing its authorization URL
    (services/mcp_oauth); here it can only be declined; it covers no request."""
    asked = Asked("oauth", "mcp.test", 443, path="/mcp")
    consent = {"url": "https://auth.test/authorize?x=1", "resource": "https://mcp.test/mcp"}
    approval = _approval(asked=asked, consent=consent)
    assert asked.describe() == "OAuth consent for the MCP server mcp.test:443/mcp"
    assert not asked.covers(Request("POST", "https", "mcp.test", 443, "/mcp"))
    assert not asked.includes(asked) and \
        not Asked("host", "mcp.test", 443).includes(asked)
    for scope in (None, "once", "policy"):
        with pytest.raises(ValueError, match="opening its authorization URL"):
            approvals.answer(approval, "approve", scope=scope, by="alice", now=1.0)
    denied, grant = approvals.answer(approval, "deny", by="alice", note="no", now=1.0)
    assert denied.state == "denied" and grant is None
    assert Approval.from_doc(approval.to_doc()) == approval  # (consent kept in the record)
