"""The policy model and its decision: rules, host and path patterns, the compiled index.

Pure: what a policy file says once it is read (``model``, ``ask_rule``, ``mcp_rule``,
``injection``, ``presets``), how names and paths are normalised and matched (``hosts``,
``paths``, ``globs``, ``methods``, ``mcp_values``), and the index that decides a request
(``matcher``, ``compiled``). Reading the files is ``services/policy`` (the loader and its
readers, the reloader, git revisions)::

    decision = decide(policy_set.policies["coding-agent"], Request("GET", "https", host, 443, "/"))
"""

from gateway.core.policy.compiled import Policy, PolicySet, compile_policy, decide
from gateway.core.policy.hosts import (
    HostPattern,
    HostPatternError,
    compile_host_pattern,
    host_matches,
    is_public_suffix,
    normalize_host,
)
from gateway.core.policy.injection import Injection
from gateway.core.policy.matcher import Matcher
from gateway.core.policy.model import Credential, Decision, Request, Rule
from gateway.core.policy.paths import PathPatternError, PathSet, compile_paths, normalize_path
from gateway.core.policy.presets import PRESETS, Preset

__all__ = [
    "PRESETS",
    "Credential",
    "Decision",
    "HostPattern",
    "HostPatternError",
    "Injection",
    "Matcher",
    "PathPatternError",
    "PathSet",
    "Policy",
    "PolicySet",
    "Preset",
    "Request",
    "Rule",
    "compile_host_pattern",
    "compile_paths",
    "compile_policy",
    "decide",
    "host_matches",
    "is_public_suffix",
    "normalize_host",
    "normalize_path",
]
