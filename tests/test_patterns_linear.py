"""Every regular expression the gateway's decision and pipeline code compiles at import
tries one place in linear time on a hostile peer's text: each is matched (from the
start, as `match` and `fullmatch` read) over 16 KB runs of characters a text may repeat
(and the bytes a body starts with), within a bound a pattern that backtracks within one
attempt misses by far (`decoding._JSON_START`, written `ws* BOM? ws*`, took 1.2 s on 16
KB of spaces: a streamed body's first piece is read by it). (A search tries every
place: an unanchored pattern's cost there is its callers' to bound, by the text's size.)

The detectors' own patterns are held to linear time in
tests/services/dlp/test_dlp_library.py (regexploit, which does not report the quadratic
case above, and mutations of the texts they match)."""

from __future__ import annotations

import importlib
import pkgutil
import re
import time

import pytest

import gateway.core
import gateway.pipeline

RUN = 16 * 1024
BOUND = 0.05  # seconds a pattern may take on a run (linear: well under 1 ms)
_PROBES = " \t\r\n\x00\x85\xa0aAz0_-.:;=\"'\\/{}[]()<>%+,@#&|!?*~$^`\xef\xbb\xbf\xff"


def _patterns() -> list[tuple[str, re.Pattern[str] | re.Pattern[bytes]]]:
    found = []
    for package in (gateway.core, gateway.pipeline):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            loaded = importlib.import_module(module.name)
            found += [(f"{module.name}.{name}", value) for name, value in vars(loaded).items()
                      if isinstance(value, re.Pattern)]
    return found


PATTERNS = _patterns()


def _runs(pattern: re.Pattern[str] | re.Pattern[bytes]) -> list[str]:
    """Runs of each probe character, and of pairs of them (a pattern's two classes may
    take turns), each 16 KB."""
    singles = [c * RUN for c in _PROBES]
    pairs = [(a + b) * (RUN // 2) for a, b in zip(_PROBES, _PROBES[1:] + _PROBES[0], strict=True)]
    return singles + pairs + ["\xef\xbb\xbf" + " " * RUN]


def test_the_patterns_are_found() -> None:
    names = {name for name, _ in PATTERNS}
    assert len(PATTERNS) > 30 and "gateway.core.dlp.decoding._JSON_START" in names


@pytest.mark.parametrize(("name", "pattern"), PATTERNS, ids=[n for n, _ in PATTERNS])
def test_a_pattern_takes_linear_time_on_hostile_runs(
        name: str, pattern: re.Pattern[str] | re.Pattern[bytes]) -> None:
    slowest, text_of = 0.0, ""
    for text in _runs(pattern):
        subject = text.encode("latin-1") if isinstance(pattern.pattern, bytes) else text
        started = time.perf_counter()
        pattern.match(subject)  # type: ignore[arg-type]
        pattern.fullmatch(subject)  # type: ignore[arg-type]
        took = time.perf_counter() - started
        if took > slowest:
            slowest, text_of = took, text[:8]
    assert slowest < BOUND, f"{name} took {slowest:.3f} s on a run of {text_of!r}"
