"""Archives a sandbox may upload, made here (a `.tar.gz` and a deflated `.zip` of some
files), for the tests of the gateway's unpacking (`core/archives.py`)."""

from __future__ import annotations

import functools
import gzip
import io
import tarfile
import zipfile
import zlib


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


def spaced_gzip(before: bytes, secret: bytes, after: bytes, empties: int) -> bytes:
    """A gzip file of `before + secret + after` whose deflate stream puts `empties` empty
    stored blocks (a sync flush's 5 bytes each, giving nothing) between the secret's two
    halves: a sender spacing a secret's compressed bytes far apart in the stream."""
    half = len(secret) // 2
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    out = [packer.compress(before + secret[:half]), packer.flush(zlib.Z_SYNC_FLUSH)]
    out.append(b"\x00\x00\x00\xff\xff" * empties)  # (the stream is at a byte's start)
    out += [packer.compress(secret[half:] + after), packer.flush()]
    return b"".join(out)


@functools.cache
def packed_words(kind: str, tail: bytes) -> bytes:
    """A 1.75 MB text of random hex words, then `tail`, compressed as `kind` (gzip, zip,
    bzip2, xz, zstd): about 1 MB, 1.3 MB in base64, every compressor coding `tail`
    (a key) with the text's codes (random bytes would be stored as they are, the key
    readable in them); made once a process."""
    import bz2
    import lzma
    import random

    from backports import zstd

    rng = random.Random(11)
    data = b" ".join(b"%06x" % rng.getrandbits(24) for _ in range(250_000)) + tail
    if kind == "zip":
        return deflated_zip({"a/.env": data})
    return {"gzip": lambda d: gzip.compress(d, mtime=0), "bzip2": bz2.compress,
            "zstd": zstd.compress, "xz": lzma.compress}[kind](data)
