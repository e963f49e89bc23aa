"""The console's server-drawn SVG bar charts (`api/console/chart.py`): scale, bars and
their hover titles, labels, the accessible name, escaping, the empty chart."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from gateway.api.console.chart import Bar, bar_chart, nice_ceiling

NS = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize(("value", "expected"), [
    (0, 1), (-3, 1), (0.3, 0.5), (1, 1), (1.01, 2), (7, 10), (12, 20), (230, 250),
    (999, 1000), (1001, 2000), (0.0021, 0.0025), (45_000, 50_000),
])
def test_nice_ceiling(value: float, expected: float) -> None:
    assert nice_ceiling(value) == pytest.approx(expected)


def chart(bars: list[Bar], series: tuple[str, ...] = ("input", "output")) -> ET.Element:
    svg = bar_chart(bars, label="Tokens per hour", series=series, fmt=lambda v: f"{v:g}",
                    width=400, height=200)
    assert "style" not in svg  # (the CSP allows no inline styles)
    return ET.fromstring(svg)


def bars_of(root: ET.Element) -> list[ET.Element]:
    return root.findall(f"{NS}g[@class='bar']")


def test_bars_are_stacked_to_scale_with_a_title_each() -> None:
    root = chart([Bar("10:00", "10:00: 30 in, 10 out", (30, 10)), Bar("11:00", "empty", (0, 0)),
                  Bar("12:00", "12:00: 80 in", (80, 0))])
    assert root.get("role") == "img" and root.get("aria-label") == "Tokens per hour"
    assert root.find(f"{NS}title") is not None
    drawn = bars_of(root)
    assert [g.findtext(f"{NS}title") for g in drawn] == ["10:00: 30 in, 10 out",
                                                         "12:00: 80 in"]
    plot = 200 - 24 - 22  # height minus the margins
    first = drawn[0].findall(f"{NS}rect")
    assert [r.get("class") for r in first] == ["s0", "s1"]
    heights = [float(r.get("height", 0)) for r in first]
    assert heights == pytest.approx([plot * 30 / 100, plot * 10 / 100], abs=0.01)
    # stacked: the output part sits on the input part
    assert float(first[1].get("y", 0)) + heights[1] == pytest.approx(float(first[0].get("y", 0)))
    assert float(drawn[1].find(f"{NS}rect").get("height", 0)) == pytest.approx(  # type: ignore[union-attr]
        plot * 0.8, abs=0.01)
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert texts[:3] == ["0", "50", "100"]  # the y axis, up to a round top
    assert {"input", "output", "10:00", "11:00", "12:00"} <= set(texts)


@pytest.mark.parametrize(("count", "labels"), [(3, 3), (24, 8), (168, 8), (169, 8)])
def test_at_most_eight_x_labels(count: int, labels: int) -> None:
    root = chart([Bar(f"{i}", f"bar {i}", (1.0,)) for i in range(count)], ("cost",))
    shown = [t for t in root.iter(f"{NS}text") if t.get("y") == "194"]
    assert len(shown) == labels
    assert len(bars_of(root)) == count


def test_text_is_escaped() -> None:
    svg = bar_chart([Bar("<b>", "<script>alert(1)</script> & co", (1,))],
                    label='a "chart" <of> things', series=("x",), fmt=str)
    assert "<script>" not in svg and "<b>" not in svg
    root = ET.fromstring(svg)
    assert bars_of(root)[0].findtext(f"{NS}title") == "<script>alert(1)</script> & co"
    assert root.get("aria-label") == 'a "chart" <of> things'


def test_an_empty_span_says_so() -> None:
    root = chart([Bar("10:00", "none", (0, 0))] * 5)
    assert bars_of(root) == []
    assert "no use in this span" in [t.text for t in root.iter(f"{NS}text")]
    assert chart([]).get("role") == "img"
