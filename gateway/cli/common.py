"""What commands share: the configuration, the policies' credential names, the signing keys."""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Iterator

from gateway.config import Config, load_config
from gateway.core.policy import PolicySet
from gateway.services.identity.claims import TokenError
from gateway.services.identity.signing_keys import SigningKeys


def config_of(args: argparse.Namespace) -> Config:
    """The configuration `--config` names, or the embedded defaults."""
    return load_config(getattr(args, "config", None))


def credentials_of(policies: PolicySet, name: str) -> tuple[str, ...] | None:
    """The credentials policy `name` injects (a token's default scope); None: no such policy."""
    policy = policies.get(name)
    return None if policy is None else policy.credential_names


def signing_keys_of(cfg: Config, *, init: bool = False) -> SigningKeys:
    """The gateway's signing keys, as the config names them. Never creates a key unless
    `init`: a key made in the wrong directory signs tokens the gateway refuses."""
    try:
        return SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids,
                                create=init)
    except TokenError:
        if init or any(cfg.signing_dir.glob("*.pem")):
            raise
    raise TokenError(
        f"no signing key in {cfg.signing_dir} (certs: {cfg.certs}, config: {cfg.source}); "
        "a gateway creates its keys on first start: pass the --config the gateway runs "
        "with (or run where its certs directory is), or --init to create a new key here "
        "(only a gateway using this directory accepts its tokens)")


def audit_lines(paths: list[str]) -> Iterator[bytes]:
    """Every line of every audit file (``-`` = stdin, ``.gz`` decompressed), streamed."""
    for name in paths:
        if name == "-":
            yield from sys.stdin.buffer
            continue
        opener = gzip.open if name.endswith(".gz") else open
        with opener(name, "rb") as handle:
            yield from handle
