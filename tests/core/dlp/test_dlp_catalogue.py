"""The catalogue policies name detectors from: names as policies write them, each
described, the default set without the opt-in ones, every name in docs/dlp.md."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.core.dlp.catalogue import DEFAULT, DETECTORS, OPT_IN

DOCS = Path(__file__).resolve().parents[3] / "docs" / "dlp.md"


def test_names_and_sets() -> None:
    assert all(re.fullmatch(r"[a-z][a-z0-9-]*", n) and DETECTORS[n] for n in DETECTORS)
    assert set(DETECTORS) >= OPT_IN and "high-entropy" in OPT_IN
    assert tuple(n for n in DETECTORS if n not in OPT_IN) == DEFAULT


def test_every_detector_is_documented() -> None:
    text = DOCS.read_text()
    assert [n for n in DETECTORS if f"`{n}`" not in text] == []
