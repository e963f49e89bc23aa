"""Ordinary traffic passes untouched with the default detectors: a real wheel, a tarball
of installed packages, a git pack made by the real `git`, model prompts holding code and
documentation, a package-lock.json, minified JavaScript. And what the prefilter costs on
a body without candidates (measured, printed; bounded loosely so a loaded machine
passes)."""

from __future__ import annotations

import ensurepip
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from helpers.dlp_corpus import CORPUS

from gateway.core.dlp import DEFAULT, DETECTORS, Detector, Location, Scanner
from gateway.core.dlp.fastscan import HYPERSCAN
from gateway.core.dlp.prefilter import _JSON_U, _PERCENT, Prefilter, json_unescape, unescape
from gateway.services.dlp.library import build

SCANNER = Scanner(build(DEFAULT), b"test-salt", limit=64 << 20)
REPO = Path(__file__).resolve().parents[3]
SITE = next(Path(p) for p in sys.path if p.endswith("site-packages"))


def _wheel() -> bytes:
    """A real wheel: the one ensurepip ships, else an installed package zipped."""
    bundled = sorted(Path(ensurepip.__file__).parent.glob("_bundled/*.whl"))
    if bundled:
        return bundled[0].read_bytes()
    import zipfile
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path in (SITE / "jinja2").rglob("*"):
            z.write(path, path.relative_to(SITE))
    return buf.getvalue()


def _tarball() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("jinja2", "yaml", "h11", "certifi", "idna"):
            tar.add(SITE / name, arcname=name)
    return buf.getvalue()


def _git_pack(tmp: Path) -> bytes:
    """A pack of this project's sources, as `git push` sends it (made by the real git)."""
    repo = tmp / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    for sub in ("gateway/core", "gateway/services/policy", "docs"):
        for path in (REPO / sub).glob("*.*"):
            target = repo / sub / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t.test"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "sources"], check=True)
    pack = subprocess.run([*git, "pack-objects", "--stdout", "--revs", "-q"], input=b"HEAD\n",
                          capture_output=True, check=True).stdout
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True,
                          check=True).stdout.strip()
    line = b"0" * 40 + b" " + head + b" refs/heads/main\0report-status side-band-64k\n"
    return b"%04x" % (len(line) + 4) + line + b"0000" + pack  # (as git push sends it)


def _prompt(text: str) -> bytes:
    return json.dumps({"model": "gpt-4o", "stream": True, "messages": [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": text},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "bash", "arguments": json.dumps({"cmd": "pytest -q tests/ && git diff"})}}]},
    ]}).encode()


def _package_lock() -> bytes:
    r = random.Random(1)
    packages = {"": {"name": "app", "version": "1.0.0"}}
    for i in range(800):
        name = f"pkg-{i}-{r.choice(['utils', 'core', 'react-dom', 'lodash'])}"
        packages[f"node_modules/{name}"] = {
            "version": f"{r.randint(0, 9)}.{r.randint(0, 30)}.{r.randint(0, 9)}",
            "resolved": f"https://registry.npmjs.org/{name}/-/{name}-1.0.0.tgz",
            "integrity": "sha512-" + __import__("base64").b64encode(r.randbytes(64)).decode(),
            "dev": r.random() < 0.3}
    return json.dumps({"name": "app", "lockfileVersion": 3, "packages": packages},
                      indent=2).encode()


def _minified_js() -> bytes:
    static = next(p for p in sys.path if p.endswith("site-packages"))
    found = sorted((Path(static) / "mitmproxy/tools/web/static").glob("*.js"))
    assert found, "mitmproxy's web UI ships minified JavaScript"
    return b"\n".join(p.read_bytes() for p in found)


def _cases(tmp: Path) -> dict[str, tuple[bytes, str, str | None]]:
    code = "\n\n".join(p.read_text() for p in sorted((REPO / "gateway/core").glob("*.py")))
    docs = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    return {
        "wheel": (_wheel(), "application/octet-stream", None),
        "tarball": (_tarball(), "application/gzip", None),
        "tarball-as-gzip-coding": (_tarball(), "application/x-tar", "gzip"),
        "git-pack": (_git_pack(tmp), "application/x-git-receive-pack-request", None),
        "prompt-with-code": (_prompt("Review this code:\n" + code), "application/json", None),
        "prompt-with-docs": (_prompt(docs), "application/json", None),
        # every source file of the project (not tests/, which hold fake keys), one prompt
        "prompt-with-all-sources": (_prompt("\n\n".join(
            p.read_text(errors="replace") for sub in ("gateway", "docs", "examples", "charts",
                                                      "scripts")
            for p in sorted((REPO / sub).rglob("*")) if p.is_file()
            and p.suffix in (".py", ".md", ".yaml", ".yml", ".sh", ".json", ".mjs", ".txt",
                             ".tpl", ".toml"))), "application/json", None),
        "package-lock": (_package_lock(), "application/json", None),
        "minified-js": (_minified_js(), "application/javascript", None),
    }


def test_ordinary_traffic_has_no_findings(tmp_path: Path) -> None:
    for name, (body, ctype, coding) in _cases(tmp_path).items():
        result = SCANNER.scan_body(body, ctype, coding)
        assert result.clean, (name, [f.describe() for f in result.findings], result.unreadable)


def test_ordinary_heads_have_no_findings() -> None:
    heads = [("GET", "/simple/requests/?format=json", [("User-Agent", "pip/24.2"),
                                                       ("Accept", "application/json")]),
             ("POST", "/v1/chat/completions", [
                 ("Content-Type", "application/json"), ("X-Stainless-Lang", "python"),
                 ("X-Request-Id", "req_0123456789abcdef0123456789abcdef"),
                 ("Traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]),
             ("GET", "/repos/o/r/commits/8f14e45fceea167a5a36dedd4bea2543e1b5a1f2", [
                 ("If-None-Match", 'W/"6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e5"'),
                 ("Cookie", "session=abc; _ga=GA1.2.1234567890.1234567890")])]
    for method, target, headers in heads:
        assert SCANNER.scan_request(method, target, headers).clean


@pytest.mark.parametrize("size", [2_000, 1 << 20])
def test_the_cost_of_a_body_without_candidates(size: int) -> None:
    """Printed for the record (docs/dlp.md has the bench's numbers); bounded loosely."""
    text = ("Write a function that parses a CSV file, returns rows as dicts, and handles "
            "quoted fields and escaped quotes. ") * (size // 100 + 1)
    body = _prompt(text[:size])
    assert SCANNER.scan_body(body, "application/json").clean
    reps = 200 if size < 10_000 else 3
    start = time.process_time()
    for _ in range(reps):
        SCANNER.scan_body(body, "application/json")
    each = (time.process_time() - start) / reps
    print(f"\n{len(body)} bytes without candidates: {each * 1e6:.0f} us CPU, "
          f"{len(body) / each / 1e6:.0f} MB/s")
    assert each < (0.002 if size < 10_000 else 0.5)


@pytest.mark.parametrize("fast", [pytest.param(True, marks=pytest.mark.skipif(
    not HYPERSCAN, reason="no hyperscan")), False])
@pytest.mark.parametrize(("kind", "text", "candidate"), [
    ("text", b"the request model " * 50, False),
    # an anchor of a rule whose every match holds a base64 run (ghp_ and 36 more): no
    # run, no value; an anchor of a rule whose matches need none is a candidate
    ("text", b"short words and a ghp_ anchor", False),
    ("text", b"short words and a :// anchor", True),
    ("text", b"short words and an xoX anchor", True),  # (caseless: xox)
    # aws's and Slack webhooks' values hold a run once ASCII, which their check requires
    ("text", b"short words and an AWS anchor", False),
    ("text", b"https://hooks.slack.com/services/T0/B1/x", True),  # (:// is basic-auth's)
    ("text", b"a run: QUJDREVGR0hJSktMTU5PUFFS", True),
    ("text", b"text keeps %67hp_ as it is", False),
    ("text", b"a text's \\u0067hp_ is read as JSON too", True),  # (a lenient reader's)
    ("text", b"and \\u00 or \\n hide nothing", False),
    ("json", b'{"a": "line\\nbreak \\"quoted\\" and \\\\ backslash"}', False),
    ("json", b'{"a": "\\u0067hp"}', True),  # a JSON reader undoes \u
    ("json", b'{"a": "https:\\/\\/x"}', True),  # and \/
    ("json", b'{"a": "50% off + tax"}', False),  # (not escapes to a JSON reader)
    ("form", b"a=1&b=two+words", True),  # a form reader undoes + and %XX
    ("form", b"a=1&b=%41", True),
    ("form", b"a=1&b=two", False),
])
def test_the_gate_by_the_reader_of_the_text(fast: bool, kind: str, text: bytes,
                                            candidate: bool) -> None:
    """`Prefilter.candidate`: a base64 run, an anchor of a rule whose matches need no
    run, or an escape the text's reader undoes (on Hyperscan and on the fallback alike;
    bytes and text alike)."""
    prefilter = Scanner(SCANNER.detectors, b"s", fast=fast).prefilter
    assert prefilter.candidate(text, kind) is candidate
    assert prefilter.candidate(text.decode("latin-1"), kind) is candidate


# -- the gate against the gate before it (every anchor, or a run) ----------------------

def _mutations(text: str, rng: random.Random) -> list[str]:
    """A credential's text as a leaking client might send it and as it breaks: whole,
    in prose, cut short, a character replaced by a space, a dot or a non-ASCII letter,
    case swapped, every n-th character a space."""
    out = [text, f"the notes say {text} and more", text.swapcase(), text.upper()]
    for _ in range(12):
        at = rng.randrange(len(text))
        out.append(text[:at])
        out.append(text[:at] + rng.choice(" .é:\n\"") + text[at + 1:])
    for step in (5, 11, 19, 21):
        out.append("".join(" " if i % step == step - 1 else c for i, c in enumerate(text)))
    return out


def _random_text(rng: random.Random) -> str:
    pieces = ["ghp_", "AKIA", "://", "eyJ", "xox", "AWS", "sk-ant-", "hf_", "AC", "SK",
              "AP1", "AKC", "-us", "SG.", "BEGIN ", "PRIVATE KEY", "@", ":", " ", "\n", "=",
              '"', "%41", "\\u0067", "\\/"]
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/_-"
    parts = []
    for _ in range(rng.randrange(1, 12)):
        if rng.random() < 0.4:
            parts.append(rng.choice(pieces))
        else:
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40))))
    return "".join(parts)


_TYPES = (None, "text/plain", "application/json", "application/x-www-form-urlencoded")

# Values of the rules whose matches need no run, as short as their patterns allow (no 20
# base64 characters in a row): what the gate must still open for (`Rule.run` declared
# wrongly for any of these rules fails the test below).
SHORT = ["https://bob:hunter2x@example.com/x", "deploy xoxb-1-a2 now",
         "token eyJhIjoxfQ.eyJiIjoyfQ.c2ln here", 'key "AKCp8abcdefgh" ok',
         "x=AP1abcdefgh ok", "//registry.npmjs.org/:_authToken=npm_ab12",
         "AccountKey=" + "a=" * 44, "sq0csp-" + "ab\\" * 15, "PuTTY-User-Key-File-2: x"]


# The shortest values of the case-insensitive rules declared `Rule.run` for their ASCII
# values (a run of exactly 20 from `com/`), in both cases and with a character past
# ASCII in the run (a Kelvin sign for a `k`, a long s for an `s`: no value then).
ASCII_RUN = ["https://hooks.slack.com/services/TX/BY/Z",
             "HTTPS://HOOKS.SLACK.COM/SERVICES/TX/BY/Z",
             "https://hooks.slac\u212a.com/services/TX/BY/Z",
             "https://hooks.slack.com/\u017fervices/TX/BY/Z",
             "aws_key='" + "Ab0+" * 10 + "'", "AWS PASS: \"" + "aB9/" * 10 + "\"",
             "aws token '" + "\u212a" * 40 + "'"]


def _anchored() -> tuple[Detector, ...]:
    """Every detector whose rules all have anchors (one without opens every gate)."""
    return tuple(d for d in build(DETECTORS) if all(r.anchors for r in d.rules))


def _agree(new: Scanner, full: Scanner, text: str) -> None:
    for body in (text.encode(), json.dumps({"k": text}).encode()):
        for ctype in _TYPES:
            assert new.scan_body(body, ctype) == full.scan_body(body, ctype), (body, ctype)
        if not new.prefilter.candidate(body):  # (what the stream window and a head ask)
            assert not list(full.text_hits(body.decode("latin-1"), Location("body")))


@pytest.mark.parametrize("fast", [pytest.param(True, marks=pytest.mark.skipif(
    not HYPERSCAN, reason="no hyperscan")), False])
def test_the_gate_loses_nothing_on_the_corpus_and_mutations(fast: bool) -> None:
    """Differential: the scan behind the gate (a run, or an anchor of a rule whose matches
    need no run) finds what a scan with no gate at all finds (every view read, decoded
    runs followed), on every corpus credential (29 detectors) whole, in prose, cut short
    and broken one character at a time, and on random texts of anchors, base64 pieces
    and escapes; bodies as text, JSON and forms. (Before, any anchor opened the gate:
    `ghp_` in prose was a candidate; now it needs its 36 characters, a run.)"""
    detectors = _anchored()
    new = Scanner(detectors, b"s", fast=fast)
    full = Scanner(detectors, b"s", fast=fast)
    full.body_clean = lambda body, content_type: False  # type: ignore[method-assign]
    rng = random.Random(43)
    for text in [fake.text for fake in CORPUS] + SHORT + ASCII_RUN:
        for mutated in _mutations(text, rng):
            _agree(new, full, mutated)
    for _ in range(400):
        _agree(new, full, _random_text(rng))
    for text, found in zip(ASCII_RUN, (True, True, False, False, True, True, False), strict=True):
        assert bool(full.scan_body(text.encode(), "text/plain").findings) is found, text


def _unescape_in_turn(text: str) -> str:
    """The reading `unescape` makes in one pass where it can: %XX twice, then JSON's
    `\\u00XX`, then `\\/`, each over the whole text in turn."""
    for _ in range(2):
        text = _PERCENT.sub(lambda m: chr(int(m.group(1), 16)), text)
    return _JSON_U.sub(lambda m: chr(int(m.group(1), 16)), text).replace("\\/", "/")


def test_unescape_reads_what_the_passes_in_turn_read() -> None:
    """Texts built of the escapes' pieces (a `\\u005c` or `\\u002f` that makes a
    `\\/`, a %25 that makes a %XX, backslashes escaping backslashes): one pass where
    it can, the same text as the passes in turn."""
    r = random.Random(53)
    atoms = ["\\", "/", "u", "0", "00", "u00", "5c", "5C", "2f", "2F", "41", "%", "%25",
             "%5C", "%2F", "a", "Z", "\\u00", "\\/", "\\\\", "%5c%2f", "\\u005c/"]
    for _ in range(100_000):
        text = "".join(r.choice(atoms) for _ in range(r.randrange(1, 12)))
        assert unescape(text) == _unescape_in_turn(text), text


@pytest.mark.parametrize(("anchors", "inside"), [
    (("aws", "AWS", "private_key_id"), True),
    (("ghp_", "sk-ant-", "://"), True),
    (("true",), False),        # (a JSON literal: outside any string)
    (("1e10",), False),        # (a number)
    (('key"',), False),        # (a quote: across a string's end)
    (("a", "null:"), False),
    (("\\x41",), False),        # (a backslash: an escape's)
])
def test_anchors_a_json_text_holds_only_in_its_strings(anchors: tuple[str, ...],
                                                       inside: bool) -> None:
    """`string_anchors`: the anchors, where each one found in a JSON text lies in one of
    its strings (so a search of the strings finds it); None where one may be made of
    what lies outside them, or a rule has no anchor."""
    from gateway.core.dlp.detector import Rule

    rule = Rule(pattern=re.compile("|".join(map(re.escape, anchors))), anchors=anchors)
    found = Prefilter((Detector("d", (rule,)),)).string_anchors()
    assert found == (frozenset(anchors) if inside else None)
    unanchored = Rule(pattern=re.compile("x{40}"), anchors=())
    assert Prefilter((Detector("d", (rule, unanchored)),)).string_anchors() is None


def test_json_unescape_reads_characters_as_a_json_reader_does() -> None:
    """Every `\\u` escape read as json reads it, each from its own backslash; a
    quote's and a backslash's left as they are (the text keeps its structure), and the
    two-character escapes of control characters."""
    for code in [*range(0, 0x7f), 0xe9, 0x0c0a, 0xffff]:
        char = chr(code)
        if char in '"\\':
            continue
        text = f"a\\u{code:04x}b\\u{code:04X}c"
        assert json_unescape(text) == f"a{char}b{char}c" == json.loads(f'"{text}"')
    assert json_unescape("x\\/y") == "x/y"
    kept = '\\n \\t \\" \\\\ \\u0022 \\u005c'
    assert json_unescape(kept) == kept
    assert json_unescape("\\\\u0061ws") == "\\\\u0061ws"  # (a backslash, then u0061)
    assert json_unescape("\\\\\\u0061ws") == "\\\\aws"
    assert json_unescape("no escape") == "no escape"


def test_a_text_of_more_anchors_than_the_scan_reads_is_unreadable() -> None:
    """Each anchor found costs a window and a Python step: a text holding more than
    `ANCHORS` and one more for each `ANCHOR_EVERY` characters is refused as unreadable
    (1 MiB of `AKIA`: 0.8 s before; the search stops at the limit), one at the limit is
    read."""
    import time

    from gateway.core.dlp.decoding import Unreadable
    from gateway.core.dlp.prefilter import ANCHOR_EVERY, ANCHORS

    prefilter = SCANNER.prefilter
    flood = "AKIA " * ((1 << 20) // 5)
    started = time.perf_counter()
    with pytest.raises(Unreadable, match="more anchors"):
        prefilter.spans(flood)
    # (12 ms idle; 0.48 s once with a suite on both cores; 0.8 s idle before the cap)
    assert time.perf_counter() - started < 0.7
    size = 200_000
    most = ANCHORS + size // ANCHOR_EVERY
    text = ("AKIA " * most).ljust(size, ".")
    assert len(text) == size and text.count("AKIA") == most
    prefilter.spans(text)  # (at the limit: read)
    with pytest.raises(Unreadable):
        prefilter.spans(("AKIA " * (most + 1)).ljust(size, "."))
