"""The MCP OAuth client's pure part: challenges read, canonical resources, the audience
check, whose grant serves a sandbox, and the refusals with their statuses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.core.identity import Identity
from gateway.core.mcp_oauth import (
    CONSENT_TIMEOUT,
    Challenge,
    audience_covers,
    consent_ask,
    consent_required,
    grant_owner,
    oauth_failed,
    parse_challenge,
    resource_uri,
    token_presented,
    user_required,
)
from gateway.core.policy.ask_rule import Ask
from gateway.core.policy.mcp_rule import McpOAuth

CHALLENGES = [
    (['Bearer error="invalid_token", error_description="Authentication required", '
      'resource_metadata="https://mcp.test/.well-known/oauth-protected-resource/mcp"'],
     Challenge("invalid_token", (),
               "https://mcp.test/.well-known/oauth-protected-resource/mcp")),
    (['Bearer error="insufficient_scope", scope="repo read:org"'],
     Challenge("insufficient_scope", ("repo", "read:org"), None)),
    (['Basic realm="x"', 'Bearer resource_metadata="https://a.test/m"'],
     Challenge(None, (), "https://a.test/m")),
    (['bearer realm=example,error=invalid_token'], Challenge("invalid_token", (), None)),
    (['Bearer error="a \\"quoted\\" word"'], Challenge('a "quoted" word', (), None)),
    (['Bearer'], Challenge()),
    (['Basic realm="x"'], None),
    ([], None),
    (['Bearer error="' + "x" * 5000 + '"'], None),
]


@pytest.mark.parametrize(("values", "want"), CHALLENGES)
def test_challenges_are_read(values: list[str], want: Challenge | None) -> None:
    assert parse_challenge(values) == want


def test_a_hostile_challenge_is_read_in_linear_time() -> None:
    """A parameter and spaces with no value: quadratic with backtracking (85 ms for
    the 4 KiB read; the read is capped there, the expression no longer needs it)."""
    import time

    from gateway.core.mcp_oauth import _PARAM

    started = time.perf_counter()
    assert parse_challenge(["Bearer a = " + " " * 4000 + "x y"]) == Challenge()
    assert _PARAM.match("a = " + " " * 1_000_000 + "x y") is None
    assert time.perf_counter() - started < 0.5


def test_insufficient_scope_is_a_step_up() -> None:
    assert Challenge("insufficient_scope").insufficient_scope
    assert not Challenge("invalid_token").insufficient_scope


RESOURCES = [
    (("https", "MCP.test", 443, "/mcp"), "https://mcp.test/mcp"),
    (("https", "mcp.test", 8443, "/mcp/?x=1"), "https://mcp.test:8443/mcp"),
    (("https", "mcp.test", 443, "/"), "https://mcp.test"),
    (("http", "mcp.test", 80, "/a#f"), "http://mcp.test/a"),
    (("https", "::1", 443, "/mcp"), "https://[::1]/mcp"),
]


@pytest.mark.parametrize(("parts", "want"), RESOURCES)
def test_the_canonical_resource(parts: tuple[str, str, int, str], want: str) -> None:
    assert resource_uri(*parts) == want


AUDIENCES = [
    ("https://mcp.test/mcp", "https://mcp.test/mcp", True),
    ("https://mcp.test/mcp", "https://mcp.test/mcp/sub", True),
    ("https://mcp.test", "https://mcp.test/anything", True),
    ("https://mcp.test/mcp", "https://mcp.test/mcpx", False),
    ("https://mcp.test/mcp", "https://other.test/mcp", False),
    ("https://mcp.test/mcp", "https://mcp.test:8443/mcp", False),
    ("https://mcp.test/mcp", "https://mcp.test.evil/mcp", False),
    ("https://mcp.test/mcp/a", "https://mcp.test/mcp", False),
]


@pytest.mark.parametrize(("resource", "uri", "covers"), AUDIENCES)
def test_a_token_goes_only_to_its_resource(resource: str, uri: str, covers: bool) -> None:
    assert audience_covers(resource, uri) is covers


def _identity(sandbox: str, policy: str) -> Identity:
    return Identity(sandbox=sandbox, policy=policy, jti="j", scope={}, issued_at=0,
                    expires_at=1, lifetime_end=1)


# (the rule's ask, the policy's ask, the consent's timeout and notifiers)
CONSENT_ASKS = [
    (None, None, CONSENT_TIMEOUT, ()),
    (None, Ask(hosts=True), CONSENT_TIMEOUT, ()),  # (ask's 60 s default: not a consent's)
    (None, Ask(hosts=True, timeout=90, timed=True, notify=("ops",)), 90, ("ops",)),
    (Ask(timeout=20, timed=True, notify=("a",)),
     Ask(hosts=True, timeout=90, timed=True, notify=("ops", "a")), 20, ("a", "ops")),
    (Ask(notify=("a",)), Ask(hosts=True, timeout=600, timed=True), 600, ("a",)),
    (Ask(), Ask(hosts=True), CONSENT_TIMEOUT, ()),
]


@pytest.mark.parametrize(("rule", "policy", "timeout", "notify"), CONSENT_ASKS)
def test_how_long_a_consent_waits_and_who_is_told(
        rule: Ask | None, policy: Ask | None, timeout: float, notify: tuple[str, ...]
        ) -> None:
    spec = consent_ask(rule, policy)
    assert (spec.timeout, spec.notify) == (timeout, notify)


def test_whose_grant_serves_a_sandbox() -> None:
    one, two = _identity("sb-1", "agent"), _identity("sb-2", "agent")
    per_sandbox, per_policy = McpOAuth(), McpOAuth(consent="policy")
    assert grant_owner(per_sandbox, one) == "sandbox:sb-1"
    assert grant_owner(per_sandbox, one) != grant_owner(per_sandbox, two)
    assert grant_owner(per_policy, one) == grant_owner(per_policy, two) == "policy:agent"
    per_user = McpOAuth(consent="user")
    alice = replace(one, user="alice")
    assert grant_owner(per_user, alice) == grant_owner(
        per_user, replace(two, policy="other", user="alice")) == "user:alice"
    assert grant_owner(per_user, replace(one, user="bob")) == "user:bob"
    with pytest.raises(ValueError, match="names no user"):
        grant_owner(per_user, one)


def test_the_refusals() -> None:
    presented = token_presented("agent.yaml:3")
    assert (presented.code, presented.status, presented.rule) == \
        ("mcp_token_refused", 403, "agent.yaml:3")
    again = consent_required("the server refused grant og_1", None)
    assert (again.code, again.status, again.retry_after) == ("mcp_consent_required", 403, 5)
    assert "retry the request" in again.reason
    failed = oauth_failed("no authorization server", None)
    assert (failed.code, failed.status) == ("mcp_oauth_failed", 502)
    nobody = user_required("agent.yaml:3")
    assert (nobody.code, nobody.status, nobody.rule) == ("mcp_user_required", 403,
                                                         "agent.yaml:3")
    assert "--user NAME" in nobody.reason and "consent: sandbox or policy" in nobody.reason
