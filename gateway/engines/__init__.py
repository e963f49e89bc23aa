"""Engines: each translates one way of carrying traffic into calls to the core and applies
the answers (front door and splice, the HTTP/1 engine, the mitmproxy adapter,
transparent mode). None of them decides anything.

`patches` is imported first: it keeps mitmproxy's addons and layers packages lean before
any engine imports mitmproxy (see `patches.lean_packages`)."""

from gateway.engines import patches as patches
