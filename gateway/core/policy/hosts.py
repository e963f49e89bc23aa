"""Host normalisation and host patterns: validate once at load, match many times.

Hosts are compared in one canonical form: lowercase, IDN labels as punycode
(``xn--``), no trailing dot, IP literals as ``ipaddress.ip_address(x).compressed``.

Host pattern rule (what a policy ``host:`` may say):

* ``example.com`` -- exactly that host. At least two labels (``not-a-domain`` is
  refused: a single label is a typo or a search-domain name). An IP literal
  (``10.1.2.3``, ``2001:db8::1``, ``[2001:db8::1]``) is also an exact host.
* The wildcard may only sit at the **left**:

  - a leading whole label ``*.`` = one or more labels (``*.example.com`` matches
    ``a.example.com`` and ``a.b.example.com``, not ``example.com``);
  - a leading whole label ``**.`` = zero or more labels (also ``example.com``);
  - or one ``*`` inside the leftmost label, at its end (``region*.v2.example.com``)
    or at its start followed by ``-`` (``*-aiplatform.googleapis.com``); it matches
    characters within that one label. A leading ``*`` followed by a letter or digit
    (``*bob.example.com``) is refused as a probable missing dot.

* One exception, for bucket-style names: in a pattern that already starts with
  ``*.``, a later label may be a whole ``*`` matching exactly one label, if a
  literal label stands on each side of it (``*.s3.*.amazonaws.com``). So
  ``api.*.example.com`` (no leading ``*.``), ``*.*.stripe.com`` (no literal label
  between) and ``foo.**.example.com`` stay refused.
* The literal labels right of the last wildcard must form more than a public
  suffix (ICANN section of the Public Suffix List): ``*.com``, ``**.co.uk``,
  ``*example.com``, ``example.*`` are refused. The private section is ignored on
  purpose, so ``*.githubusercontent.com`` is accepted.

Matching is a dict/suffix lookup plus, for the rare glob forms, one precompiled
regex; nothing here does I/O except reading the vendored PSL data file once.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.names import DestinationError, normalize_host

__all__ = [
    "HostPattern",
    "HostPatternError",
    "compile_host_pattern",
    "host_matches",
    "is_public_suffix",
    "normalize_host",
]

PatternKind = Literal["exact", "ip", "subdomains", "self_and_subdomains", "glob"]

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_LABEL_CHARS = re.compile(r"[a-z0-9_-]+")
_SPACE = re.compile(r"\s")


class HostPatternError(DestinationError):
    """A host or host pattern that cannot be used; the message says what to write."""


@dataclass(frozen=True, slots=True)
class HostPattern:
    """A compiled host pattern.

    ``suffix`` is the literal part right of the last wildcard (the whole host for
    exact patterns); the matcher indexes patterns by it. ``rank`` orders patterns
    sharing a suffix from most to least specific.
    """

    text: str
    kind: PatternKind
    suffix: str
    regex: re.Pattern[str] | None = field(default=None, compare=False, repr=False)
    _dot_suffix: str = field(default="", compare=False, repr=False)

    @property
    def is_wildcard(self) -> bool:
        """True for every pattern that is not one exact host or IP."""
        return self.kind not in ("exact", "ip")

    @property
    def rank(self) -> int:
        """Specificity within one suffix: exact 0, glob 1, ``*.`` 2, ``**.`` 3."""
        return _RANKS[self.kind]

    def matches(self, host: str) -> bool:
        """Match an already normalised host (see ``normalize_host``)."""
        kind = self.kind
        if kind == "subdomains":
            return host.endswith(self._dot_suffix)
        if kind == "self_and_subdomains":
            return host == self.suffix or host.endswith(self._dot_suffix)
        if kind == "glob":
            assert self.regex is not None
            return self.regex.fullmatch(host) is not None
        return host == self.text


_RANKS: dict[str, int] = {
    "exact": 0,
    "ip": 0,
    "glob": 1,
    "subdomains": 2,
    "self_and_subdomains": 3,
}


def _ip_literal(text: str) -> str | None:
    """Canonical form of an IP literal (brackets optional), or None if not one."""
    candidate = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if ":" not in candidate and not candidate.replace(".", "").isdigit():
        return None
    try:
        return ipaddress.ip_address(candidate).compressed
    except ValueError:
        return None


def _to_ascii_label(label: str) -> str:
    """Punycode one non-ASCII label, raising HostPatternError.

    IDNA 2008 with UTS #46 mapping first; names it refuses but browsers and Go's
    resolver still send (emoji, IDNA 2003 symbols) fall back to IDNA 2003, so the
    same name always compares equal to its ``xn--`` form. (idna: imported at the first
    non-ASCII label.)
    """
    import idna

    try:
        return idna.encode(label, uts46=True).decode("ascii")
    except idna.IDNAError as exc:
        try:
            return label.encode("idna").decode("ascii").lower()
        except UnicodeError:
            raise HostPatternError(f"invalid internationalised label {label!r}: {exc}") from None


@functools.cache
def _icann_psl() -> object:
    """The ICANN section of the PSL vendored with publicsuffix2 (read once, offline)."""
    import publicsuffix2

    lines: list[str] = []
    inside = False
    with open(publicsuffix2.PSL_FILE, encoding="utf-8") as fp:
        for line in fp:
            if "===BEGIN ICANN DOMAINS===" in line:
                inside = True
            elif "===END ICANN DOMAINS===" in line:
                break
            elif inside:
                lines.append(line)
    return publicsuffix2.PublicSuffixList(lines)


def is_public_suffix(domain: str) -> bool:
    """True if ``domain`` (normalised) is an ICANN public suffix such as ``com`` or ``co.uk``.

    Unknown top-level labels count as public suffixes (the PSL's implicit ``*`` rule).
    """
    if not domain:
        return True
    psl = _icann_psl()
    return bool(psl.get_tld(domain) == domain)  # type: ignore[attr-defined]


def _hint(text: str) -> str:
    return f"host pattern {text!r}"


def _check_literal_labels(text: str, labels: list[str]) -> None:
    for label in labels:
        if not label:
            raise HostPatternError(f"{_hint(text)} has an empty label; remove the extra dot")
        if not _LABEL.fullmatch(label):
            raise HostPatternError(
                f"{_hint(text)} has an invalid label {label!r}; "
                "use letters, digits, '-' and '_' only (at most 63 per label)"
            )


def _reject_obvious(text: str) -> None:
    """Refuse URLs, ports, paths and blanks with a message saying what to write instead."""
    if "://" in text:
        rest = text.split("://", 1)[1].split("/", 1)[0]
        raise HostPatternError(
            f"{_hint(text)} contains a URL scheme; drop it and write only the host, "
            f"e.g. {rest!r} (ports go in ports:, paths in paths:)"
        )
    if "/" in text:
        raise HostPatternError(
            f"{_hint(text)} contains a path; write only the host and put paths in paths:"
        )
    if _SPACE.search(text):
        raise HostPatternError(f"{_hint(text)} contains whitespace; remove it")
    if ":" in text and text.count(":") == 1:
        raise HostPatternError(
            f"{_hint(text)} contains a port; write only the host and put the port in ports:"
        )
    if "@" in text:
        raise HostPatternError(f"{_hint(text)} contains '@'; write only the host")


def compile_host_pattern(pattern: str, *, allow_unicode: bool = False) -> HostPattern:
    """Validate and compile a policy host pattern (rules in the module docstring).

    Non-ASCII patterns are refused with the punycode to write instead, unless
    ``allow_unicode`` (used when comparing, not when loading policies).
    Raises HostPatternError with a message that says what to change.
    """
    raw = pattern.strip()
    if not raw:
        raise HostPatternError("host pattern is empty; write a host such as api.example.com")
    _reject_obvious(raw)
    ip = _ip_literal(raw)
    if ip is not None:
        return HostPattern(text=ip, kind="ip", suffix=ip)
    if raw.startswith("[") or raw.count(":") > 1:
        raise HostPatternError(f"{_hint(raw)} is not a valid IP address")

    text = raw[:-1] if raw.endswith(".") and raw != "." else raw
    if not text.isascii():
        try:
            suggestion = ".".join(
                p.lower() if p.isascii() else _to_ascii_label(p) for p in text.split(".")
            )
        except HostPatternError as exc:
            raise HostPatternError(f"{_hint(raw)}: {exc}") from None
        if not allow_unicode:
            raise HostPatternError(
                f"{_hint(raw)} is not ASCII; write internationalised names in punycode: "
                f'use "{suggestion}"'
            )
        text = suggestion
    text = text.lower()
    labels = text.split(".")

    if "*" not in text:
        _check_literal_labels(raw, labels)
        if len(labels) < 2:
            raise HostPatternError(
                f"{_hint(raw)} is a single label, not a domain name; write the full name "
                "(e.g. api.example.com) or an IP address"
            )
        if labels[-1].isdigit():
            raise HostPatternError(f"{_hint(raw)} is neither a domain name nor an IP address")
        if len(text) > 253:
            raise HostPatternError(f"{_hint(raw)} is longer than 253 characters")
        return HostPattern(text=text, kind="exact", suffix=text)
    return _compile_wildcard(raw, text, labels)


_WILDCARD_RULE = (
    "allowed wildcards: '*.x' (subdomains of x), '**.x' (x and its subdomains), "
    "'prefix*.x' or '*-suffix.x' (within the leftmost label), and after a leading '*.' "
    "a whole '*' label between literal labels ('*.s3.*.amazonaws.com')"
)


def _compile_wildcard(raw: str, text: str, labels: list[str]) -> HostPattern:
    if text in ("*", "**"):
        raise HostPatternError(
            f"{_hint(raw)} would allow every host; list the hosts the sandbox needs"
        )
    first = labels[0]
    rest = labels[1:]
    if "*" in labels[-1]:
        raise HostPatternError(
            f"{_hint(raw)} has a wildcard in the top-level label; write the full domain "
            "name (e.g. *.example.com)"
        )
    leading: Literal["*", "**", "partial"]
    if first == "*":
        leading = "*"
    elif first == "**":
        leading = "**"
    elif "*" not in first:
        raise HostPatternError(
            f"{_hint(raw)}: a wildcard may not follow a literal label unless the pattern "
            "starts with '*.'; " + _WILDCARD_RULE
        )
    elif "**" in first:
        raise HostPatternError(f"{_hint(raw)}: '**' must be a whole label; " + _WILDCARD_RULE)
    elif first.count("*") > 1:
        raise HostPatternError(f"{_hint(raw)}: only one '*' per label; " + _WILDCARD_RULE)
    elif first.endswith("*") or first.startswith("*-"):
        leading = "partial"
    elif first.startswith("*"):
        raise HostPatternError(
            f"{_hint(raw)}: a '*' directly followed by a letter or digit looks like a missing "
            f"dot (did you mean '*.{first[1:]}.{'.'.join(rest)}'?); " + _WILDCARD_RULE
        )
    else:
        raise HostPatternError(
            f"{_hint(raw)}: '*' in the middle of a label is not supported; " + _WILDCARD_RULE
        )
    if leading == "partial":
        literal = first.replace("*", "")
        if not _LABEL_CHARS.fullmatch(literal) or not literal.strip("-") or len(first) > 63:
            raise HostPatternError(
                f"{_hint(raw)} has an invalid label {first!r}; "
                "use letters, digits, '-' and '_' only"
            )

    # Middle labels: whole '*' only, only after a leading '*.', literals on both sides.
    last_wild = 0
    for i, label in enumerate(rest, start=1):
        if "*" not in label:
            continue
        if label == "*" and leading == "*" and "*" not in labels[i - 1]:
            last_wild = i
            continue
        if label == "*" and leading == "*":
            raise HostPatternError(f"{_hint(raw)}: two wildcard labels in a row; " + _WILDCARD_RULE)
        raise HostPatternError(
            f"{_hint(raw)}: a wildcard may not follow a literal label unless the pattern "
            "starts with '*.' and the wildcard is a whole '*' label; " + _WILDCARD_RULE
        )
    literal_labels = labels[last_wild + 1 :]
    if not literal_labels:
        raise HostPatternError(f"{_hint(raw)} has no domain after the wildcard")
    _check_literal_labels(raw, [lab for lab in labels[1:] if lab != "*"])
    suffix = ".".join(literal_labels)
    if is_public_suffix(suffix):
        raise HostPatternError(
            f"{_hint(raw)} puts a wildcard directly over the public suffix {suffix!r}, which "
            "would allow every site under it; name a domain you trust (e.g. *.example.com)"
        )

    if leading in ("*", "**") and last_wild == 0:
        kind: PatternKind = "subdomains" if leading == "*" else "self_and_subdomains"
        return HostPattern(text=text, kind=kind, suffix=suffix, _dot_suffix="." + suffix)

    parts: list[str] = []
    for i, label in enumerate(labels):
        if i == 0 and label == "*":
            parts.append(r"(?:[^.]+\.)+")
        elif i == 0 and label == "**":
            parts.append(r"(?:[^.]+\.)*")
        elif i == 0:
            parts.append(re.escape(label).replace(r"\*", "[^.]*") + r"\.")
        elif label == "*":
            parts.append(r"[^.]+\.")
        else:
            parts.append(re.escape(label) + r"\.")
    regex = re.compile("".join(parts)[:-2])
    return HostPattern(text=text, kind="glob", suffix=suffix, regex=regex)


def host_matches(host: str, pattern: str) -> bool:
    """Compare one host with one pattern, both in any case/IDN form; False if either is invalid.

    A convenience for tests and tools; the matcher compiles patterns once instead.
    """
    try:
        compiled = compile_host_pattern(pattern, allow_unicode=True)
        return compiled.matches(normalize_host(host))
    except DestinationError:
        return False
