"""The detectors of `gateway/core/dlp/catalogue.py`, built from detect-secrets plugins.

Each regular-expression plugin's own `denylist` patterns are used as they ship (its
public plugin API: `secret_type`, `denylist`, `analyze_string`); what this module adds
is, per pattern, the literal anchors every match holds (the prefilter's keys) and how far
a match may reach from them. A plugin whose `analyze_string` does more than its patterns
(JWT: the parts must decode) confirms each match through `analyze_string`. Plugins that
are not pattern lists (keyword, high entropy) run their `analyze_string` over the whole
text. detect-secrets' verification (network calls to the provider) is never used.

`IPPublicDetector` is not offered: a public IP address is not a credential.

Importing this module imports detect-secrets (and `requests`, which its plugins import):
about 0.2 s and 19 MiB the first time; build the detectors once, at start.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from detect_secrets.filters.heuristic import (
    is_not_alphanumeric_string,
    is_prefixed_with_dollar_sign,
    is_sequential_string,
    is_templated_secret,
)
from detect_secrets.plugins.artifactory import ArtifactoryDetector
from detect_secrets.plugins.aws import AWSKeyDetector
from detect_secrets.plugins.azure_storage_key import AzureStorageKeyDetector
from detect_secrets.plugins.base import BasePlugin, RegexBasedDetector
from detect_secrets.plugins.basic_auth import BasicAuthDetector
from detect_secrets.plugins.cloudant import CloudantDetector
from detect_secrets.plugins.discord import DiscordBotTokenDetector
from detect_secrets.plugins.github_token import GitHubTokenDetector
from detect_secrets.plugins.gitlab_token import GitLabTokenDetector
from detect_secrets.plugins.high_entropy_strings import (
    Base64HighEntropyString,
    HexHighEntropyString,
    HighEntropyStringsPlugin,
)
from detect_secrets.plugins.ibm_cloud_iam import IbmCloudIamDetector
from detect_secrets.plugins.ibm_cos_hmac import IbmCosHmacDetector
from detect_secrets.plugins.jwt import JwtTokenDetector
from detect_secrets.plugins.keyword import QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP, KeywordDetector
from detect_secrets.plugins.mailchimp import MailchimpDetector
from detect_secrets.plugins.npm import NpmDetector
from detect_secrets.plugins.openai import OpenAIDetector
from detect_secrets.plugins.private_key import PrivateKeyDetector
from detect_secrets.plugins.pypi_token import PypiTokenDetector
from detect_secrets.plugins.sendgrid import SendGridDetector
from detect_secrets.plugins.slack import SlackDetector
from detect_secrets.plugins.softlayer import SoftlayerDetector
from detect_secrets.plugins.square_oauth import SquareOAuthDetector
from detect_secrets.plugins.stripe import StripeDetector
from detect_secrets.plugins.telegram_token import TelegramBotTokenDetector
from detect_secrets.plugins.twilio import TwilioKeyDetector

from gateway.core.dlp.catalogue import DEFAULT, DETECTORS
from gateway.core.dlp.detector import Detector, Rule, bounded, deadline, left
from gateway.services.dlp.plugins import (
    AnthropicDetector,
    GcpApiKeyDetector,
    GcpServiceAccountDetector,
    GitHubFineGrainedDetector,
    HuggingFaceDetector,
    OpenAIProjectKeyDetector,
)

__all__ = ["PLUGINS", "build", "default_detectors"]


@dataclass(frozen=True)
class Anchor:
    """One pattern's anchors and reach (see `core/dlp/detector.Rule`)."""

    anchors: tuple[str, ...]
    after: int
    before: int = 0
    tail: str | None = None
    strip: str = ""
    stop: str = ""
    context: bool = False  # reads a name beside the value (see core/dlp/detector.Rule)
    check: Callable[[str], bool] | None = None  # a further check of the value
    # Every value the rule reports holds 20 base64 characters in a row (Rule.run): every
    # match does, or (a case-insensitive pattern) the value does once it is ASCII, which
    # the plausibility check every pattern's values pass (`_plausible`) requires.
    run: bool = False
    skip: str | None = None  # (see core/dlp/detector.Rule.skip)


def cases(word: str) -> tuple[str, ...]:
    """Every upper/lower case variant of a short word (a case-insensitive anchor)."""
    return tuple("".join(p) for p in itertools.product(*((c.lower(), c.upper())
                                                          if c.isalpha() else (c,)
                                                          for c in word)))


def _a(*anchors: str, after: int, before: int = 0, tail: str | None = None,
       strip: str = "", stop: str = "", context: bool = False,
       check: Callable[[str], bool] | None = None, run: bool = False,
       skip: str | None = None) -> Anchor:
    return Anchor(anchors, after, before, tail, strip, stop, context, check, run, skip)


_DELIMITERS = " \t\r\n\"=:"  # what ArtifactoryDetector's patterns match around a token
_LINE_END = " \t\r\n\"'`,;<>"  # NpmDetector's value runs to the end of the line


# A private key's value runs to its END line (or, cut short, over the base64 that follows
# its header), and it must hold key material: the header alone is code that reads keys
# (`line.startswith("-----BEGIN RSA PRIVATE KEY-----")`), not a key.
# What a failed attempt of detect-secrets' JWT pattern (`eyJ[A-Za-z0-9-_=]+\.…`) read:
# `eyJ` and the run of its class (the same class, `9-_` a range in it), which must end
# in a `.`; no later `eyJ` inside that run can match (tests/services/dlp: the pattern is
# checked to begin so, and the rule's spans held to `finditer`'s).
_JWT_RUN = r"eyJ[A-Za-z0-9-_=]*"
_PEM_END = (r"(?:[\s\S]{0,16384}?(?:END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-*"
            r"|Private-MAC: *[0-9a-fA-F]+)|-*(?:\s|\\[nr]|[A-Za-z0-9+/=:,-])*)")
_PEM_HEAD = re.compile(r"^(?:BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-*|PuTTY-User-Key-File-2:.*)")
_PEM_FOOT = re.compile(r"-*END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-*$")
_PEM_FIELD = re.compile(r"^[A-Za-z-]+: .*$", re.MULTILINE)  # Proc-Type:, Comment:, ...
_BASE64 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def _key_material(value: str) -> bool:
    """Whether a private key's value holds a body: at least 64 characters between its
    header and its END line, nine in ten of them base64 (JSON `\\n` escapes and the
    PEM header fields set aside)."""
    body = value.replace("\\n", "\n").replace("\\r", "\n")
    body = _PEM_FIELD.sub("", _PEM_FOOT.sub("", _PEM_HEAD.sub("", body)))
    body = "".join(body.split())
    return len(body) >= 64 and sum(c in _BASE64 for c in body) >= 0.9 * len(body)


_SLACK_TOKEN = cases("xox")
_LOWER_DIGITS = "abcdefghijklmnopqrstuvwxyz0123456789"


def _then(prefix: str, chars: str) -> tuple[str, ...]:
    """`prefix` and each of `chars` after it: anchors of a pattern `prefix[chars]...`."""
    return tuple(prefix + c for c in chars)

# name -> (plugin class, anchors per denylist pattern in order; None: no anchor)
PLUGINS: dict[str, list[tuple[type[BasePlugin], list[Anchor | None]]]] = {
    "aws": [(AWSKeyDetector, [_a("A3T", "ABIA", "ACCA", "AKIA", "ASIA", after=20, run=True),
                              _a(*cases("aws"), after=120, context=True, run=True)])],
    "azure-storage": [(AzureStorageKeyDetector, [_a("AccountKey=", after=90)])],
    "basic-auth": [(BasicAuthDetector, [_a("://", after=512)])],
    "github": [(GitHubTokenDetector, [_a("ghp_", "gho_", "ghu_", "ghs_", "ghr_", after=40,
                                                          run=True)]),
               (GitHubFineGrainedDetector, [_a("github_pat_", after=90, run=True)])],
    "gitlab": [(GitLabTokenDetector, [
        _a("glpat-", "gldt-", "glft-", "glsoat-", "glrt-", after=60, run=True),
        _a("GR1348941", after=60, run=True), _a("glcbt-", after=60, run=True),
        _a("glimt-", after=30, run=True), _a("glptt-", after=45, run=True),
        _a("glagent-", after=1030, run=True), _a("gloas-", after=70, run=True)])],
    # the webhook's pattern ignores case and begins `https://`: anchored on the `://`
    # (basic-auth's anchor, in the gate already), a host or path in any mix of cases is
    # found (`Hooks.Slack.com/Services/…` is the same secret)
    "slack": [(SlackDetector, [_a(*_SLACK_TOKEN, after=300),
                               _a("://", before=8, after=200, run=True)])],
    "stripe": [(StripeDetector, [_a("sk_live_", "rk_live_", after=30, run=True)])],
    # (the pattern's third character is in the anchor: a two-letter `AC` is in every
    # other capitalised word of code, ACCESS, BACKSLASH, TASK, and each hit costs a window)
    "twilio": [(TwilioKeyDetector, [_a(*_then("AC", _LOWER_DIGITS), after=34, run=True),
                                 _a(*_then("SK", _LOWER_DIGITS), after=34, run=True)])],
    "private-key": [(PrivateKeyDetector, [
        _a(p, after=16500, tail=_PEM_END, check=_key_material) for p in (
            "BEGIN DSA PRIVATE KEY", "BEGIN EC PRIVATE KEY", "BEGIN OPENSSH PRIVATE KEY",
            "BEGIN PGP PRIVATE KEY BLOCK", "BEGIN PRIVATE KEY", "BEGIN RSA PRIVATE KEY",
            "BEGIN SSH2 ENCRYPTED PRIVATE KEY", "PuTTY-User-Key-File-2")])],
    # (tried at each `eyJ`, a run of the pattern's own class once: `Rule.skip`)
    "jwt": [(JwtTokenDetector, [_a("eyJ", after=8192, tail=r"[A-Za-z0-9_\-]*",
                                   skip=_JWT_RUN)])],
    "openai": [(OpenAIDetector, [_a("T3BlbkFJ", before=260, after=25, run=True)]),
               (OpenAIProjectKeyDetector, [_a("sk-proj-", "sk-svcacct-", "sk-admin-",
                                              after=260, run=True)])],
    "anthropic": [(AnthropicDetector, [_a("sk-ant-", after=220, run=True)])],
    "huggingface": [(HuggingFaceDetector, [_a("hf_", before=1, after=40, run=True)])],
    # (no quotes in the anchor: inside a JSON string they are escaped, \")
    "gcp-service-account": [(GcpServiceAccountDetector, [_a("private_key_id", before=1,
                                                             after=70, context=True, run=True)])],
    "gcp-api-key": [(GcpApiKeyDetector, [_a("AIza", after=40, run=True)])],
    "npm": [(NpmDetector, [_a("_authToken=", before=512, after=512, stop=_LINE_END)])],
    "pypi": [(PypiTokenDetector, [_a("pypi-AgEIcHlwaS5vcmc", after=2048, run=True),
                                  _a("pypi-AgENdGVzdC5weXBpLm9yZw", after=2048,
                                     run=True)])],
    "sendgrid": [(SendGridDetector, [_a("SG.", after=70, run=True)])],
    "mailchimp": [(MailchimpDetector, [_a("-us", before=33, after=3, run=True)])],
    "square": [(SquareOAuthDetector, [_a("sq0csp-", after=50)])],
    "artifactory": [(ArtifactoryDetector, [
        _a("AKC", before=1, after=300, strip=_DELIMITERS),
        _a(*(f"AP{c}" for c in "0123456789ABCDEF"), before=1, after=300, strip=_DELIMITERS)])],
    "discord": [(DiscordBotTokenDetector, [None])],
    "telegram": [(TelegramBotTokenDetector, [None])],
    "cloudant": [(CloudantDetector, [None, None, None, None])],
    "ibm-cloud-iam": [(IbmCloudIamDetector, [None])],
    "ibm-cos-hmac": [(IbmCosHmacDetector, [None])],
    "softlayer": [(SoftlayerDetector, [None, None])],
    "keyword": [(KeywordDetector, [])],
    "high-entropy": [(Base64HighEntropyString, []), (HexHighEntropyString, [])],
}


# Values in documentation and examples, not secrets: a URL's password written as a word
# that says what goes there ("https://user:password@host").
_PLACEHOLDERS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "changeme",
                           "example", "xxx", "xxxx", "xxxxxx", "***", "****", "******"})


_TEXT = re.compile(r"[\x20-\x7e\r\n\t]*")


def _plausible(value: str) -> bool:
    """detect-secrets' own heuristic filters (its default scan applies them to every
    plugin's values): `<token>`, `{x}`, `${X}`, `$VAR`, `abcdef...`, no letter or digit;
    a placeholder word; and anything but printable ASCII (a credential is text: a match
    across binary bytes, as in a .pyc file, is not one)."""
    if not value.isascii() or not (value.isprintable() or _TEXT.fullmatch(value)):
        return False
    return not (is_templated_secret(value) or is_prefixed_with_dollar_sign(value)
                or is_sequential_string(value) or is_not_alphanumeric_string(value)
                or value.lower() in _PLACEHOLDERS)


# detect-secrets' `name = value` separator (IBM's plugins: cloudant, ibm-cloud-iam,
# ibm-cos-hmac, softlayer): three pieces in a row that each read spaces, so a name and a
# run of n spaces with no value behind cost n³ steps of Python's backtracking engine
# ("clpw" and 2,048 spaces: 50 s, the GIL held, every sandbox of the worker stalled).
# The same language without the ambiguity: spaces, a sign, spaces; or spaces alone (the
# ` +` between two ` *`). A value's characters are never a space or a sign, so every
# match is the one the original finds (tests/services/dlp/test_dlp_library.py holds the
# two to the same matches, and every pattern built here to regexploit's analysis).
_SEPARATOR = r"(?: *)(?:=|:|:=|=>| +|::)(?: *)"
_LINEAR_SEPARATOR = r"(?: *(?:=|:|:=|=>|::) *| +)"


def linear(pattern: re.Pattern[str]) -> re.Pattern[str]:
    """`pattern` with the super-linear constructs known in detect-secrets' patterns
    written as their linear equivalents (`_SEPARATOR`); others as they are."""
    if _SEPARATOR not in pattern.pattern:
        return pattern
    return re.compile(pattern.pattern.replace(_SEPARATOR, _LINEAR_SEPARATOR), pattern.flags)


def _rules(plugin_class: type[BasePlugin], anchors: list[Anchor | None]) -> Iterator[Rule]:
    plugin = plugin_class()
    if not isinstance(plugin, RegexBasedDetector):
        yield Rule(None, values=_values(plugin), confirm=_plausible)
        return
    patterns = [linear(p) for p in plugin.denylist]
    if len(patterns) != len(anchors):
        raise RuntimeError(f"{plugin_class.__name__} has {len(patterns)} patterns, the "
                           f"anchor table {len(anchors)}: update gateway/services/dlp/library.py")
    # A plugin that filters its pattern's matches (JWT) confirms each through its own API.
    own = type(plugin).analyze_string is not RegexBasedDetector.analyze_string
    for pattern, anchor in zip(patterns, anchors, strict=True):
        confirm: Callable[[str], bool] = _plausible
        if own:  # the plugin's own check too (`plugin` bound now, not at call time)
            confirm = _both(_plausible, functools.partial(_agrees, plugin))
        if anchor is None:
            yield Rule(pattern, confirm=confirm, after=0)
        else:
            if anchor.check is not None:
                confirm = _both(confirm, anchor.check)
            yield Rule(pattern, anchor.anchors, anchor.before, anchor.after, confirm,
                       re.compile(anchor.tail) if anchor.tail else None,
                       strip=anchor.strip, stop=anchor.stop, context=anchor.context,
                       run=anchor.run, skip=re.compile(anchor.skip) if anchor.skip else None)


def _agrees(plugin: BasePlugin, text: str) -> bool:
    """The plugin's `analyze_string` finds a secret in the value (its own check)."""
    return any(True for _ in plugin.analyze_string(text))


@dataclass(frozen=True)
class Both:
    """Two checks of a value, `first` then `then` (a class, not a closure: the test of
    `Rule.run` reads that a rule's values pass `_plausible` first)."""

    first: Callable[[str], bool]
    then: Callable[[str], bool]

    def __call__(self, text: str) -> bool:
        return self.first(text) and self.then(text)


def _both(first: Callable[[str], bool], then: Callable[[str], bool]) -> Callable[[str], bool]:
    return Both(first, then)


def _values(plugin: BasePlugin) -> Callable[[str], Iterator[str]]:
    """`analyze_string` of a plugin that is not a pattern list, its expressions run by
    `regex` with the scan's deadline (`detector.Budget`: detect-secrets' own loop runs
    them on `re`, unbounded, and its keyword expressions are cubic on some texts:
    `APWDO` 2,000 times cost 16 s); high-entropy plugins' values filtered by their own
    entropy limit, as detect-secrets does per line. The same values as the plugin's
    (tests/services/dlp/test_dlp_library.py)."""
    if isinstance(plugin, HighEntropyStringsPlugin):
        quoted = bounded(plugin.regex)  # (`findall`'s second group: the quoted value)

        def entropic(text: str) -> Iterator[str]:
            until = deadline(len(text))
            for match in quoted.finditer(text, timeout=left(until)):
                value = match.group(2)
                if plugin.calculate_shannon_entropy(value) > plugin.entropy_limit:
                    yield value
        return entropic
    if isinstance(plugin, KeywordDetector) and plugin.keyword_exclude is None:
        # (its `analyze_string` with no file type: each expression's first match)
        attempts = [(bounded(regex_), group)
                    for regex_, group in QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP.items()]

        def keyword(text: str) -> Iterator[str]:
            until = deadline(len(text))
            for expression, group in attempts:
                match = expression.search(text, timeout=left(until))
                if match:
                    yield match.group(group)
        return keyword
    raise TypeError(f"{type(plugin).__name__}: no bounded reading of its values")


def build(names: Iterable[str] = DEFAULT) -> tuple[Detector, ...]:
    """The named detectors (default: those on unless a policy names others)."""
    out = []
    for name in names:
        if name not in DETECTORS:
            raise KeyError(f"unknown detector {name!r}")
        rules = [r for cls, anchors in PLUGINS[name] for r in _rules(cls, anchors)]
        out.append(Detector(name, tuple(rules)))
    return tuple(out)


def default_detectors() -> tuple[Detector, ...]:
    return build(DEFAULT)
