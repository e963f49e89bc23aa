"""Console pages over Starlette's test client: the admin context as the runtime builds
it (real token service, policies, a state store), an app on it, sign-in, the CSRF token
of a page, and the check that a page shows no token or key."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from gateway.api.admin import build_admin_app
from gateway.api.context import AdminContext
from gateway.core.policy import PolicySet
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.policy import load_policy_texts
from gateway.services.state.base import StateStore

ADMIN = "console-admin-token-0123456789abcdef"
AGENT = "version: v1\nname: agent\negress: []\n"


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Ready:
    def ready(self) -> tuple[bool, str]:
        return True, "ready"

    def degraded(self) -> list[str]:
        return []


def context(state: StateStore, clock: Callable[[], float], keys: Path,
            policies: PolicySet | None = None, **more: Any) -> AdminContext:
    """The admin listener's context as the runtime builds it, on `state`."""
    found = policies or load_policy_texts({"agent.yaml": AGENT})

    def credentials(name: str) -> tuple[str, ...] | None:
        policy = found.get(name)
        return None if policy is None else policy.credential_names

    tokens = TokenService(SigningKeys.load(keys), state, credentials, max_ttl=3600)
    return AdminContext(admin_token=ADMIN, tokens=tokens, policies=lambda: found,
                        readiness=Ready(), clock=clock, **more)


def console(state: StateStore, policies: PolicySet, keys: Path,
            clock: Callable[[], float], **more: Any) -> tuple[TestClient, AdminContext]:
    """A test client on the admin app (console and admin API; enter it with `with`)
    and its context."""
    ctx = context(state, clock, keys, policies, **more)
    return TestClient(build_admin_app(ctx), base_url="http://127.0.0.1:8090",
                      follow_redirects=False), ctx


def sign_in(client: TestClient) -> str:
    """Sign in with the admin token; the session cookie's Set-Cookie header."""
    answer = client.post("/console/login", data={"token": ADMIN})
    assert answer.status_code == 303 and answer.headers["location"] == "/console/approvals", \
        answer.text
    return str(answer.headers["set-cookie"])


def csrf_of(html: str) -> str:
    """The CSRF token of a page's forms."""
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


def assert_no_secrets(html: str, *secrets: str) -> None:
    """No JWT (`eyJ…` header and payload: a CSRF token is random base64 and may hold
    `eyJ` by chance), no admin token, none of `secrets` in `html`."""
    assert re.search(r"eyJ[\w-]+\.eyJ", html) is None
    for secret in (ADMIN, *secrets):
        assert secret not in html
