"""Suite-wide setup. Warnings are errors (pyproject.toml); third-party modules that warn
at import time (mitmproxy's ldap3/pyasn1/pyparsing chain) are imported once here with
their import-time warnings silenced, so the warnings that remain are ours to fix."""

import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import mitmproxy.addons
    import mitmproxy.flowfilter  # noqa: F401
