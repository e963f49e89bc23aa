"""What a connection claims to be (core/claims.py): proxy credentials and a pod's claim on
its policy, table-driven."""

from __future__ import annotations

import base64
import math

import pytest

from gateway.core.claims import proxy_credentials, subject_refusal
from gateway.core.identity import Identity, Workload


def _basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


CREDENTIALS = [
    ("Bearer tok", (None, "tok")),
    ("bearer   tok  ", (None, "tok")),
    ("BEARER tok", (None, "tok")),
    (_basic("sandbox-1:tok"), ("sandbox-1", "tok")),
    (_basic(":tok"), (None, "tok")),  # no user name: the token alone
    (_basic("user:pa:ss"), ("user", "pa:ss")),  # the password may hold a colon
    (_basic("user:"), None),  # no password: no token
    (_basic("user"), None),  # no colon
    ("Basic !!notbase64", None),
    ("Basic " + base64.b64encode(b"\xff\xfe:x").decode(), None),  # not UTF-8
    ("Bearer", None),
    ("Digest abc", None),
    ("", None),
]


@pytest.mark.parametrize(("value", "expected"), CREDENTIALS)
def test_proxy_credentials(value: str, expected: tuple[str | None, str] | None) -> None:
    assert proxy_credentials(value) == expected


def _identity(workload: Workload | None) -> Identity:
    return Identity(sandbox="s", policy="agents", jti="j", scope={}, issued_at=0.0,
                    expires_at=math.inf, lifetime_end=math.inf, workload=workload)


POD = Workload(namespace="team-a", pod="agent-0", uid="u", service_account="runner")

SUBJECTS = [
    ("a token without a workload", None, None, None),
    ("a pod whose policy is not loaded", POD, None, "which is not loaded"),
    ("a pod the subjects refuse", POD, lambda ns, sa: ns == "team-b", "among its subjects"),
    ("a pod the subjects admit", POD, lambda ns, sa: (ns, sa) == ("team-a", "runner"), None),
]


@pytest.mark.parametrize(("what", "workload", "admits", "says"), SUBJECTS,
                         ids=[s[0] for s in SUBJECTS])
def test_subject_refusal(what: str, workload: Workload | None, admits: object,
                         says: str | None) -> None:
    refusal = subject_refusal(_identity(workload), admits)  # type: ignore[arg-type]
    if says is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.code == "identity_unknown"
        assert says in refusal.reason and "team-a/agent-0" in refusal.reason
