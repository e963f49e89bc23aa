"""The policy files' one glob matcher (gateway/core/policy/globs.py), table-driven:
`*` within a segment, `**` across, `?` and `[...]` never `/`, names read whole, deny globs
also refusing what lies beneath; `paths:` compiled by it decide as before."""

from __future__ import annotations

import pytest

from gateway.core.policy.globs import GlobError, compile_glob, validate_glob
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
