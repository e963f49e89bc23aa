"""The one compiled piece: the passthrough relay's thread (gateway/engines/_relay.c).

Everything else is in pyproject.toml. The extension is Linux-only (epoll, splice,
eventfd) and optional: where it cannot be built (no C compiler), the gateway relays
passthrough tunnels on its event loop instead (gateway/engines/splice_kernel.py), and
`sandbox-gateway run` says which relay it uses (docs/performance.md).
"""

import sys

from setuptools import Extension, setup

native = [Extension("gateway.engines._relay", ["gateway/engines/_relay.c"], optional=True,
                    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                        "-Wno-missing-field-initializers"])]

setup(ext_modules=native if sys.platform.startswith("linux") else [])
