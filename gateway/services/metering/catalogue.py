"""The vendored model catalogue, read at its first lookup (``core/metering/catalogue``).

``catalogue.json`` beside this module is LiteLLM's published
``model_prices_and_context_window`` file, trimmed (``make catalogue``,
``scripts/update-catalogue.py``); reading it is I/O, so it is done here and the core's
``Catalogue`` is handed the reader.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from gateway.core.metering.catalogue import Catalogue

__all__ = ["Catalogue", "catalogue"]


def _vendored() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        resources.files(__package__).joinpath("catalogue.json").read_text("utf-8"))
    return doc


@functools.cache
def catalogue() -> Catalogue:
    """The vendored catalogue (read at its first lookup, once per process)."""
    return Catalogue(load=_vendored)
