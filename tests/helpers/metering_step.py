"""The metering step's unit tests' policy and call (tests/services/metering/): one policy
with a model allowlist, a token budget, `metering: required` rules and a custom
credential, and `admit`, which sends a request on the rule of a host through the step."""

from __future__ import annotations

import json
from typing import Any

from gateway.core.policy import PolicySet
from gateway.services.metering import Metering

NOW = 1_795_000_000.0
AZURE = "budgeted.openai.azure.com"
POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    models: ["gpt-4o-mini*"]
  - host: budgeted.openai.azure.com
    credential: azure
  - host: api.anthropic.com
    credential: anthropic
    metering: {required: true, reserve: 100}
  - host: api.groq.com
    credential: groq
  - host: llm.internal.test
    credential: custom
    metering: required
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 10000, credentials: [azure]}
credentials:
  openai: {preset: openai, secret: k1}
  azure: {preset: azure-openai, secret: k2, hosts: [budgeted.openai.azure.com]}
  anthropic: {preset: anthropic, secret: k3}
  groq: {preset: groq, secret: k4}
  custom: {hosts: [llm.internal.test], secret: k5, inject: {bearer: true}}
"""

# issue 39: a budget is a ceiling (what cannot be modelled is denied by default)
UNMETERED_POLICY = """\
version: v1
name: agent
egress:
  - host: api.openai.com
    credential: openai
    unmetered: ["/v1/assistants/**", "/v1/images/generations"]
    metering: {max_input_tokens: 5000}
budgets:
  - {name: daily, per: sandbox, window: 24h, tokens: 200000}
credentials:
  openai: {preset: openai, secret: k1}
"""


def admit(metering: Metering, policies: PolicySet, host: str, method: str, path: str,
          body: Any = None, sandbox: str = "sb") -> Any:
    policy = policies.policies["agent"]
    rule = next(r for r in policy.rules if r.host == host)
    assert rule.credential is not None
    preset = policies.credentials[rule.credential].preset
    raw = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    return metering.admit(sandbox=sandbox, policy=policy, rule=rule, preset=preset,
                          method=method, path=path, body=raw, now=NOW)
