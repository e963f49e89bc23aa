"""What an operator can change about a refusal, by its code (the console's request
detail). The line's own reason says what was refused and by which rule; this says where
to act. Every refusal code has an entry (a table test checks it)."""

from __future__ import annotations

__all__ = ["advice"]

_POLICY = "Add or widen an allow rule in the sandbox's policy (see the explain below), or "
_TOKEN = ("Give the sandbox a fresh token (`sandbox-gateway token mint`, or `sandbox-gateway "
          "env` for its whole environment); a revoked or expired one is never accepted again.")

ADVICE: dict[str, str] = {
    "auth_required": "The client sent no gateway token: set HTTPS_PROXY with the token "
                     "(`sandbox-gateway env`) or register the sandbox's address for "
                     "transparent mode.",
    "sandbox_mismatch": "The token was minted for another sandbox or source network "
                        "(`cidr`): mint one for this sandbox.",
    "unknown_sandbox": "Register the source address (`POST /v1/sandboxes`) or give the "
                       "sandbox a token.",
    "identity_unknown": "identity.kubernetes: check the pod is Running in a watched "
                        "namespace and carries the policy label.",
    "identity_unavailable": "identity.kubernetes: the pod watch is stale; check the "
                            "gateway's access to the Kubernetes API (`/readyz`).",
    "unknown_policy": "The token names a policy the gateway does not have: fix the "
                      "policy files or mint the token for an existing policy.",
    "policy_denied": _POLICY + "accept the refusal: the sandbox was told not to retry.",
    "host_mismatch": "The Host header and the tunnel's host differ: the client must send "
                     "requests for the host it connected to.",
    "forbidden_destination": "The name resolves to an address the gateway never dials "
                             "(private, loopback, metadata); open a range with "
                             "network.allow_cidrs only if it is really meant.",
    "bad_destination": "The target is not a usable host and port: fix the client's URL.",
    "credential_not_in_scope": "The token's scope leaves out this credential: mint a "
                               "token whose scope names it.",
    "credential_required": "The rule injects a GitHub App token and the client sent none: "
                           "configure git's credential helper (`sandbox-gateway env`).",
    "credential_requires_tls": "A credential is only sent over verified TLS: use https://.",
    "exfiltration_blocked": "The request carried a key or a gateway token to a host not "
                            "bound to it: find which step of the agent copied it.",
    "secret_detected": "The request carried a credential the gateway did not issue (the "
                       "line names the detector and where): find which step of the agent "
                       "copied it, or allow that detector to this host in the rule's "
                       "`dlp.allow`.",
    "model_not_allowed": "Add the model to the rule's `models:` or have the agent use an "
                         "allowed one.",
    "mcp_denied": "Allow the tool, resource or prompt in the rule's `mcp:` (or leave it "
                  "refused).",
    "mcp_tool_changed": "The MCP server changed the tool's description or input schema "
                        "since it was pinned: compare the texts in the Approvals page and "
                        "approve the change (or leave it quarantined).",
    "mcp_token_refused": "The gateway attaches this MCP server's OAuth token itself "
                         "(`mcp.oauth`): configure the agent's MCP client without a token.",
    "mcp_user_required": "The rule keeps one MCP OAuth grant per person (consent: user): "
                         "mint the sandbox's token with --user NAME.",
    "mcp_consent_required": "The MCP server refused the gateway's token or asks for more "
                            "scopes: consent again from the Approvals page (its link), "
                            "then retry.",
    "mcp_oauth_failed": "The gateway could not obtain the MCP server's token (the reason "
                        "says which step): check the server's OAuth metadata, or configure "
                        "a client in `mcp_oauth.clients`.",
    "approval_denied": "A person declined it; ask them, or change the policy if it should "
                       "be allowed.",
    "approval_timeout": "No one answered in time: answer in the Approvals page, or "
                        "lengthen the ask's `timeout`.",
    "metering_unavailable": "The call could not be metered on a rule that must be: give "
                            "the model a price, or let the client send usage (see "
                            "docs/metering.md).",
    "minted_secret_refused": "Set `allow_minted_secrets: true` on the rule if sandboxes "
                             "may use provider-minted secrets (they get an alias the "
                             "gateway swaps back). With it set: the provider's answer named "
                             "no secret the gateway could replace.",
    "budget_exceeded": "Raise the budget in the policy, or wait for its window to reset "
                       "(the Usage page shows when).",
    "too_many_connections": "Raise limits.connections_per_sandbox, or find why the "
                            "sandbox holds so many connections open.",
    "bad_request": "The client sent a malformed request; nothing to change in the policy.",
    "unsupported": "The gateway cannot carry this request (see docs/errors.md).",
    "upstream_failed": "The upstream is down or its certificate is not trusted; check it "
                       "from the gateway's host.",
    "upstream_proxy_failed": "Check network.upstream_proxy: reachable, credentials, and "
                             "its own access rules.",
    "unresolvable": "The name does not resolve from the gateway: check DNS or "
                    "network.resolve.",
    "upstream_timeout": "The upstream sent nothing for network.timeouts.read.",
    "secret_unavailable": "The secret store did not answer: check `/readyz` and "
                          "`sandbox-gateway secrets check`.",
    "credential_unavailable": "The credential could not be minted: the reason names the "
                              "token endpoint's answer.",
    "shutting_down": "The gateway was stopping; the client can retry on another replica.",
    "at_capacity": "The gateway is at its connection cap: add workers or replicas.",
    "audit_unavailable": "The gateway cannot write audit lines: see `/readyz` and free "
                         "the disk or the log pipe.",
    "state_unavailable": "The gateway's state store is away and `state.unavailable: "
                         "refuse` is set: see `/readyz`, free the state file's disk or "
                         "bring Redis back.",
    "gateway_error": "A check failed inside the gateway and refused (fail closed): see the "
                     "gateway's log at this time.",
}


def advice(code: str | None) -> str | None:
    """What to change about a refusal with `code` (None: not a refusal)."""
    if not code:
        return None
    if code.startswith("token_"):
        return _TOKEN
    return ADVICE.get(code, "See docs/errors.md for this code.")
