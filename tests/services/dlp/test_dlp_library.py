"""The detector library: exactly the catalogue's names, every detect-secrets plugin used
or deliberately left out, each pattern taken from the plugin (not copied), and the
prefilter's anchors losing nothing against a full regular-expression pass."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re
from dataclasses import replace
from re import _constants as _c  # type: ignore[attr-defined]
from re import _parser as _p  # type: ignore[attr-defined]
from typing import Any

import detect_secrets.plugins
import pytest
from detect_secrets.plugins.base import BasePlugin, RegexBasedDetector
from helpers.dlp_corpus import CORPUS, Fake

from gateway.core.dlp import DEFAULT, DETECTORS, OPT_IN, Detector, Location, Scanner
from gateway.core.dlp.detector import MIN_GROUP, Rule, bounded
from gateway.core.dlp.fastscan import SEGMENT
from gateway.services.dlp import plugins as ours
from gateway.services.dlp.library import (
    _SEPARATOR,
    PLUGINS,
    Both,
    _plausible,
    build,
    cases,
    linear,
)

LEFT_OUT = {"IPPublicDetector"}  # a public IP address is not a credential


def _shipped() -> set[type[BasePlugin]]:
    found = set()
    for info in pkgutil.iter_modules(detect_secrets.plugins.__path__):
        module = importlib.import_module(f"detect_secrets.plugins.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BasePlugin) and not inspect.isabstract(cls) \
                    and cls.__module__ == module.__name__:
                found.add(cls)
    return found


def test_the_library_builds_the_catalogue() -> None:
    assert set(PLUGINS) == set(DETECTORS)
    assert [d.name for d in build(DETECTORS)] == list(DETECTORS)
    assert set(DEFAULT) | OPT_IN == set(DETECTORS) and not set(DEFAULT) & OPT_IN
    with pytest.raises(KeyError):
        build(["nope"])


def test_every_shipped_plugin_is_used_or_left_out_on_purpose() -> None:
    used = {cls for entries in PLUGINS.values() for cls, _ in entries}
    shipped = _shipped()
    assert {c.__name__ for c in shipped - used} == LEFT_OUT
    assert {c for c in used if c.__module__ == ours.__name__} == {
        c for _, c in inspect.getmembers(ours, inspect.isclass)
        if issubclass(c, RegexBasedDetector) and c is not RegexBasedDetector}


def test_patterns_are_the_plugins_own() -> None:
    for detector in build(DETECTORS):
        patterns = [r.pattern for r in detector.rules if r.pattern is not None]
        plugin_patterns = [p for cls, _ in PLUGINS[detector.name]
                           if issubclass(cls, RegexBasedDetector) for p in cls.denylist]
        # their source, but those written linear (`linear`, below), run by `regex`
        # (`detector.bounded`: the same flags)
        assert [p.pattern for p in patterns] == [linear(p).pattern for p in plugin_patterns]
        assert all(p.pattern == b.pattern for p, b in zip(patterns, plugin_patterns,
                                                          strict=True)
                   if _SEPARATOR not in b.pattern)
        assert [p.flags for p in patterns] == [bounded(p).flags for p in plugin_patterns]


def test_case_variants() -> None:
    assert set(cases("aws")) == {"aws", "awS", "aWs", "aWS", "Aws", "AwS", "AWs", "AWS"}
    assert cases("a-1") == ("a-1", "A-1")


def _unanchored(detectors: tuple[Detector, ...]) -> tuple[Detector, ...]:
    return tuple(Detector(d.name, tuple(replace(r, anchors=()) for r in d.rules))
                 for d in detectors)


@pytest.mark.parametrize("fake", CORPUS, ids=lambda f: f.detector)
def test_the_prefilter_loses_nothing_against_a_full_pass(fake: Fake) -> None:
    """Every anchored rule run over the whole text (no prefilter) finds what the
    prefiltered scan finds, in the fake's text and in text around it."""
    detectors = build(DETECTORS)
    fast = Scanner(detectors, b"s")
    full = Scanner(_unanchored(detectors), b"s")
    for text in (fake.text, f"prefix {fake.text} suffix", f'{{"k": "{fake.text}"}}'):
        where = Location("body", offset=0)
        got = {(f.detector, f.fingerprint) for f in fast.scan_text(text, where)}
        want = {(f.detector, f.fingerprint) for f in full.scan_text(text, where)}
        assert got == want, (text[:40], got ^ want)


@pytest.mark.parametrize("fake", CORPUS, ids=lambda f: f.detector)
def test_the_fallback_prefilter_finds_the_same(fake: Fake) -> None:
    """The automaton (where there is no Hyperscan wheel) finds what Hyperscan finds."""
    detectors = build(DETECTORS)
    fast, slow = Scanner(detectors, b"s"), Scanner(detectors, b"s", fast=False)
    for text in (fake.text, f"prefix {fake.text} suffix", f'{{"k": "{fake.text}"}}'):
        body = text.encode()
        assert slow.scan_body(body) == fast.scan_body(body)
        assert slow.scan_body(body, "application/json") == fast.scan_body(body,
                                                                          "application/json")


def _pem_body() -> str:
    return "\n".join(["MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7" + "a" * 12] * 4)


@pytest.mark.parametrize(("text", "found"), [
    (f"-----BEGIN RSA PRIVATE KEY-----\n{_pem_body()}\n-----END RSA PRIVATE KEY-----", True),
    (f"-----BEGIN OPENSSH PRIVATE KEY-----\n{_pem_body()}\n", True),  # cut short, no END
    ("-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,00FF\n\n"
     f"{_pem_body()}\n-----END RSA PRIVATE KEY-----", True),
    ("PuTTY-User-Key-File-2: ssh-rsa\nEncryption: none\nComment: k\nPublic-Lines: 4\n"
     f"{_pem_body()}\nPrivate-Lines: 4\n{_pem_body()}\nPrivate-MAC: 0a1b2c", True),
    # code that reads keys holds the header, not a key
    ('if line.startswith("-----BEGIN RSA PRIVATE KEY-----"):\n    return parse_pem(line)\n'
     'elif line.startswith("-----END RSA PRIVATE KEY-----"):\n    done = True', False),
    ('HEADERS = ("BEGIN PRIVATE KEY", "BEGIN EC PRIVATE KEY", "BEGIN DSA PRIVATE KEY")', False),
    ("-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----", False),
])
def test_a_private_key_needs_key_material(text: str, found: bool) -> None:
    scanner = Scanner(build(["private-key"]), b"s")
    for carrier in (text, json.dumps({"k": text})):
        hits = scanner.scan_text(carrier, Location("body", offset=0))
        assert bool(hits) is found, carrier[:60]


# -- Rule.run: every match of the pattern holds SEGMENT base64 characters in a row -------

_ALPHABET = frozenset(map(ord, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                "0123456789+/_-"))


def _in_alphabet(item: tuple[Any, Any], caseless: bool) -> bool:
    """Whether one regex item matches a single character, always of the alphabet. Under
    Unicode IGNORECASE a letter also matches characters outside ASCII (`k` the Kelvin
    sign, `s` the long s): no item with a letter counts there."""
    op, arg = item
    if op is _c.LITERAL:
        return arg in _ALPHABET and not (caseless and chr(arg).isalpha())
    if op is not _c.IN:
        return False
    for kind, value in arg:
        if kind is _c.LITERAL:
            ok = value in _ALPHABET and not (caseless and chr(value).isalpha())
        elif kind is _c.RANGE:
            lo, hi = value
            ok = all(c in _ALPHABET for c in range(lo, hi + 1)) and not (
                caseless and any(chr(c).isalpha() for c in range(lo, hi + 1)))
        elif kind is _c.CATEGORY:
            ok = False  # (\d, \w: Unicode digits and letters too)
        else:
            ok = False  # NEGATE and anything else
        if not ok:
            return False
    return True


def _runs(items: Any, caseless: bool) -> tuple[int, int, int, bool]:
    """(run every match starts with, run it ends with, longest run it surely holds,
    whether every character of every match is in the alphabet: then the three are its
    least length) for a parsed sequence; conservative (an item it does not know breaks
    runs and holds none)."""
    head = tail = best = 0
    whole = True
    for item in items:
        op, arg = item
        if _in_alphabet(item, caseless):
            sub = (1, 1, 1, True)
        elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT, _c.POSSESSIVE_REPEAT):
            low, _high, body = arg
            h, t, b, w = _runs(body, caseless)
            if low == 0:
                sub = (0, 0, 0, w)
            elif w:
                sub = (h * low, h * low, h * low, True)
            else:
                sub = (h, t, max(b, t + h) if low > 1 else b, False)
        elif op is _c.SUBPATTERN:
            sub = _runs(arg[-1], caseless)
        elif op is _c.ATOMIC_GROUP:
            sub = _runs(arg, caseless)
        elif op is _c.BRANCH:
            subs = [_runs(b, caseless) for b in arg[1]]
            sub = (min(s[0] for s in subs), min(s[1] for s in subs),
                   min(s[2] for s in subs), all(s[3] for s in subs))
            if sub[3]:
                least = min(s[0] for s in subs)
                sub = (least, least, least, True)
        elif op in (_c.AT, _c.ASSERT, _c.ASSERT_NOT):
            continue  # zero-width: neither a character nor a break
        else:
            sub = (0, 0, 0, False)
        h, t, b, w = sub
        if whole:
            head = head + h
        best = max(best, b, tail + h)
        tail = tail + t if w else t
        whole = whole and w
    best = max(best, head, tail)
    return head, tail, best, whole


def _surely_holds_a_run(pattern: re.Pattern[str], ascii_value: bool = False) -> int:
    """The run every match holds; with `ascii_value` (the rule's values are ASCII, or
    it reports none), the run its value holds: a case-insensitive letter then matches
    only the two ASCII cases, both in the alphabet. The value is the whole match (no
    group) or the pattern's one group, if at its top level (in every match) and never
    shorter than `MIN_GROUP` (`Rule.spans`)."""
    caseless = bool(pattern.flags & re.IGNORECASE) and not pattern.flags & re.ASCII
    parsed = _p.parse(pattern.pattern, pattern.flags)
    best = _runs(parsed, caseless)[2]
    if not (ascii_value and caseless):
        return best
    if pattern.groups == 0:
        return max(best, _runs(parsed, False)[2])
    groups = [arg for op, arg in parsed if op is _c.SUBPATTERN and arg[0] is not None]
    if pattern.groups == 1 and len(groups) == 1:
        body = groups[0][-1]
        if body.getwidth()[0] >= MIN_GROUP:
            return max(best, _runs(body, False)[2])
    return best


def _ascii_values(rule: Rule) -> bool:
    """Whether every value `rule` reports is ASCII: its check is `_plausible` (which
    refuses a value with a character past ASCII) or begins with it, and no `strip` or
    `stop` shortens the value after the match."""
    check = rule.confirm
    while isinstance(check, Both):
        check = check.first
    return check is _plausible and not rule.strip and not rule.stop


@pytest.mark.parametrize(("pattern", "run"), [
    (r"ghp_[A-Za-z0-9]{36}", 40), (r"ab[a-z]{10}\.[a-z]{19}", 19),
    (r"(?:AKIA|ASIA)[0-9A-Z]{16}", 20), (r"x(?:a|bc)y", 3), (r"[a-z]{5,}c?[a-z]{15}", 20),
    (r"[A-Za-z0-9+/=]{88}", 0), (r"\w{40}", 0), (r"(?i)k[a-z]{40}", 0),
    (r"(?<![A-Za-z])hf_[A-Za-z0-9]{34}(?![a-z])", 37), (r"[a-z]+-[a-z]*", 2), (r"[a-z]+ [a-z]*", 1),
])
def test_the_run_analysis(pattern: str, run: int) -> None:
    assert _surely_holds_a_run(re.compile(pattern)) == run


@pytest.mark.parametrize(("pattern", "run", "caseless"), [
    # a case-insensitive pattern whose values are ASCII: its letters count, in the value
    (r"(?i)k[a-z]{40}", 41, 0), (r"(?i)aws.{0,20}?key.{0,20}?'([0-9a-z/+]{40})'", 40, 0),
    (r"(?i)https://h\.com/s/T[a-z_]+/B[a-z_]+/[a-z_]+", 13, 2),
    (r"(?i)(ab)[a-z]{30}", 0, 0),  # (a group shorter than MIN_GROUP is not the value)
    (r"(?i)([a-z]{4})|([a-z]{30})", 0, 0),  # (two groups: which one is the value?)
    (r"(?i)x([a-z]{30})?", 0, 0),  # (a group that may not take part)
    (r"(?i)\w([a-z]{30})", 30, 0),
])
def test_the_run_analysis_of_an_ascii_value(pattern: str, run: int, caseless: int) -> None:
    assert _surely_holds_a_run(re.compile(pattern), ascii_value=True) == run
    assert _surely_holds_a_run(re.compile(pattern)) == caseless  # (no letter counts)


def test_ascii_values() -> None:
    """`_ascii_values` reads the check the library gives a rule; `_plausible` refuses a
    value past ASCII (a Kelvin sign for a `k`)."""
    assert not _plausible("AKIA\u212aBCDEFGHIJKLMNOP".encode().decode("unicode_escape"))
    rules = {(d.name, r.anchors[:1]): r for d in build(DETECTORS) for r in d.rules}
    assert _ascii_values(rules[("aws", ("aws",))])
    assert _ascii_values(rules[("jwt", ("eyJ",))])  # (its plugin's own check after)
    assert not _ascii_values(rules[("artifactory", ("AKC",))])  # (strip)
    assert not _ascii_values(replace(rules[("aws", ("aws",))], confirm=lambda v: True))


def test_a_rule_declared_to_hold_a_run_does() -> None:
    """`Rule.run` (the gate skips the anchors of such rules where a text holds no run):
    every rule that declares it holds SEGMENT base64 characters in a row in every
    value it reports, by the pattern's structure (and, for a case-insensitive pattern,
    its check that values are ASCII); and some do (the gate relies on the list). The
    rules left are those whose values may hold no run (the gate looks for their
    anchors): a rule added to either list fails here until its proof is given."""
    declared = [(d.name, r) for d in build(DETECTORS) for r in d.rules if r.run]
    assert len(declared) >= 20
    for name, rule in declared:
        assert rule.pattern is not None, name
        assert _surely_holds_a_run(rule.pattern, _ascii_values(rule)) >= SEGMENT, (
            name, rule.pattern.pattern)
    undeclared = {(d.name, r.anchors[0]) for d in build(DEFAULT) for r in d.rules
                  if not r.run}
    assert undeclared == {
        ("azure-storage", "AccountKey="), ("basic-auth", "://"), ("slack", "xox"),
        ("jwt", "eyJ"), ("npm", "_authToken="), ("square", "sq0csp-"),
        ("artifactory", "AKC"), ("artifactory", "AP0"),
        *(("private-key", p) for p in (
            "BEGIN DSA PRIVATE KEY", "BEGIN EC PRIVATE KEY", "BEGIN OPENSSH PRIVATE KEY",
            "BEGIN PGP PRIVATE KEY BLOCK", "BEGIN PRIVATE KEY", "BEGIN RSA PRIVATE KEY",
            "BEGIN SSH2 ENCRYPTED PRIVATE KEY", "PuTTY-User-Key-File-2"))}


@pytest.mark.parametrize("host", ["hooks.slack.com", "Hooks.Slack.com", "HOOKS.SLACK.COM",
                                  "hOoKs.sLaCk.CoM"])
@pytest.mark.parametrize("path", ["services", "Services", "SERVICES"])
def test_a_slack_webhook_is_found_in_any_mix_of_cases(host: str, path: str) -> None:
    """The webhook's pattern ignores case, and so does what sends a body to it: a host or
    path spelt in other cases is the same secret, found by the prefiltered scan as by a
    full pass (its anchor is the scheme's `://`, not the host)."""
    detectors = build(DETECTORS)
    fast = Scanner(detectors, b"s")
    full = Scanner(_unanchored(detectors), b"s")
    url = f"https://{host}/{path}/T0123ABCD/B0123ABCD/abcdefghijklmnopqrstuvwx"
    for text in (url, f"post the report to {url} when done", json.dumps({"hook": url})):
        where = Location("body", offset=0)
        assert {f.detector for f in fast.scan_text(text, where)} == {"slack"}, text
        assert {f.detector for f in full.scan_text(text, where)} == {"slack"}, text


def test_the_jwt_rule_skips_what_its_pattern_cannot_match() -> None:
    """`_JWT_RUN` (the JWT rule's `skip`) is right only for detect-secrets' pattern as it
    is: `eyJ`, a run of its class, then a `.`; an upgrade that changes it fails here."""
    from detect_secrets.plugins.jwt import JwtTokenDetector

    from gateway.services.dlp.library import _JWT_RUN

    (pattern,) = JwtTokenDetector().denylist
    assert pattern.pattern.startswith(_JWT_RUN.removesuffix("*") + "+\\.")
    (rule,) = [r for d in build(("jwt",)) for r in d.rules]
    assert rule.skip is not None and rule.skip.pattern == _JWT_RUN and rule.anchors == ("eyJ",)


# -- every pattern in linear time (a hostile sandbox picks the text) ---------------------------

def _super_linear(pattern: re.Pattern[str]) -> list[str]:
    """regexploit's findings of cubic or worse backtracking in `pattern` (what its own
    command line reports), each as an example text."""
    import warnings

    with warnings.catch_warnings():  # (it reads patterns with the deprecated `sre_parse`)
        warnings.simplefilter("ignore", DeprecationWarning)
        from regexploit.ast.sre import SreOpParser
        from regexploit.redos import find
    parsed = SreOpParser().parse_sre(pattern.pattern, pattern.flags & ~re.UNICODE)
    return [redos.example() for redos in find(parsed) if redos.starriness > 2]


def _every_pattern() -> list[tuple[str, re.Pattern[str]]]:
    """Every expression a detector runs: patterns, tails, skips, and the keyword plugin's
    own (it runs its `analyze_string` over the whole text)."""
    from detect_secrets.plugins import keyword

    out = [(d.name, p) for d in build(DETECTORS) for r in d.rules
           for p in (r.pattern, r.tail, r.skip) if p is not None]
    for value in vars(keyword).values():
        for item in value if isinstance(value, dict) else [value]:
            if isinstance(item, re.Pattern):
                out.append(("keyword", item))
    return out


def test_no_pattern_backtracks_super_linearly() -> None:
    """The four IBM plugins' separator cost n³ (`library._SEPARATOR`); regexploit finds
    it in the plugins' patterns as they ship, and nothing in what the detectors run."""
    shipped = [p for cls, _ in PLUGINS["cloudant"] for p in cls.denylist]
    assert _super_linear(shipped[0])  # (the analysis sees it where it is)
    found = {(name, p.pattern): _super_linear(p)[:1] for name, p in _every_pattern()}
    assert len(found) > 60
    assert {k: v for k, v in found.items() if v} == {}


_FIRST = ["", "x", "cl", "clou", "cloudant", "ibm", "ibm_cloud_iam", "cloud-iam", "iam",
          "ibmcloud", "cloud", "cos", "ibm_cos_hmac", "ibm-cos", "softlayer", "sl"]
_LAST = ["key", "pwd", "pw", "password", "pass", "token", "secret_key", "secret_access_key",
         "secret-accesskey", "ke", "secret"]
_AROUND = ["", "[", "]", '"', "'", "x", " ", "\n", "=", ":"]
_SEPARATORS = ["", " ", "  ", "   ", "=", ":", "=>", "::", ":=", " = ", "\t", "==", ": :"]
_VALUES = ["0123456789abcdef" * 4, "abcdefghijklmnopqrstuvwx", "aB3" * 14 + "xY",
           "f0" * 24, "0a1b2c3d4e5f6789" * 4, "abc", "0123456789abcdef" * 5]


def _shaped(rng: Any) -> str:
    """A text shaped like `name = value` (its pieces each left out or doubled at times,
    so that the ambiguous separators are tried every way)."""
    def around() -> str:
        return str(rng.choice(_AROUND)) if rng.random() < 0.3 else ""

    parts = [around(), around(),
             rng.choice(_FIRST) + rng.choice(["", "_", "-"]) + rng.choice(["", "api"])
             + rng.choice(["", "_", "-"]) + rng.choice(_LAST),
             around(), " " * rng.randint(0, 4), rng.choice(_SEPARATORS),
             " " * rng.randint(0, 4), around(), rng.choice(_VALUES), around(), around()]
    if rng.random() < 0.3:
        parts.insert(rng.randrange(len(parts)), rng.choice(parts))
    if rng.random() < 0.3:
        del parts[rng.randrange(len(parts))]
    return "".join(parts)


@pytest.mark.parametrize("name", ["cloudant", "ibm-cloud-iam", "ibm-cos-hmac", "softlayer"])
def test_the_linear_separator_matches_what_the_original_does(name: str) -> None:
    """Over random texts shaped like a name and its value (short: the original is
    cubic), each rewritten pattern finds the same matches, spans and groups."""
    import random

    rng = random.Random(43)
    pairs = [(p, linear(p)) for cls, _ in PLUGINS[name] for p in cls.denylist
             if _SEPARATOR in p.pattern]
    assert pairs
    matched = 0
    for _ in range(20000):
        text = _shaped(rng) + (_shaped(rng) if rng.random() < 0.2 else "")
        for original, written in pairs:
            want = [(m.span(), m.groups()) for m in original.finditer(text)]
            assert [(m.span(), m.groups()) for m in written.finditer(text)] == want, text
            matched += bool(want)
    assert matched > 200


@pytest.mark.parametrize(("name", "lead"), [
    ("cloudant", "clpw"), ("ibm-cloud-iam", "ibm_cloud_iam_key"), ("ibm-cloud-iam", "key"),
    ("ibm-cos-hmac", "secret_key"), ("softlayer", "softlayer_key")])
def test_a_name_and_a_run_of_spaces_is_read_in_linear_time(name: str, lead: str) -> None:
    """A name and 64 KiB of spaces: 2 KB of it cost 50 s with the shipped pattern; a
    value after a long run of spaces is still found."""
    import time

    scanner = Scanner(build((name,)), b"s")
    started = time.perf_counter()
    assert scanner.scan_body((lead + " " * 65536).encode(), "text/plain").findings == ()
    assert time.perf_counter() - started < 2
    value = {"cloudant": "0123456789abcdef" * 4, "ibm-cloud-iam": "aB3" * 14 + "xY",
             "ibm-cos-hmac": "f0e1d2c3b4a5968778695a4b3c2d1e0f" + "a1b2c3d4e5f60718",
             "softlayer": "0a1b2c3d4e5f6789" * 4}[name]
    found = scanner.scan_body(f"{lead}{' ' * 3000}= {value}".encode(), "text/plain")
    assert [f.detector for f in found.findings] == [name]


def test_regex_finds_what_re_finds_for_every_pattern() -> None:
    """Every detector's expressions run by `regex` (`detector.bounded`, for its time
    bound): over the corpus and random texts of anchors, keys' characters and
    delimiters, each finds the matches `re` finds with the plugin's pattern."""
    import random

    rng = random.Random(43)
    pairs = [(re.compile(r.pattern.pattern, flags), r.pattern)
             for d in build(DETECTORS) for r in d.rules if r.pattern is not None
             for flags in [next(p.flags for cls, _ in PLUGINS[d.name]
                                if issubclass(cls, RegexBasedDetector)
                                for p in cls.denylist
                                if linear(p).pattern == r.pattern.pattern)]]
    assert len(pairs) > 40
    anchors = sorted({a for d in build(DETECTORS) for r in d.rules for a in r.anchors})
    pieces = [*anchors, "A", "z", "0", "9f", "-", "_", ".", "/", "=", ":", " ", "\n", '"',
              "'", "é", "Ω", "key", "password", "@", "+", "abcdefghij0123456789"]
    texts = [f.text for f in CORPUS] + [
        "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    found = 0
    for text in texts:
        for shipped, run in pairs:
            want = [(m.span(), m.groups()) for m in shipped.finditer(text)]
            assert [(m.span(), m.groups()) for m in run.finditer(text)] == want, \
                (shipped.pattern, text)
            found += bool(want)
    assert found > 100


@pytest.mark.parametrize("name", ["keyword", "high-entropy"])
def test_the_plugins_values_are_read_as_the_plugin_reads_them(name: str) -> None:
    """Keyword and high-entropy run their expressions by `regex` with the scan's deadline
    (`library._values`); the same values as the plugin's own `analyze_string` (high
    entropy: those over its limit), and a text made for keyword's expressions is
    unreadable within the bound (`APWDO` 2,000 times: 16 s before)."""
    import random
    import time

    from gateway.core.dlp.decoding import Unreadable

    rng = random.Random(43)
    pieces = ["password", "api_key", "secret", "pwd", "=", ":", " = ", "=>", ":=", '"', "'",
              "`", "(", ")", ",", ";", "\n", " ", "x", "hunter2", "0f3a9c71e2d4b5a6",
              "aGVsbG8gd29ybGQgdGhpcyBpcyBh", "contrasena", "APWDO", "$", "{", "}",
              "password = 'hunter2xyz'", 'api_key: "Zq81mXv03LpWc7"', '"a9F3kQ2zX7pL0vB8nM4c"',
              "'9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08'"]
    rules = [r for d in build((name,)) for r in d.rules]
    plugins = [cls() for cls, _ in PLUGINS[name]]
    found = 0
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        for rule, plugin in zip(rules, plugins, strict=True):
            assert rule.values is not None
            want = list(plugin.analyze_string(text))
            if name == "high-entropy":
                want = [v for v in want
                        if plugin.calculate_shannon_entropy(v) > plugin.entropy_limit]
            assert list(rule.values(text)) == want, text
            found += bool(want)
    assert found > 300
    if name == "keyword":
        started = time.perf_counter()
        with pytest.raises(Unreadable):
            list(rules[0].spans(name, "APWDO" * 2000, 0, 10000))
        assert time.perf_counter() - started < 2  # (its bound: 0.26 s of wall-clock)
