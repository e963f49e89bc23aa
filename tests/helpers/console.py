"""Console pages over Starlette's test client: an app on an admin context, sign-in, the
CSRF token of a page, and the check that a page shows no token or key."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from gateway.api.admin import build_admin_app
from gateway.api.context import AdminContext
from gateway.services.identity.tokens import SigningKeys, TokenService
from gateway.services.policy import PolicySet
from gateway.services.state.base import StateStore

ADMIN = "console-admin-token-0123456789abcdef"


class Ready:
    def ready(self) -> tuple[bool, str]:
        return True, "ready"


def console(state: StateStore, policies: PolicySet, keys: Path,
            clock: Callable[[], float], **more: Any) -> tuple[TestClient, AdminContext]:
    """A test client on the admin app (console and admin API; enter it with `with`)
    and its context."""
    def credentials(name: str) -> list[str] | None:
        found = policies.get(name)
        return None if found is None else found.credential_names

    tokens = TokenService(SigningKeys.load(keys), state, credentials, max_ttl=3600)
    ctx = AdminContext(admin_token=ADMIN, tokens=tokens, policies=lambda: policies,
                       readiness=Ready(), clock=clock, **more)
    return TestClient(build_admin_app(ctx), base_url="http://127.0.0.1:8090",
                      follow_redirects=False), ctx


def sign_in(client: TestClient) -> None:
    answer = client.post("/console/login", data={"token": ADMIN})
    assert answer.status_code == 303, answer.text


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html
    return found.group(1)


def assert_no_secrets(html: str, *secrets: str) -> None:
    """No JWT (`eyJ…` header and payload: a CSRF token is random base64 and may hold
    `eyJ` by chance), no admin token, none of `secrets` in `html`."""
    assert re.search(r"eyJ[\w-]+\.eyJ", html) is None
    for secret in (ADMIN, *secrets):
        assert secret not in html
