"""bench.lib.aggregate on hand-made summaries, and the repeated run's files (json, md, render-only, CLI)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import run
from bench.lib.aggregate import aggregate, cell, mean_row, spread_row
from bench.lib.client import RequestResult, RunResult
from bench.lib.oracle import OracleResult
from bench.lib.report import render_only, runs_dir, write_results
from bench.lib.runner import Outcome, RouterSpec
from bench.lib.tables import clairvoyant_table, fmt, results_table
from bench.run import DEFAULT_ROUTERS, candidates_of, main
from testkit.bench_rows import summary

REP1 = {"w": {"a": summary(0.6, 1800.0, {"x:1": 6, "x:2": 4}, 0.5), "b": summary(0.2, 900.0, {"x:1": 5, "x:2": 5})}}
REP2 = {"w": {"a": summary(0.7, 2100.0, {"y:1": 2, "y:2": 8}, 0.7), "b": summary(0.3, 1200.0, {"y:1": 5, "y:2": 5})}}
REP3 = {"w": {"a": summary(0.8, 1900.0, {"z:1": 7, "z:2": 3}, 0.6)}, "v": {"a": summary(0.5, 100.0, {"z:1": 1})}}


def test_mean_and_min_max_over_repetitions() -> None:
    means, spreads = aggregate([REP1, REP2, REP3])
    a = means["w"]["a"]
    assert a["hit_rate"] == pytest.approx(0.7)
    assert a["ttft_ms"]["p99"] == pytest.approx((1800 + 2100 + 1900) / 3)
    assert a["e2e_ms"]["p99"] == pytest.approx(5800.0)
    assert a["decision_ms"]["p50"] == pytest.approx(0.6)
    assert a["replica_max_over_mean"] == pytest.approx((1.2 + 1.6 + 1.4) / 3)
    # Replica addresses differ between runs: counts are averaged by rank, busiest first.
    assert a["requests_per_replica"] == {"#1": pytest.approx(7.0), "#2": pytest.approx(3.0)}
    assert spreads["w"]["a"]["ttft_ms.p99"] == (1800.0, 2100.0)
    assert spreads["w"]["a"]["hit_rate"] == (0.6, 0.8)
    assert spreads["w"]["a"]["decision_ms.p99"] == (1.0, 1.4)
    # A pair some repetition did not run is averaged over the ones that did.
    assert means["w"]["b"]["hit_rate"] == pytest.approx(0.25) and spreads["w"]["b"]["hit_rate"] == (0.2, 0.3)
    assert "decision_ms.p50" not in spreads["w"]["b"]
    assert list(means) == ["w", "v"] and means["v"]["a"]["hit_rate"] == 0.5


def test_nan_stays_nan_and_one_row_is_itself() -> None:
    rows = [summary(0.5, math.nan, {"a": 1}), summary(0.5, 100.0, {"a": 1})]
    assert math.isnan(mean_row(rows)["ttft_ms"]["p99"])
    one = summary(0.4, 50.0, {"a": 2, "b": 1})
    assert mean_row([one])["ttft_ms"] == one["ttft_ms"]
    assert spread_row([one])["hit_rate"] == (0.4, 0.4)
    with pytest.raises(ValueError):
        mean_row([])


def test_cell_shows_the_range() -> None:
    assert cell(1914.2, (1850.0, 2010.4), fmt) == "1,914 (1,850-2,010)"
    assert cell(1914.2, None, fmt) == "1,914"


ORACLE = {"w": OracleResult(1000, 800, 10, 5), "v": OracleResult(100, 50, 1, 1)}


def test_repeated_results_files_and_render_only(tmp_path: Path) -> None:
    config = {"replicas": 2, "time_scale": 1.0, "raw_names": ["t-r1", "t-r2", "t-r3"]}
    raw = tmp_path / "raw"
    raw.mkdir()
    for k in (1, 2, 3):
        (raw / f"t-r{k}.w.a.json").write_text(json.dumps([{"status": 200, "error": "", "ttft_s": 0.1 * k}]))
    targets = write_results(tmp_path, "t", config, ORACLE, [REP1, REP2, REP3], {"w": {"a": [100.0]}}, ["a"])
    assert targets == {"a": []}  # no goal is defined for workload "w"
    doc = json.loads((tmp_path / "t.json").read_text())
    assert len(doc["repetitions"]) == 3 and doc["repetitions"][1] == REP2
    assert doc["results"]["w"]["a"]["hit_rate"] == pytest.approx(0.7)
    assert doc["spread"]["w"]["a"]["ttft_ms.p99"] == [1800.0, 2100.0]
    md = (tmp_path / "t.md").read_text()
    assert "mean (min-max) of 3 repetitions" in md
    assert "| w | a | 70.0% (60.0%-80.0%) |" in md
    assert "1,933 (1,800-2,100)" in md  # TTFT p99
    for kind in ("ttft", "hit_rate", "ttft_p99", "load"):
        assert (tmp_path / f"t-{kind}.png").stat().st_size > 0
    (tmp_path / "t.md").unlink()
    render_only(tmp_path, "t")
    assert (tmp_path / "t.md").read_text() == md
    assert main(["--render-only", "--out-dir", str(tmp_path), "--name", "t"]) == 0


def test_each_repetition_report_goes_under_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(*_args: object, **_kwargs: object) -> Outcome:
        answered = RequestResult(0, 0, "x", 0.0, 0.0, 200, 0.1, 1.0, 100, 0, 10, "x:1", "")
        return Outcome(summary(0.5, 1000.0, {"x:1": 3, "x:2": 2}), RunResult([answered], 1.0))

    monkeypatch.setattr(run, "run_retrying", fake_run)
    run.run_all(["no-reuse"], [RouterSpec("random")], quick=True, replicas=2, load=1.0, time_scale=1.0,
                out_dir=tmp_path, name="t", log=lambda line: None, repeat=2)
    runs = runs_dir(tmp_path)
    assert runs == tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == sorted(
        f"t-r{k}{kind}" for k in (1, 2) for kind in (".json", ".md", "-ttft.png", "-hit_rate.png", "-ttft_p99.png",
                                                      "-load.png"))
    assert sorted(p.name for p in tmp_path.glob("t*")) == sorted(
        f"t{kind}" for kind in (".json", ".md", "-ttft.png", "-hit_rate.png", "-ttft_p99.png", "-load.png"))
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["t-r1.no-reuse.random.json",
                                                                    "t-r2.no-reuse.random.json"]
    assert json.loads((tmp_path / "t.json").read_text())["config"]["raw_names"] == ["t-r1", "t-r2"]


def test_render_only_rewrites_a_repetition_report_where_it_lies(tmp_path: Path) -> None:
    runs = runs_dir(tmp_path)
    config = {"replicas": 2, "time_scale": 1.0, "raw_names": ["t-r2"]}
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "t-r2.w.a.json").write_text(json.dumps([{"status": 200, "error": "", "ttft_s": 0.1}]))
    write_results(runs, "t-r2", config, ORACLE, [REP2], {"w": {"a": [100.0]}}, ["a"])
    md = (runs / "t-r2.md").read_text()
    (runs / "t-r2.md").unlink()
    assert render_only(tmp_path, "t-r2") == runs
    assert (runs / "t-r2.md").read_text() == md
    assert not list(tmp_path.glob("t-r2*"))
    assert main(["--render-only", "--out-dir", str(tmp_path), "--name", "t-r2"]) == 0


def test_one_repetition_has_no_range_and_clairvoyant_table() -> None:
    rep = {"w": {"prefix-epp": summary(0.6, 1000.0, {"a": 1}), "clairvoyant": summary(0.8, 500.0, {"a": 1})}}
    means, _ = aggregate([rep])
    assert "(" not in results_table(means, {"w": 0.8}).split("\n")[3]
    assert "| w | prefix-epp | 0.75 | 2.00 |" in clairvoyant_table(means)
    assert clairvoyant_table({"w": {"prefix-epp": rep["w"]["prefix-epp"]}}) == ""  # no reference run


def test_default_matrix_and_goal_candidates() -> None:
    assert DEFAULT_ROUTERS == ("random", "round-robin", "least-request", "prefix-epp", "prefix-epp-cache-aware",
                               "prefix-epp-weighted", "sglang-router", "clairvoyant")
    # The reference policy is what the candidates are compared with, not a candidate.
    assert candidates_of([*DEFAULT_ROUTERS, "prefix-epp --spill-absolute 2"]) == [
        "prefix-epp", "prefix-epp-weighted", "prefix-epp --spill-absolute 2"]
    assert "--repeat 3" in (Path(__file__).parents[2] / "Makefile").read_text()
