"""Kubernetes-native identity (`identity.kubernetes`): a labelled pod is a known sandbox.

Two ways in, one index of pods:

* **By address** — `identity_for(ip)`, the gate's `Workloads` port: the running pod of a
  watched namespace that holds the connection's source address is the sandbox
  `<namespace>/<pod>`, with the policy of its label or its namespace's default; no
  token anywhere (credentials are injected for it as for a token in the key slot).
* **By exchange** — `exchange(sa_token)`, `POST /v1/tokens/exchange`: a pod that cannot
  be known by its address (NAT, host network, another cluster) presents its projected
  service-account token; verified (TokenReview or OIDC) and checked against the
  watched pod (same name and uid, Running), it gets a gateway token bound to the pod,
  refused once the pod is gone (`gone`).

kubernetes_asyncio is imported only here, and this package only when enabled.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.config import KubernetesConfig
from gateway.core.claims import subject_refusal
from gateway.core.identity import Identity, Workload
from gateway.core.policy import PolicySet
from gateway.core.refusal import Refusal
from gateway.services.identity.claims import TokenError
from gateway.services.identity.kubernetes.accounts import (
    AccountRefused,
    Claims,
    OidcVerifier,
    TokenReviewVerifier,
)
from gateway.services.identity.kubernetes.pods import PodIndex, Policies
from gateway.services.identity.kubernetes.watch import PodWatcher
from gateway.services.identity.tokens import MintedToken, TokenService

__all__ = ["AccountRefused", "ExchangeRefused", "Exchanged", "PodIdentities"]

log = logging.getLogger("sandbox_gateway.kubernetes")

MAX_VERIFYING = 32  # exchanges verified at once (each may be an API call), per process
_JWT = re.compile(r"[A-Za-z0-9_-]{2,4096}\.[A-Za-z0-9_-]{2,16384}\.[A-Za-z0-9_-]{2,4096}")
_UNKNOWN_HINT = ("; a sandbox pod must be Running in a watched namespace "
                 "(identity.kubernetes.namespaces) and name its policy "
                 "(label or namespace default)")


class ExchangeRefused(Exception):
    """A token exchange is refused: `status` (401, 403, 503) and a reason (no token text)."""

    def __init__(self, status: int, code: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Exchanged:
    """A token exchanged for a pod's: the token, and whom it names."""

    minted: MintedToken
    sandbox: str
    policy: str


class PodIdentities:
    """The watched pods as identities (see the module docstring)."""

    def __init__(self, config: KubernetesConfig, tokens: TokenService,
                 policies: Callable[[], PolicySet]) -> None:
        self.config = config
        self.tokens = tokens
        self.policies = policies
        self.index = PodIndex(Policies(config.policy_label, dict(config.default_policies)))
        self._api: Any = None
        self.watcher: PodWatcher | None = None
        self.verifier: TokenReviewVerifier | OidcVerifier | None = None
        self._verifying = 0  # exchanges waiting for their verification now

    async def start(self, *, wait: float = 10.0) -> None:
        """Connect to the API server (the kubeconfig, else the in-cluster service
        account), start the watch and wait up to `wait` seconds for the first lists
        (not listed by then: new pod connections are refused until they are)."""
        from kubernetes_asyncio import client, config

        configuration = client.Configuration()
        if self.config.kubeconfig is not None:
            await config.load_kube_config(config_file=str(self.config.kubeconfig),
                                          client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        self._api = client.ApiClient(configuration)
        self.watcher = PodWatcher(
            client.CoreV1Api(self._api), self.config.namespaces, self.index,
            selector=self.config.pod_selector, stale_after=self.config.stale_after)
        exchange = self.config.exchange
        if exchange.enabled and exchange.verify == "tokenreview":
            self.verifier = TokenReviewVerifier(client.AuthenticationV1Api(self._api),
                                                exchange.audience)
        elif exchange.enabled:
            self.verifier = OidcVerifier(client.WellKnownApi(self._api),
                                         client.OpenidApi(self._api), exchange.audience,
                                         exchange.issuer)
        self.watcher.start()
        if not await self.watcher.wait_listed(wait):
            log.warning("pods not listed within %gs: %s", wait, self.stale())

    async def close(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        if self._api is not None:
            await self._api.close()
            # TLS connections close in the background: give them the loop to finish on
            # (aiohttp's advice for a graceful shutdown), or the stopped loop leaks them.
            # aiohttp waits for its pool's; one the watch was opening when it was stopped
            # is not in the pool: 0.1 s left one unclosed once on a loaded machine (CI).
            await asyncio.sleep(0.5)

    def stale(self) -> str | None:
        """Why pod identities cannot be trusted now (the watch), or None."""
        if self.watcher is None:
            return "the pod watch has not started"
        return self.watcher.stale()

    # -- the gate's Workloads port -----------------------------------------------------------

    def identity_for(self, ip: str) -> Identity:
        stale = self.stale()
        if stale is not None:
            raise Refusal("identity_unavailable", f"{stale}; pods are not identified by "
                          "address until the watch is current again", retry_after=5)
        found = self.index.at(ip)
        if isinstance(found, str):
            raise Refusal("identity_unknown", found + _UNKNOWN_HINT)
        return found

    def gone(self, workload: Workload) -> str | None:
        stale = self.stale()
        if stale is not None:
            raise Refusal("identity_unavailable", f"the token's pod cannot be checked: "
                          f"{stale}", retry_after=5)
        return self.index.running(workload.namespace, workload.pod, workload.uid)

    # -- the exchange ----------------------------------------------------------------------

    async def exchange(self, sa_token: str, ttl: float | None = None) -> Exchanged:
        """A gateway token for the pod whose projected service-account token this is.
        Raises ExchangeRefused."""
        if self.verifier is None:
            raise ExchangeRefused(404, "exchange_disabled", "token exchange is off "
                                  "(identity.kubernetes.exchange.enabled)")
        if _JWT.fullmatch(sa_token) is None:  # (no API call for what cannot be a token)
            raise ExchangeRefused(401, "exchange_refused", "not a JWT: send the pod's "
                                  "projected service-account token")
        if self._verifying >= MAX_VERIFYING:  # an open endpoint: bound the API calls
            raise ExchangeRefused(503, "exchange_busy", f"{MAX_VERIFYING} exchanges are "
                                  "being verified; retry in a second")
        self._verifying += 1
        try:
            claims = await self.verifier.verify(sa_token)
        except AccountRefused as refused:
            raise ExchangeRefused(401, "exchange_refused", str(refused)) from None
        finally:
            self._verifying -= 1
        workload, policy = self._bound_pod(claims)
        chosen = self.config.exchange.ttl if ttl is None else min(ttl, self.config.exchange.ttl)
        sandbox = f"{claims.namespace}/{claims.pod}"
        try:
            minted = self.tokens.mint(sandbox, policy, ttl=chosen, workload=workload)
        except TokenError as exc:
            raise ExchangeRefused(403, "exchange_refused", str(exc)) from None
        return Exchanged(minted, sandbox, policy)

    def _bound_pod(self, claims: Claims) -> tuple[Workload, str]:
        stale = self.stale()
        if stale is not None:
            raise ExchangeRefused(503, "identity_unavailable", stale)
        why = self.index.running(claims.namespace, claims.pod, claims.pod_uid)
        if why is not None:
            raise ExchangeRefused(403, "identity_unknown", f"the token is bound to pod "
                                  f"{claims.namespace}/{claims.pod}, and {why}")
        pod = self.index.get(claims.namespace, claims.pod)
        assert pod is not None
        if pod.service_account != claims.service_account:
            raise ExchangeRefused(403, "identity_unknown", "the token's service account is "
                                  "not its pod's")
        policy = self.index.policies.of(pod.namespace, pod.labels)
        if policy is None:
            raise ExchangeRefused(403, "identity_unknown", f"pod {pod.key} has no "
                                  f"{self.index.policies.label} label and its namespace "
                                  "has no default policy")
        workload = Workload(pod.namespace, pod.name, pod.uid, pod.service_account)
        found = self.policies().get(policy)
        identity = Identity(sandbox=pod.key, policy=policy, jti="", scope={}, issued_at=0.0,
                            expires_at=0.0, lifetime_end=0.0, workload=workload)
        refusal = subject_refusal(identity, found.admits if found is not None else None)
        if refusal is not None:
            raise ExchangeRefused(403, refusal.code, refusal.reason)
        return workload, policy

