"""Policy files: read, validate, compile, reload, test and compare them.

The model they compile to, and the decision, are the core's (``gateway.core.policy``).
Here: ``loader`` and its readers (YAML, files), ``reloader`` (watching a directory),
``revision`` (git), and ``testing``, ``diff``, ``replay``, ``report`` for ``policy test``
and ``policy diff``. The loader and reloader are imported on first use of their names::

    policy_set = load_policy_dir("policies")
"""

from typing import TYPE_CHECKING

from gateway.lazy import lazy_names

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
    "PolicyError",
    "PolicyReloader",
    "fingerprint",
    "load_policy_dir",
    "load_policy_text",
    "load_policy_texts",
    "policy_files",
]
