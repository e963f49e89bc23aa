"""The compiled pieces: the passthrough relay's thread (gateway/engines/_relay.c), the
body scans' gate pass (gateway/core/dlp/_gate.c) and the reading of a JSON body's strings
(gateway/core/dlp/_jsontext.c).

Everything else is in pyproject.toml. The extensions are optional: where they cannot be
built (no C compiler), the gateway relays passthrough tunnels on its event loop instead
(gateway/engines/splice_kernel.py), makes the gate's pass with Hyperscan
(gateway/core/dlp/fastscan.py) and reads JSON bodies with `json` (jsondoc.py);
`sandbox-gateway run` says which relay it uses (docs/performance.md). The relay is
Linux-only (epoll, splice, eventfd), the gate x86-64 only (AVX2, checked again when it is
imported); the JSON reading is portable C.
"""

import platform
import sys

from setuptools import Extension, setup

FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
native = [Extension("gateway.engines._relay", ["gateway/engines/_relay.c"], optional=True,
                    extra_compile_args=FLAGS)] if sys.platform.startswith("linux") else []
native.append(Extension("gateway.core.dlp._jsontext", ["gateway/core/dlp/_jsontext.c"],
                        optional=True, extra_compile_args=FLAGS))
if platform.machine().lower() in ("x86_64", "amd64"):
    native.append(Extension("gateway.core.dlp._gate", ["gateway/core/dlp/_gate.c"],
                            optional=True, extra_compile_args=FLAGS))

setup(ext_modules=native)
