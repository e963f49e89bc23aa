"""The policy engine: load policy files, compile them to indexed matchers, decide requests.

Pure except ``loader``, ``reloader`` and ``revision`` (files, YAML, git): those are
imported on first use of one of their names, so the enforcement core, which needs only
the model and the matcher, does not pull them in. ``testing``, ``diff``, ``replay`` and
``report`` serve ``policy test`` and ``policy diff``. Typical use::

    policy_set = load_policy_dir("policies")
    decision = decide(policy_set.policies["coding-agent"], Request("GET", "https", host, 443, "/"))
"""

from typing import TYPE_CHECKING

from gateway.lazy import lazy_names
from gateway.services.policy.compiled import Policy, PolicySet, compile_policy, decide
from gateway.services.policy.hosts import (
    HostPattern,
    HostPatternError,
    compile_host_pattern,
    host_matches,
    is_public_suffix,
    normalize_host,
)
from gateway.services.policy.injection import Injection
from gateway.services.policy.matcher import Matcher
from gateway.services.policy.model import Credential, Decision, Request, Rule
from gateway.services.policy.paths import PathPatternError, PathSet, compile_paths, normalize_path
from gateway.services.policy.presets import PRESETS, Preset

if TYPE_CHECKING:
    from gateway.services.policy.loader import (
        PolicyError,
        load_policy_dir,
        load_policy_text,
        load_policy_texts,
        policy_files,
    )
    from gateway.services.policy.reloader import PolicyReloader, fingerprint

__getattr__ = lazy_names(__name__, {
    "PolicyError": "loader", "load_policy_dir": "loader", "load_policy_text": "loader",
    "load_policy_texts": "loader", "policy_files": "loader",
    "PolicyReloader": "reloader", "fingerprint": "reloader"}, globals())

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
    "PolicyError",
    "PolicyReloader",
    "PolicySet",
    "Preset",
    "Request",
    "Rule",
    "compile_host_pattern",
    "compile_paths",
    "compile_policy",
    "decide",
    "fingerprint",
    "host_matches",
    "is_public_suffix",
    "load_policy_dir",
    "load_policy_text",
    "load_policy_texts",
    "normalize_host",
    "normalize_path",
    "policy_files",
]
