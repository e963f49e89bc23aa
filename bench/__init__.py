"""sandbox-gateway benchmark: ``python -m bench`` (see bench/README.md)."""
