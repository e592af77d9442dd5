"""bench.scale_parts: its timers count only while switched on and leave the classes as they were;
the report puts each part's growth from 4 to 256 endpoints beside it."""

from __future__ import annotations

from typing import Any

from bench.scale_parts import PARTS, SIZES, PartTimer, render
from extproc.prefix.index import PrefixIndex


def test_the_timers_count_only_while_on_and_are_removed_after() -> None:
    original = PrefixIndex.__dict__["match"]
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3])
    timer = PartTimer()
    with timer.installed():
        assert PrefixIndex.__dict__["match"] is not original
        index.match([1, 2], ["a"])  # before `enable`: the warm-up, not counted
        timer.enable()
        assert index.match([1, 2], ["a"]) == {"a": 2}  # the wrapped method still answers
        assert index.match([1, 9], ["a"]) == {"a": 1}
        timer.disable()
        index.match([1], ["a"])
    assert PrefixIndex.__dict__["match"] is original
    assert timer.calls["index lookup"] == 2 and timer.seconds["index lookup"] > 0.0
    assert timer.calls["scoring"] == 0


def _row(endpoints: int, rep: int, cpu: float, scoring: float) -> dict[str, Any]:
    parts = {label: 1.0 for _, _, label in PARTS}
    parts["scoring"] = scoring
    return {"endpoints": endpoints, "tokens": 1000, "requests": 10, "repetition": rep,
            "cpu_us_per_request": cpu, "scored": min(endpoints, 32), "parts_us": parts,
            "calls_per_request": {label: 1.0 for _, _, label in PARTS}}


def test_the_report_gives_each_part_its_growth_on_the_means() -> None:
    assert SIZES == (4, 256)
    rows = [_row(4, 1, 300.0, 40.0), _row(256, 1, 500.0, 120.0),
            _row(4, 2, 340.0, 44.0), _row(256, 2, 560.0, 140.0)]
    md = render(rows, [1000], 2)
    assert "| **CPU per request** | 320.0 (300.0-340.0) | 530.0 (500.0-560.0) | +210 (x1.66) |" in md
    assert "| scoring | 42.0 (40.0-44.0) | 130.0 (120.0-140.0) | +88 |" in md
    assert "| index lookup | 1.0 (1.0-1.0) | 1.0 (1.0-1.0) | +0 |" in md
    assert "10.5 us at 4, 4.1 us at 256" in md  # 42 / 4 and 130 / 32
