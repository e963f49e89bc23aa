"""The operator's pricing file (``metering.pricing``), read into the core's ``Pricing``."""

from __future__ import annotations

from pathlib import Path

from gateway.core.metering.catalogue import Catalogue
from gateway.core.metering.pricing import Pricing, PricingError, parse_pricing

__all__ = ["Pricing", "PricingError", "load_pricing"]


def load_pricing(path: Path, fallback: Catalogue | None = None) -> Pricing:
    """Read and validate the pricing file at ``path``; raises PricingError."""
    import yaml  # (only here: the metering step itself reads no files)

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PricingError(f"{path}: cannot read: {exc.strerror}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PricingError(f"{path}: not valid YAML: {exc}") from None
    return parse_pricing(data, str(path), fallback)
