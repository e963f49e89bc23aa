"""The console over Starlette's TestClient: its admin context as the runtime builds it
(real token service, policies, a state store), sign-in and the forms' CSRF token."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from gateway.api.context import AdminContext
from gateway.services.identity.tokens import SigningKeys, TokenService
from gateway.services.policy import PolicySet, load_policy_texts
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


def context(state: StateStore, clock: Clock, keys: Path, policies: PolicySet | None = None,
            **more: Any) -> AdminContext:
    """The admin listener's context as the runtime builds it, on `state`."""
    found = policies or load_policy_texts({"agent.yaml": AGENT})
    tokens = TokenService(SigningKeys.load(keys), state, lambda name: [], max_ttl=3600)
    return AdminContext(admin_token=ADMIN, tokens=tokens, policies=lambda: found,
                        readiness=Ready(), clock=clock, **more)


def sign_in(client: TestClient) -> str:
    """Sign in with the admin token; the session cookie's Set-Cookie header."""
    answer = client.post("/console/login", data={"token": ADMIN})
    assert answer.status_code == 303 and answer.headers["location"] == "/console/approvals"
    return str(answer.headers["set-cookie"])


def csrf(html: str) -> str:
    """The CSRF token of a page's forms."""
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, html
    return found.group(1)
