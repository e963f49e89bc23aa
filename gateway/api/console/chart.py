"""Bar charts as inline SVG, drawn on the server (pure): the console's pages show usage
over time without JavaScript, and the strict CSP (no inline styles) holds, as the SVG
carries only presentation attributes and CSS classes (`console.css`).

A chart is a row of (stacked) bars, one per bucket, with a y axis scaled to a round
maximum, a few x labels, a `<title>` per bar (hover text) and `role="img"` with an
`aria-label` saying what it shows; the page puts the same numbers in a table under it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Bar", "bar_chart", "nice_ceiling"]

_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 8, 24, 22  # margins: y labels, legend, x labels
_X_LABELS = 8  # at most this many x labels


@dataclass(frozen=True, slots=True)
class Bar:
    """One bucket: its x label (shown for some bars), its hover text, and its values,
    one per series, stacked bottom first."""

    label: str
    title: str
    parts: tuple[float, ...]


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= `value` (1 for 0)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * power * (1 + 1e-9):
            return step * power
    return 10 * power


def _n(value: float) -> str:
    """A coordinate, short."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def bar_chart(bars: Sequence[Bar], *, label: str, series: Sequence[str],
              fmt: Callable[[float], str], width: int = 720, height: int = 200) -> str:
    """The SVG of `bars` (`series`: the name of each stacked part, also its CSS class
    `s0`, `s1`...; `fmt`: a y value as text; `label`: what the chart shows, for screen
    readers)."""
    import xml.etree.ElementTree as ET  # (the console usage page only: ~0.5 MiB)

    svg = ET.Element("svg", {"xmlns": "http://www.w3.org/2000/svg", "class": "chart",
                             "viewBox": f"0 0 {width} {height}", "role": "img",
                             "aria-label": label, "width": "100%"})
    ET.SubElement(svg, "title").text = label
    plot_w, plot_h = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM
    top = nice_ceiling(max((sum(b.parts) for b in bars), default=0.0))
    axes = ET.SubElement(svg, "g", {"class": "axis", "aria-hidden": "true"})
    for i in range(3):  # 0, half, top
        value = top * i / 2
        y = _TOP + plot_h - plot_h * i / 2
        ET.SubElement(axes, "line", {"x1": _n(_LEFT), "x2": _n(width - _RIGHT),
                                     "y1": _n(y), "y2": _n(y),
                                     "class": "grid" if i else "base"})
        text = ET.SubElement(axes, "text", {"x": _n(_LEFT - 6), "y": _n(y + 4),
                                            "text-anchor": "end"})
        text.text = fmt(value)
    for i, name in enumerate(series):  # the legend, top right
        key_x = width - _RIGHT - 110 * (len(series) - i)
        ET.SubElement(axes, "rect", {"x": _n(key_x), "y": "4", "width": "10",
                                     "height": "10", "class": f"s{i}"})
        ET.SubElement(axes, "text", {"x": _n(key_x + 14), "y": "13"}).text = name
    if not any(any(b.parts) for b in bars):
        ET.SubElement(axes, "text", {"x": _n(_LEFT + plot_w / 2), "y": _n(_TOP + plot_h / 2),
                                     "text-anchor": "middle"}).text = "no use in this span"
    slot = plot_w / max(1, len(bars))
    every = max(1, math.ceil(len(bars) / _X_LABELS))
    for index, bar in enumerate(bars):
        x = _LEFT + index * slot
        if index % every == 0 and bar.label:
            ET.SubElement(axes, "text", {"x": _n(x), "y": _n(height - 6)}).text = bar.label
        if not any(bar.parts):
            continue
        group = ET.SubElement(svg, "g", {"class": "bar"})
        ET.SubElement(group, "title").text = bar.title
        base = float(_TOP + plot_h)
        for part, value in enumerate(bar.parts):
            if value <= 0:
                continue
            h = plot_h * value / top
            base -= h
            ET.SubElement(group, "rect", {"x": _n(x + slot * 0.1),
                                          "width": _n(max(1.0, slot * 0.8)),
                                          "y": _n(base), "height": _n(max(0.5, h)),
                                          "class": f"s{part}"})
    return ET.tostring(svg, encoding="unicode", short_empty_elements=True)
