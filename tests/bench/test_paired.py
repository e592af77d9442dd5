"""The path-fair comparison of bench.run: arms interleaved and rotated within each repetition,
every arm paired with the reference arm by repetition (bench.lib.aggregate.paired_figures), and
the report's paired-ratio and path tables, from the run loop to the files and back (render-only)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import run
from bench.lib.aggregate import paired_figures
from bench.lib.cache_bound import BlockTrace
from bench.lib.client import RequestResult, RunResult
from bench.lib.draws import Draw
from bench.lib.oracle import OracleResult
from bench.lib.report import render_only
from bench.lib.routers import SimSettings
from bench.lib.runner import Outcome, RouterSpec
from bench.lib.tables import paired_cell, path_table
from bench.lib.workloads import build
from testkit.bench_rows import summary


def test_every_arm_runs_once_in_every_position_and_workloads_start_apart() -> None:
    arms = ["a", "b", "c"]
    orders = [run.arm_order(arms, k) for k in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for arm in arms:
        assert sorted(order.index(arm) for order in orders) == [0, 1, 2]
    # The next workload of a repetition starts one arm further on.
    assert run.arm_order(arms, 0, workload=1) == ["b", "c", "a"]
    assert run.arm_order(arms, 4, workload=2) == run.arm_order(arms, 0)
    assert run.arm_order([], 3) == []


REFERENCE = "prefix-epp-cache-aware"
# Per repetition, TTFT p99 of each arm: prefix-epp steadily 10% under the reference, round-robin
# all over the place around it.
P99 = {REFERENCE: [1000.0, 1200.0, 800.0], "prefix-epp": [900.0, 1080.0, 720.0],
       "round-robin": [700.0, 1800.0, 900.0]}
HIT = {REFERENCE: 0.5, "prefix-epp": 0.5, "round-robin": 0.25}


def _draw() -> Draw:
    wl = build("no-reuse", quick=True)
    return Draw({w: wl for w in ("w1", "w2")}, {w: OracleResult(100, 50, 10, 5) for w in ("w1", "w2")},
                    {w: SimSettings(replicas=2, kv_cache_blocks=64) for w in ("w1", "w2")},
                    {w: {(0, 0): BlockTrace(100, 16, (), ())} for w in ("w1", "w2")})


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, str]]]:
    """3 arms x 2 workloads x 3 repetitions through bench.run's loop, each run a fixed summary:
    (the results folder, the (workload, arm) of each run in the order they ran)."""
    tmp_path = tmp_path_factory.mktemp("paired")
    calls: list[tuple[str, str]] = []

    def fake_run(tmp: Path, _w: object, router: RouterSpec, _sim: object, _log: object,
                 backend: object = None) -> Outcome:
        workload = tmp.name.split("-")[0]
        k = sum(1 for w, r in calls if w == workload and r == router.label)  # the repetition, from 0
        calls.append((workload, router.label))
        row = summary(HIT[router.label], P99[router.label][k], {"x:1": 5, "x:2": 5})
        if router.name != "round-robin":
            row["gateway_ms"] = {"mean": 2.0, "p50": 1.0 + k, "p99": 10.0 * (k + 1)}
        answered = RequestResult(0, 0, "x", 0.0, 0.0, 200, 0.1, 1.0, 100, 50, 10, "x:1", "")
        return Outcome(row, RunResult([answered], 1.0))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Draw, "of", classmethod(lambda cls, *a, **k: _draw()))
        patch.setattr(run, "run_retrying", fake_run)
        routers = [RouterSpec(r) for r in ("prefix-epp", REFERENCE, "round-robin")]
        run.run_all(["w1", "w2"], routers, quick=True, replicas=2, load=1.0, time_scale=1.0, out_dir=tmp_path,
                    name="t", log=lambda line: None, repeat=3, reference=REFERENCE)
    return tmp_path, calls


def test_arms_interleave_within_each_repetition_and_the_order_rotates(
        matrix: tuple[Path, list[tuple[str, str]]]) -> None:
    tmp_path, calls = matrix
    pe, ca, rr = "prefix-epp", REFERENCE, "round-robin"
    assert calls == [("w1", pe), ("w1", ca), ("w1", rr), ("w2", ca), ("w2", rr), ("w2", pe),  # repetition 1
                     ("w1", ca), ("w1", rr), ("w1", pe), ("w2", rr), ("w2", pe), ("w2", ca),  # repetition 2
                     ("w1", rr), ("w1", pe), ("w1", ca), ("w2", pe), ("w2", ca), ("w2", rr)]  # repetition 3
    doc = json.loads((tmp_path / "t.json").read_text())
    # Rows keep the given order, whichever arm ran first; each says where it ran.
    assert all(list(rep[w]) == [pe, ca, rr] for rep in doc["repetitions"] for w in ("w1", "w2"))
    assert [rep["w2"][pe]["position"] for rep in doc["repetitions"]] == [3, 2, 1]
    assert doc["config"]["reference"] == REFERENCE and "rotated" in doc["config"]["order"]


def test_the_report_pairs_every_arm_with_the_reference_by_repetition(
        matrix: tuple[Path, list[tuple[str, str]]]) -> None:
    tmp_path, _ = matrix
    doc = json.loads((tmp_path / "t.json").read_text())
    figures = doc["paired"]["figures"]["w1"]
    assert doc["paired"]["reference"] == REFERENCE
    steady = figures["prefix-epp"]["ttft_ms.p99"]
    assert steady["mean"] == pytest.approx(900.0) and steady["ratio"] == pytest.approx(0.9)
    assert steady["low"] == pytest.approx(0.9) and steady["high"] == pytest.approx(0.9)  # no spread
    assert steady["n"] == 3 and steady["verdict"] == "better"
    noisy = figures["round-robin"]["ttft_ms.p99"]
    assert noisy["ratio"] == pytest.approx((0.7 * 1.5 * 1.125) ** (1 / 3))
    assert noisy["low"] < 1 < noisy["high"] and noisy["verdict"] == ""
    assert figures["round-robin"]["hit_rate"]["verdict"] == "worse"  # half the reference's, every time
    assert "gateway_ms.p99" not in figures["round-robin"]  # Envoy's log: none in this fake setup
    assert figures[REFERENCE]["ttft_ms.p99"] == {"mean": pytest.approx(1000.0)}  # its own means only
    md = (tmp_path / "t.md").read_text()
    assert f"Against the reference arm `{REFERENCE}`, paired by repetition" in md
    assert f"| w1 | {REFERENCE} (reference) | 50.0% |" in md
    assert "| 900 x0.900 [0.900-0.900] **better** |" in md
    # Rendering again from the JSON gives the same report.
    (tmp_path / "t.md").unlink()
    render_only(tmp_path, "t")
    assert (tmp_path / "t.md").read_text() == md


def test_paired_figures_leave_out_workloads_without_the_reference() -> None:
    reps = [{"w": {"a": summary(0.5, 100.0, {"x": 1}), "r": summary(0.5, 200.0, {"x": 1})},
             "v": {"a": summary(0.5, 100.0, {"x": 1})}}]
    figures = paired_figures(reps, "r")
    assert list(figures) == ["w"]
    one = figures["w"]["a"]["ttft_ms.p99"]
    assert one["ratio"] == pytest.approx(0.5) and one["n"] == 1 and math.isnan(one["low"]) and one["verdict"] == ""
    assert paired_figures(reps, "nobody") == {}


def test_the_path_table_shows_envoy_and_the_pickers_own_time() -> None:
    envoy: dict[str, Any] = {**summary(0.5, 100.0, {"x": 1}, 0.25), "gateway_ms": {"mean": 2, "p50": 0.8, "p99": 3.5}}
    proxy = summary(0.5, 100.0, {"x": 1})  # sglang-router: no Envoy, no picker histogram
    table = path_table({"w": {"prefix-epp": envoy, "sglang-router": proxy}},
                       {"w": {"prefix-epp": {"gateway_ms.p99": (3.0, 4.0)}}})
    header, rule, row = table.splitlines()
    assert header.count("|") == rule.count("|") == row.count("|")
    assert row == "| w | prefix-epp | 0.80 | 3.50 (3.00-4.00) | 0.25 | 0.50 | 1.50 |"
    assert path_table({"w": {"sglang-router": proxy}}) == ""


def test_an_interval_bound_near_one_is_never_printed_as_one() -> None:
    figure = {"mean": 455.0, "ratio": 0.996, "low": 0.99188, "high": 0.99961, "n": 2, "verdict": "better"}
    assert paired_cell("ttft_ms.p90", figure) == "455 x0.996 [0.992-0.9996] **better**"
    assert paired_cell("hit_rate", {"mean": 0.5}) == "50.0%"
    assert paired_cell("ttft_ms.p99", None) == "-"
