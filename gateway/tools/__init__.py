"""Operator tools beside the proxy: explain a request, check a config, print a sandbox's
environment."""
