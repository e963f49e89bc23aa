"""``sandbox-gateway presets update``: refresh the GitHub presets' host block from GitHub's
meta API (``GET https://api.github.com/meta``, whose ``domains.website`` lists the host
patterns GitHub serves its site, downloads and user content from).

The block sits between ``# BEGIN hosts:`` and ``# END hosts`` in ``github-read.yaml`` and
``github-write.yaml``, one GET/HEAD rule per host, its first line dated. The answer is
checked before anything is written: a JSON object whose ``domains.website`` is a non-empty
list of host patterns the policy loader accepts; anything else is refused with the reason.
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.core.policy.hosts import HostPatternError, compile_host_pattern

__all__ = ["META_URL", "PRESETS", "MetaError", "fetch_meta", "rewrite", "update",
           "website_hosts"]

META_URL = "https://api.github.com/meta"
PRESETS = ("github-read.yaml", "github-write.yaml")
_BLOCK = re.compile(r"^  # BEGIN hosts:.*?^  # END hosts\n", re.M | re.S)
_MAX_BYTES = 4 << 20
_MAX_HOSTS = 64


class MetaError(ValueError):
    """The meta API's answer cannot be used (the message says why)."""


def fetch_meta(url: str = META_URL, *, cafile: str | None = None,
               timeout: float = 20.0) -> Any:
    """The parsed JSON of ``url``, an https URL (the environment's proxy settings apply)."""
    if not url.startswith("https://"):
        raise MetaError(f"the meta API URL must be https://, not {url[:60]!r}")
    ctx = ssl.create_default_context(cafile=cafile)
    request = urllib.request.Request(url, headers={  # noqa: S310 - https only, checked
        "Accept": "application/vnd.github+json", "User-Agent": "sandbox-gateway"})
    with urllib.request.urlopen(request, timeout=timeout, context=ctx) as answer:  # noqa: S310
        data = answer.read(_MAX_BYTES + 1)
    if len(data) > _MAX_BYTES:
        raise MetaError(f"{url} answered more than {_MAX_BYTES} bytes")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise MetaError(f"{url} did not answer JSON: {exc}") from None


def website_hosts(meta: Any) -> list[str]:
    """``domains.website`` of a meta answer, each a valid host pattern, in order."""
    domains = meta.get("domains") if isinstance(meta, Mapping) else None
    hosts = domains.get("website") if isinstance(domains, Mapping) else None
    if not isinstance(hosts, list) or not hosts:
        raise MetaError("the meta answer has no domains.website list (the shape of "
                        "GET https://api.github.com/meta)")
    if len(hosts) > _MAX_HOSTS:
        raise MetaError(f"domains.website lists {len(hosts)} hosts, more than {_MAX_HOSTS}")
    out: list[str] = []
    for host in hosts:
        if not isinstance(host, str):
            raise MetaError(f"domains.website holds {host!r}, not a host name")
        try:
            pattern = compile_host_pattern(host).text
        except HostPatternError as exc:
            raise MetaError(f"domains.website holds {host!r}: {exc}") from None
        if pattern not in out:
            out.append(pattern)
    return out


def block(hosts: list[str], date: str) -> str:
    """The preset's host block for ``hosts``, dated ``date`` (YYYY-MM-DD)."""
    lines = [f"  # BEGIN hosts: api.github.com/meta domains.website, as published on {date}",
             "  # (sandbox-gateway presets update rewrites this block; GET and HEAD only)"]
    lines += [f'  - host: "{h}"\n    methods: [GET, HEAD]' for h in hosts]
    return "\n".join([*lines, "  # END hosts"]) + "\n"


def rewrite(text: str, hosts: list[str], date: str) -> str:
    """``text`` (a GitHub preset) with its host block replaced."""
    new, count = _BLOCK.subn(lambda _: block(hosts, date), text, count=1)
    if count != 1:
        raise MetaError("the preset has no '# BEGIN hosts:' ... '# END hosts' block")
    return new


def update(directory: Path, meta: Any, date: str) -> list[Path]:
    """Rewrite the GitHub presets in ``directory`` from ``meta``; the files changed."""
    hosts = website_hosts(meta)
    changed: list[Path] = []
    for name in PRESETS:
        path = directory / name
        before = path.read_text(encoding="utf-8")
        after = rewrite(before, hosts, date)
        if after != before:
            path.write_text(after, encoding="utf-8")
            changed.append(path)
    return changed
