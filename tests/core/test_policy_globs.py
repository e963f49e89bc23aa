"""The policy files' one glob matcher (gateway/core/policy/globs.py), table-driven:
`*` within a segment, `**` across, `?` and `[...]` never `/`, names read whole, deny globs
also refusing what lies beneath; `paths:` compiled by it decide as before."""

from __future__ import annotations

import random
import re
import time

import pytest

from gateway.core.policy.globs import (
    Glob,
    GlobError,
    compile_glob,
    glob_regex,
    linear,
    validate_glob,
)
from gateway.core.policy.paths import compile_paths

# (glob, value, matches by segment)
SEGMENTS = [
    ("org/*", "org/api", True),
    ("org/*", "org/a/b", False),
    ("org/*", "org/", False),
    ("org/*", "org", False),
    ("org/*", "evil/secret", False),
    ("org/**", "org", True),
    ("org/**", "org/a", True),
    ("org/**", "org/a/b/c", True),
    ("org/**", "organisation/a", False),
    ("**", "", True),
    ("**", "a/b/c", True),
    ("**/z", "z", True),
    ("**/z", "a/b/z", True),
    ("**/z", "a/bz", False),
    ("a/**/z", "a/z", True),
    ("a/**/z", "a/b/c/z", True),
    ("a/**/z", "ab/z", False),
    ("repo://org/*", "repo://org/x", True),
    ("repo://org/*", "repo://org/x/y", False),
    ("repo://org/**", "repo://org/x/y", True),
    ("repo://*/x", "repo://org/x", True),
    ("v*.json", "v1.json", True),
    ("v*.json", "v1/x.json", False),
    ("a?c", "abc", True),
    ("a?c", "a/c", False),
    ("a[bc]d", "acd", True),
    ("a[!b]d", "a/d", False),
    ("a[/]d", "a/d", False),
    ("a[!b]d", "aed", True),
    ("a[b", "a[b", True),  # (no closing bracket: literal, as in fnmatch)
    ("x.y", "xzy", False),  # (regex characters are literal)
    ("a+b", "a+b", True),
]


@pytest.mark.parametrize(("glob", "value", "expected"), SEGMENTS)
def test_globs_match_by_segment(glob: str, value: str, expected: bool) -> None:
    assert bool(compile_glob(glob).fullmatch(value)) is expected


# (glob, value, matches as an opaque name: MCP tool and prompt names)
NAMES = [
    ("search_*", "search_code", True),
    ("search_*", "search_a/b", True),
    ("*", "", True),
    ("get_?", "get_x", True),
    ("get_[ab]", "get_c", False),
]


@pytest.mark.parametrize(("glob", "value", "expected"), NAMES)
def test_names_are_read_whole(glob: str, value: str, expected: bool) -> None:
    assert bool(compile_glob(glob, segments=False).fullmatch(value)) is expected


# (glob, value, a deny glob refuses it)
BENEATH = [
    ("repo://org/secret*", "repo://org/secret", True),
    ("repo://org/secret*", "repo://org/secrets/key", True),
    ("repo://org/secret", "repo://org/secret/a/b", True),
    ("repo://org/secret", "repo://org/secretive", False),
    ("repo://org/secret", "repo://org/public", False),
]


@pytest.mark.parametrize(("glob", "value", "expected"), BENEATH)
def test_a_deny_glob_refuses_what_lies_beneath(glob: str, value: str, expected: bool) -> None:
    assert bool(compile_glob(glob, beneath=True).fullmatch(value)) is expected


@pytest.mark.parametrize("glob", ["org/**x", "a**/b", "***"])
def test_double_star_inside_a_segment_is_refused(glob: str) -> None:
    with pytest.raises(GlobError, match="whole segment"):
        validate_glob(glob)
    with pytest.raises(GlobError):
        compile_glob(glob)


# paths: read with the same matcher (no `?`/`[...]`: `[` is literal in a path pattern)
PATHS = [
    ("/repos/**", "/repos", True),
    ("/repos/**", "/repos/a/b", True),
    ("/repos/**", "/reposx", False),
    ("/repos/*/issues", "/repos/a/issues", True),
    ("/repos/*/issues", "/repos/a/b/issues", False),
    ("/files/*.json", "/files/a.json", True),
    ("/files/*.json", "/files/a/b.json", False),
    ("/a[1]", "/a[1]", True),
    ("/a[1]", "/a1", False),
    ("/**", "/", True),
]


@pytest.mark.parametrize(("pattern", "path", "expected"), PATHS)
def test_path_patterns_use_the_same_matcher(pattern: str, path: str, expected: bool) -> None:
    assert compile_paths([pattern]).matches(path) is expected


# -- linear time: a glob of two wildcards or more is matched without backtracking ------------

_UNITS = ["a", "b", "ab", "*", "**", "?", "[ab]", "[!a]", "[", "x*", "*b", "a*b", "", ":"]
_TEXT = ["a", "b", "ab", "ba", "", "x", "/", ":", "aab", "?", "["]


def _glob(rng: random.Random) -> str:
    parts = ["".join(rng.choice(_UNITS) for _ in range(rng.randint(1, 2)))
             for _ in range(rng.randint(1, 5))]
    parts = [p if "**" not in p or p == "**" else p.replace("**", "*") for p in parts]
    return "/".join(parts)


def _value(rng: random.Random) -> str:
    return "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize(("segments", "beneath", "classes"), [
    (True, False, True), (True, True, True), (False, False, True), (True, False, False)])
def test_the_linear_matcher_answers_as_the_regex(segments: bool, beneath: bool,
                                                 classes: bool) -> None:
    """`Glob` against the regex `glob_regex` makes, over random globs (every wildcard,
    classes, empty segments) and texts: the same answer each time."""
    rng = random.Random(41)
    tried = matched = 0
    for _ in range(3000):
        glob = _glob(rng)
        if segments:
            try:
                validate_glob(glob)
            except GlobError:
                continue
        regex = glob_regex(glob, segments=segments, classes=classes)
        if beneath:
            regex = f"(?:{regex})(?:/.*)?"
        compiled = re.compile(regex, re.DOTALL)
        ours = Glob(glob, segments=segments, beneath=beneath, classes=classes)
        for _ in range(6):
            value = _value(rng)
            want = compiled.fullmatch(value) is not None
            assert ours.fullmatch(value) == want, (glob, value)
            tried += 1
            matched += want
    assert tried > 10000 and matched > 400


@pytest.mark.parametrize(("glob", "segments", "linear_"), [
    ("org/**", True, True), ("/repos/*/issues/*", True, True), ("v*.json", True, True),
    ("/a/**/b/**", True, False), ("a*b*", True, False), ("delete_*", False, True),
    ("*_admin_*", False, False), ("org/*/x*", True, True)])
def test_which_globs_the_regex_matches(glob: str, segments: bool, linear_: bool) -> None:
    assert linear(glob, segments=segments) is linear_
    assert isinstance(compile_glob(glob, segments), Glob) is not linear_


@pytest.mark.parametrize(("glob", "value"), [
    ("/a/**/b/**/c/**/d", "/a" + "/b" * 4000 + "/c" * 4000 + "/e"),
    ("/a/**/b/**/c", "/a" + "/b" * 8000 + "/d"),
    ("/x*y*z*w", "/x" + "y" * 16000),
    ("*a*b*c*d", "a" * 16000)])
def test_a_hostile_text_is_matched_in_linear_time(glob: str, value: str) -> None:
    """What backtracking took 12 s for (three `**`, 8 KB of segments), and more."""
    segments = not glob.startswith("*a")
    matcher = compile_glob(glob, segments)
    started = time.perf_counter()
    assert not matcher.fullmatch(value)
    if segments:  # (and as a rule's `paths:`)
        assert not compile_paths((glob,)).matches(value)
    assert time.perf_counter() - started < 0.5


def test_two_leading_double_stars_match_no_segment() -> None:
    """`**/**/x` is `x` beneath any segments: the regex read the second `**` as taking
    a separator before it, so `x` alone did not match."""
    assert compile_glob("**/**/x").fullmatch("x")
    assert re.fullmatch(glob_regex("**/**/x"), "x")
