"""What a connection claims to be, judged: the proxy credentials it sends (a bearer token,
or Basic with the token as the password) and a workload's claim on its policy (the
policy's ``subjects``). Pure: ``pipeline/identify.py`` asks, the Kubernetes identity
service asks the same about a pod."""

from __future__ import annotations

import base64
from collections.abc import Callable

from gateway.core.identity import Identity
from gateway.core.refusal import Refusal

__all__ = ["proxy_credentials", "subject_refusal"]


def subject_refusal(identity: Identity,
                    admits: Callable[[str, str], bool] | None) -> Refusal | None:
    """A workload's claim on its policy, refused unless the policy exists and its
    `subjects` admit the pod's namespace and service account (`admits`: the policy's
    check; None: no such policy). Tokens without a workload are not concerned."""
    workload = identity.workload
    if workload is None:
        return None
    if admits is None:
        return Refusal("identity_unknown", f"pod {workload.namespace}/{workload.pod} names "
                       f"policy {identity.policy!r}, which is not loaded; fix the pod's "
                       "policy label or the namespace's default", identity=identity)
    if not admits(workload.namespace, workload.service_account):
        return Refusal("identity_unknown", f"policy {identity.policy!r} does not admit pod "
                       f"{workload.namespace}/{workload.pod} (service account "
                       f"{workload.service_account!r}) among its subjects; fix the pod's "
                       "label or the policy's subjects", identity=identity)
    return None


def proxy_credentials(value: str) -> tuple[str | None, str] | None:
    """Split a Proxy-Authorization value into (username, token); None if unusable."""
    scheme, _, param = value.strip().partition(" ")
    scheme = scheme.lower()
    param = param.strip()
    if scheme == "bearer" and param:
        return None, param
    if scheme == "basic" and param:
        try:
            decoded = base64.b64decode(param, validate=True).decode("utf-8")
        except ValueError:  # binascii.Error, UnicodeDecodeError, non-ASCII input
            return None
        user, sep, password = decoded.partition(":")
        if not sep or not password:
            return None
        return (user or None), password
    return None
