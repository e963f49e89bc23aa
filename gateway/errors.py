"""`ConfigError`: a configuration key or value is wrong (issue 41, item 1).

A loose top-level module, not in `gateway/config.py`, so that what reads values people
write - the pure core's durations (`gateway/core/durations.py`), the policy readers, the
admin API's query strings - can raise the configuration's error without importing the
configuration (its YAML, its schema library, the network settings it builds).
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key."""
