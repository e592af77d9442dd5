"""bench.ablation: the mechanisms' arms, the paired ratio, and a tiny real matrix on the simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import ablation
from bench.lib.ablation import MECHANISMS, ON, arms, paired_ratio, picker_args
from bench.lib.workloads import WORKLOADS
from extproc.config.flags import FLAGS
from extproc.config.settings import ABLATIONS


def test_every_switch_is_a_mechanism_and_every_flag_it_uses_exists() -> None:
    assert set(ABLATIONS) <= set(MECHANISMS)
    names = {f.name for f in FLAGS}
    for m in MECHANISMS.values():
        assert m.off[0].split("=")[0] in names, m.name
        assert m.workloads and set(m.workloads) <= set(WORKLOADS), m.name
    assert picker_args("pins") == ("--ablate", "pins") and picker_args(ON) == ()
    assert arms("cache-pressure", ["pins", "bounded-reuse", "eviction-charge"]) == [ON, "pins", "eviction-charge"]


def test_paired_ratio_is_the_geometric_mean_with_a_t_interval() -> None:
    r = paired_ratio([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
    assert [r.mean, r.lo, r.hi] == pytest.approx([2.0, 2.0, 2.0]) and r.n == 3
    r = paired_ratio([2.0, 0.5], [1.0, 1.0])  # x2 and x0.5: centred on 1, a wide interval
    assert r.mean == pytest.approx(1.0) and r.lo < 0.01 and r.hi > 100
    # log ratios 0.2, 0.3, 0.4: mean 0.3, sd 0.1, t(0.975, 2) = 4.303: the interval excludes 1
    r = paired_ratio([math.exp(0.2), math.exp(0.3), math.exp(0.4)], [1.0, 1.0, 1.0])
    assert math.log(r.lo) == pytest.approx(0.3 - 4.303 * 0.1 / math.sqrt(3))
    assert math.log(r.hi) == pytest.approx(0.3 + 4.303 * 0.1 / math.sqrt(3))
    assert r.verdict(higher_is_better=False) == "pays" and r.verdict(higher_is_better=True) == "costs"
    one = paired_ratio([3.0], [1.0])
    assert one.mean == pytest.approx(3.0) and math.isnan(one.lo) and one.verdict(False) == ""
    assert paired_ratio([0.0, math.nan], [1.0, 1.0]).n == 0


def test_ratios_pair_each_arm_with_the_default_of_its_seed() -> None:
    runs = [{"profile": "default", "workload": "w", "seed": s, "arm": arm, "ttft_p50": v, "ttft_p99": 2 * v,
             "hit_rate": 0.5, "cpu_busy": 0.5}
            for s, (on, off) in enumerate(((100.0, 150.0), (200.0, 300.0), (50.0, 75.0)))
            for arm, v in ((ON, on), ("pins", off))]
    (row,) = ablation.ratios(runs)
    assert row["mechanism"] == "pins" and row["n"] == 3
    assert row["ttft_p50"]["mean"] == pytest.approx(1.5) and row["ttft_p99"]["lo"] == pytest.approx(1.5)
    assert row["hit_rate"]["mean"] == pytest.approx(1.0)
    text = ablation.render({"config": {"command": "c", "date": "d", "replicas": 4, "time_scale": 1.0,
                                       "quick": True}, "runs": runs, "ratios": [row]})
    assert "| pins | default | w | 3 | 1.50 (1.50-1.50) | 1.50 (1.50-1.50) | 1.00 (1.00-1.00) | pays |" in text


def test_a_tiny_matrix_runs_on_the_simulator(tmp_path: Path) -> None:
    """One mechanism, one replica model, one workload, one seed: the default and the picker with
    its blocks unpinned, each a real run (simulated replicas, Envoy, the picker)."""
    assert ablation.main(["--mechanisms", "pins", "--profiles", "default", "--workloads", "multi-turn",
                          "--repeat", "1", "--quick", "--time-scale", "4", "--out-dir", str(tmp_path),
                          "--name", "t"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert [(r["arm"], r["workload"], r["seed"]) for r in data["runs"]] == [(ON, "multi-turn", 0),
                                                                           ("pins", "multi-turn", 0)]
    assert all(r["hit_rate"] > 0 and r["ttft_p99"] > 0 for r in data["runs"])
    (row,) = data["ratios"]
    assert row["mechanism"] == "pins" and row["n"] == 1 and row["ttft_p99"]["mean"] > 0
    assert "| pins | default | multi-turn | 1 |" in (tmp_path / "t.md").read_text()
    assert data["config"]["arms"] == {"pins": ["--ablate", "pins"]}
