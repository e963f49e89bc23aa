"""The two compiled pieces: the passthrough relay's thread (gateway/engines/_relay.c)
and the body scans' gate pass (gateway/core/dlp/_gate.c).

Everything else is in pyproject.toml. Both extensions are optional: where they cannot be
built (no C compiler), the gateway relays passthrough tunnels on its event loop instead
(gateway/engines/splice_kernel.py) and makes the gate's pass with Hyperscan
(gateway/core/dlp/fastscan.py); `sandbox-gateway run` says which relay it uses
(docs/performance.md). The relay is Linux-only (epoll, splice, eventfd), the gate x86-64
only (AVX2, checked again when it is imported).
"""

import platform
import sys

from setuptools import Extension, setup

FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
native = [Extension("gateway.engines._relay", ["gateway/engines/_relay.c"], optional=True,
                    extra_compile_args=FLAGS)] if sys.platform.startswith("linux") else []
if platform.machine().lower() in ("x86_64", "amd64"):
    native.append(Extension("gateway.core.dlp._gate", ["gateway/core/dlp/_gate.c"],
                            optional=True, extra_compile_args=FLAGS))

setup(ext_modules=native)
