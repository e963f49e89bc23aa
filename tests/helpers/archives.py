"""Archives a sandbox may upload, made here (a `.tar.gz` and a deflated `.zip` of some
files), for the tests of the gateway's unpacking (`core/archives.py`)."""

from __future__ import annotations

import gzip
import io
import tarfile
import zipfile


def tar_gz(files: dict[str, bytes]) -> bytes:
    """A `.tar.gz` of `files` (gzip with mtime 0: the same bytes in every process)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def deflated_zip(files: dict[str, bytes]) -> bytes:
    """A `.zip` of `files`, each deflated."""
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return raw.getvalue()
