"""bench.scale's bookkeeping: repetitions merge by their key fields, and the report checks the
targets on the means and writes its plots."""

from __future__ import annotations

from pathlib import Path

from bench.scale import combine
from bench.scale_report import render


def test_repetitions_merge_by_key_into_mean_min_max() -> None:
    runs = [[{"mode": "approximate", "endpoints": 4, "tokens": 8000, "p99_ms": 1.0}],
            [{"mode": "approximate", "endpoints": 4, "tokens": 8000, "p99_ms": 3.0}],
            [{"mode": "precise", "endpoints": 4, "tokens": 8000, "p99_ms": 5.0}]]
    merged = combine(runs, ("mode", "endpoints", "tokens"))
    assert merged[0] == {"mode": "approximate", "endpoints": 4, "tokens": 8000,
                         "p99_ms": {"mean": 2.0, "min": 1.0, "max": 3.0}, "reps": 2}
    assert merged[1]["reps"] == 1


def _cell(mode: str, endpoints: int, tokens: int, p99: float, cpu: float) -> dict[str, object]:
    one = {"mean": 0.0, "min": 0.0, "max": 0.0}
    return {"mode": mode, "endpoints": endpoints, "tokens": tokens, "body_kb": one, "p50_ms": one,
            "p99_ms": {"mean": p99, "min": p99, "max": p99},
            "cpu_ms_per_request": {"mean": cpu, "min": cpu, "max": cpu}, "reps": 3}


def test_the_report_checks_the_targets_and_writes_its_plots(tmp_path: Path) -> None:
    doc = {"decision": [_cell("approximate", 4, 8000, 0.5, 1.0), _cell("approximate", 256, 8000, 1.5, 2.0),
                        _cell("approximate", 256, 128000, 12.0, 9.0)],
           "scrape": [{"endpoints": 256, "design": "budgeted", "core_share": {"mean": 0.2, "min": 0.2, "max": 0.2},
                       "reps": 1}]}
    for field in ("scrapes_per_s", "planned_per_s", "cpu_ms_per_scrape", "interval_ms", "age_mean_ms", "age_p99_ms"):
        doc["scrape"][0][field] = 1.0
    md = render(doc, tmp_path)
    assert "| approximate: decision p99 at 256 endpoints, 8k tokens (ms) | 1.5 | 2 | yes |" in md
    assert "| approximate: decision p99 at 256 endpoints, 128k tokens (ms) | 12 | 10 | **no** |" in md
    assert "| approximate: CPU per request, 256 / 4 endpoints, 8k tokens | 2 | 1.5 | **no** |" in md
    assert "| scraping 256 endpoints, budgeted (share of a core) | 0.2 | 0.25 | yes |" in md
    assert "| precise: decision p99 at 256 endpoints, 8k tokens (ms) | not measured | 2 | n/a |" in md
    assert (tmp_path / "scale-decision.png").stat().st_size > 0 and (tmp_path / "scale-scrape.png").stat().st_size > 0
