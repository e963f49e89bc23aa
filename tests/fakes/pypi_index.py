"""A real PyPI index (pypiserver's WSGI app) over TLS, serving a hand-made wheel."""

from __future__ import annotations

import base64
import hashlib
import warnings
import zipfile
from pathlib import Path

with warnings.catch_warnings():  # its bottle imports cgi (deprecated in 3.12, gone in 3.13)
    warnings.filterwarnings("ignore", "'cgi' is deprecated", DeprecationWarning)
    import pypiserver
from helpers.tls import LocalCA

from fakes.tls_http import Recorder, TLSServer, serve_wsgi


def make_wheel(directory: Path, name: str, version: str, value: str) -> Path:
    """A minimal pure-Python wheel whose module `name` has `VALUE = value`."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {value!r}\n".encode(),
        f"{dist}/METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                             "Summary: client matrix test package\n").encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sandbox-gateway-tests\n"
                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def start_pypi(directory: Path, ca: LocalCA, names: list[str]) -> TLSServer:
    """pypiserver serving `directory` (the wheels in it) at https://<name>/simple/."""
    app = pypiserver.app(roots=[str(directory)], authenticate=[], password_file=".")
    ctx = ca.server_context(directory.parent, names)
    return serve_wsgi(app, ctx, Recorder())
