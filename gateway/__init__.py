"""sandbox-gateway: a secrets-and-egress gateway for AI agent sandboxes."""

__version__ = "0.1.0"
