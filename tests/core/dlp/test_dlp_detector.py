"""One rule's values: the longest group of at least 4 characters or the whole match,
trimmed (`strip`), cut (`stop`), extended (`tail`), confirmed, or a plugin's own values
located in the text; lookbehinds see before the window."""

from __future__ import annotations

import re
import time

import pytest
import regex

from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.detector import (
    PER_MIB,
    SECONDS,
    Budget,
    Detector,
    Rule,
    bounded,
    deadline,
)


def _values(rule: Rule, text: str, start: int = 0, end: int | None = None) -> list[str]:
    return [text[s.start:s.end] for s in rule.spans("d", text, start,
                                                    len(text) if end is None else end)]


@pytest.mark.parametrize(("rule", "text", "expected"), [
    (Rule(re.compile(r"(ghp)_[a-z]{4}")), "x ghp_abcd y", ["ghp_abcd"]),  # short group: match
    (Rule(re.compile(r"key = '([a-z]{5})'")), "key = 'abcde'", ["abcde"]),  # the group
    (Rule(re.compile(r"(?:\s|^)AKC[a-z]{3}(?:\s|$)"), strip=" "), "a AKCxyz b", ["AKCxyz"]),
    (Rule(re.compile(r"tok=(.+)"), stop=" \""), 'tok=npm_abc rest"', ["npm_abc"]),
    (Rule(re.compile(r"BEGIN K"), tail=re.compile(r"[\s\S]*?END K")), "BEGIN K\nxx\nEND K z",
     ["BEGIN K\nxx\nEND K"]),
    (Rule(re.compile(r"v[0-9]+"), confirm=lambda v: v != "v0"), "v0 v1", ["v1"]),
    (Rule(None, values=lambda t: iter(["abc"])), "abc xabc", ["abc", "abc"]),
    (Rule(None, values=lambda t: iter(["abc"]), confirm=lambda v: False), "abc", []),
])
def test_values(rule: Rule, text: str, expected: list[str]) -> None:
    assert _values(rule, text) == expected


def test_a_lookbehind_sees_before_the_window() -> None:
    rule = Rule(re.compile(r"(?<![a-z])hf_[a-z]{3}"))
    assert _values(rule, "xhf_abc", 1) == []  # 'x' before the window still counts
    assert _values(rule, " hf_abc", 1) == ["hf_abc"]


def test_the_reach_is_the_widest_rule() -> None:
    d = Detector("d", (Rule(None, before=3, after=10), Rule(None, before=0, after=40)))
    assert d.reach == 40


def test_what_a_rule_reads_in_a_window_is_bounded() -> None:
    """A rule's matches may read (values with their tails) up to `WORK` times its window
    (at least `MIN_WORK`): a text of one anchor over and over, each match's tail running
    to the window's end, is refused as unreadable in time of the window, where each
    match read the rest of the window again (128 KB: 14 s). Matches that read little, and
    a few long ones, are read as before."""
    import time

    from gateway.core.dlp.decoding import Unreadable
    from gateway.core.dlp.detector import MIN_WORK, WORK

    rule = Rule(re.compile("BEGIN KEY"), anchors=("BEGIN KEY",), after=16500,
                tail=re.compile(r"[\s\S]{0,16384}?END KEY|[A-Za-z ]*"))
    text = "BEGIN KEY " * 20_000  # (200 KB, no END: each tail runs to the window's end)
    started = time.perf_counter()
    with pytest.raises(Unreadable, match="more k candidates than the scan reads"):
        list(rule.spans("k", text, 0, len(text)))
    assert time.perf_counter() - started < 1.0
    keys = "".join(f"BEGIN KEY {'x' * 300} END KEY\n" for _ in range(100))
    assert len(list(rule.spans("k", keys, 0, len(keys)))) == 100
    long = "BEGIN KEY " + "y" * (MIN_WORK - 20)  # (one match reading all it may)
    assert len(list(rule.spans("k", long, 0, len(long)))) == 1
    assert WORK >= 2


def test_a_rule_tried_at_its_anchors_finds_what_finditer_finds() -> None:
    """`Rule.skip` (JWT's): the rule's matches are tried at each `eyJ`, a failed one's run
    skipped whole; over random texts of `eyJ`, the pattern's class (with its `9-_`
    range), dots and others, the same matches as `finditer`, and a text of `eyJ` over
    and over is read in linear time (1 MiB: minutes before)."""
    import random
    import time

    pattern = re.compile(r"eyJ[A-Za-z0-9-_=]+\.[A-Za-z0-9-_=]+\.?[A-Za-z0-9-_.+/=]*?")
    plain = Rule(pattern, anchors=("eyJ",), after=8192)
    tried = Rule(pattern, anchors=("eyJ",), after=8192,
                 skip=re.compile(r"eyJ[A-Za-z0-9-_=]*"))
    r = random.Random(7)
    atoms = ["eyJ", "eyJ", "a", "Z9", ":", "=", "-", "_", ".", ". ", " ", '"', "/", "+", "@"]
    for _ in range(20_000):
        text = "".join(r.choice(atoms) for _ in range(r.randrange(1, 30)))
        lo = r.randrange(len(text) + 1)
        hi = r.randrange(lo, len(text) + 1)
        assert [m.span() for m in tried._matches(text, lo, hi)] == \
            [m.span() for m in plain._matches(text, lo, hi)], (text, lo, hi)
    flood = "eyJ" * 350_000
    started = time.perf_counter()
    assert not list(tried._matches(flood, 0, len(flood)))
    assert time.perf_counter() - started < 1.0


# -- every expression with a time bound (detector.Budget) ------------------------------------

# npm's pattern as detect-secrets ships it: `.+` from each `//` to the line's end and back.
_NPM = re.compile(r"\/\/.+\/:_authToken=\s*((npm_.+)|([A-Fa-f0-9-]{36})).*")
_NPM_FLOOD = ("//t" * 50 + "/:_authToken=") * 1280  # (208 KB; `re`: ~20 s, quadratic)


def test_a_text_made_for_an_expression_is_unreadable_within_its_bound() -> None:
    rule = Rule(_NPM, anchors=("_authToken=",), before=512, after=512)
    started = time.perf_counter()
    with pytest.raises(Unreadable, match="npm credentials took longer than its bound"):
        list(rule.spans("npm", _NPM_FLOOD, 0, len(_NPM_FLOOD)))
    spent = time.perf_counter() - started
    # (its bound, 0.45 s; wall-clock, so a loaded machine's spare: `re` took ~20 s)
    assert SECONDS <= spent < SECONDS + PER_MIB * len(_NPM_FLOOD) / (1 << 20) + 1.5
    # an ordinary value is found (the rule's pattern runs by `regex`: `bounded`)
    assert _values(rule, "//registry.npmjs.org/:_authToken=npm_abcdefghijkl") == \
        ["npm_abcdefghijkl"]
    assert isinstance(rule.pattern, regex.Pattern)


def test_a_scan_s_budget_is_shared_by_every_text_it_reads() -> None:
    """Inside `Budget`, each text's expressions run to the scan's one deadline (an inner
    `Budget` keeps the outer's); the scan's thread's CPU time spent is unreadable at
    once, never unbounded (`regex` reads a negative timeout as none)."""
    rule = Rule(_NPM, anchors=("_authToken=",), before=512, after=512)
    small = "//t" * 50 + "/:_authToken="  # (alone: read at once)
    with Budget(0):
        first = deadline(10)
        with Budget(1 << 30):
            assert deadline(1 << 30) == first
        spent = time.thread_time() + SECONDS + 0.01
        while time.thread_time() < spent:  # (the scan's CPU time, spent elsewhere)
            pass
        with pytest.raises(Unreadable):
            list(rule.spans("npm", small, 0, len(small)))
    assert list(rule.spans("npm", small, 0, len(small))) == []  # (outside: its own)
    with pytest.raises(Unreadable):  # (no scan running: no CPU time to go on with)
        list(rule.spans("npm", small, 0, len(small), time.monotonic() - 1))


def test_a_thread_that_waited_is_not_refused_for_it() -> None:
    """The bound is the scan's CPU time: a scan whose thread waited past the wall-clock
    deadline (a loaded machine) reads on with what it has left, and a text made for an
    expression is still unreadable once that is spent."""
    rule = Rule(_NPM, anchors=("_authToken=",), before=512, after=512)
    value = "//registry.npmjs.org/:_authToken=npm_abcdefghijkl"
    with Budget(0):
        time.sleep(SECONDS + 0.05)  # (past the deadline by the wall clock; no CPU spent)
        assert deadline(0) < time.monotonic()
        assert [s.end - s.start for s in rule.spans("npm", value, 0, len(value))] == [16]
        started = time.thread_time()
        with pytest.raises(Unreadable):
            list(rule.spans("npm", _NPM_FLOOD, 0, len(_NPM_FLOOD)))
        assert time.thread_time() - started < SECONDS + 0.2


def test_regex_answers_as_re_for_the_expressions_it_runs() -> None:
    """`bounded` compiles a rule's pattern again with `regex`: flags mapped, the same
    matches (every detector's, in tests/services/dlp)."""
    pattern = re.compile(r"(?:\s|^)key[ \t]*=\s*'([^'\n]{4,})'", re.IGNORECASE | re.MULTILINE)
    ours = bounded(pattern)
    text = "KEY = 'abcd'\n key='efgh' x\nkey = 'no\nkey\t= 'ijkl'"
    assert [(m.span(), m.groups()) for m in ours.finditer(text)] == \
        [(m.span(), m.groups()) for m in pattern.finditer(text)]
    assert bounded(ours) is ours and bounded(None) is None
