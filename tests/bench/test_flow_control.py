"""The flow-control benchmark (bench/flow_control.py) end to end at a tiny size: two simulated
replicas of 4 slots each, real Envoy and a picker per arm, every arm once for 3 s of sending.

Its report must hold what the published runs need (every arm, the interactive TTFT, the batch's
completion, the engines' readings, the picker's outcomes) and show the basic contrast: without
flow control the engines queue what their slots cannot run and the interactive tenant waits
behind the batch; the concurrency gate keeps each engine within its slots; round-robin lets the
interactive tenant through before the batch held ahead of it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.flow_control import arm_config, main
from bench.lib.flow_report import ARMS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

SLOTS = 4  # the simulator's default --slots


def test_arm_configs_differ_only_in_flow_control() -> None:
    off, fifo, rr, gate = (arm_config(a, SLOTS) for a in ("off", "fifo", "round-robin", "gate"))
    assert arm_config("unloaded", SLOTS) == off and "flowControl" not in off
    assert all("featureGates: [flowControl]" in c and "inflight-load-scorer" in c for c in (fifo, rr, gate))
    assert f"maxConcurrency: {SLOTS}" in fifo and "fairnessPolicyRef: global-strict-fairness-policy" in fifo
    assert rr == fifo.replace("global-strict-fairness-policy", "round-robin-fairness-policy")
    assert "pluginRef: utilization-detector" in gate and "parameters" not in gate  # its defaults


def test_the_benchmark_end_to_end_on_the_simulator(tmp_path: Path) -> None:
    out = tmp_path / "flow"
    assert main(["--repeat", "1", "--seconds", "3", "--warmup", "1", "--drain", "30", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    runs = {r["arm"]: r for r in data["runs"]}
    assert list(runs) == list(ARMS) and sorted(r["position"] for r in runs.values()) == list(range(len(ARMS)))
    for arm, r in runs.items():
        i, b = r["interactive"], r["batch"]
        assert r["problems"] == [], (arm, r["problems"])
        assert i["sent"] >= 6 and i["ok"] == i["sent"], (arm, i)  # 4/s over the 2 s after the warm-up
        assert 0 < i["ttft_p50_ms"] <= i["ttft_p99_ms"], (arm, i)
        assert all(e["reads"] > 0 for e in r["engines"]) and len(r["engines"]) == 2, arm
        if arm == "unloaded":
            assert b["sent"] == 0 and r["picker_outcomes"] == {}
            continue
        assert b["sent"] >= 32 and b["completed"] >= 0.95 and b["rps"] > 0, (arm, b)
        if arm == "off":
            assert "Dispatched" not in r["picker_outcomes"]
        else:  # everything the tenants got went through flow control (and the stack's probe)
            assert r["picker_outcomes"]["Dispatched"] >= b["ok"] + i["ok"] + 1, (arm, r["picker_outcomes"])
    # 32 batch requests on 2 x 4 slots: without a gate each engine queues ~12; the concurrency gate
    # keeps each within its 4 (a request waits for the engine's next step at most).
    assert runs["off"]["max_waiting"] > SLOTS
    assert runs["fifo"]["max_waiting"] <= SLOTS and runs["round-robin"]["max_waiting"] <= SLOTS
    assert runs["round-robin"]["interactive"]["ttft_p50_ms"] < runs["off"]["interactive"]["ttft_p50_ms"]
    held = runs["round-robin"]["picker_outcomes"]
    assert held["held_ms interactive"] < held["held_ms batch"]

    agg = data["aggregate"]
    assert set(agg) == set(ARMS) and agg["off"]["p99_vs_off"]["ratio"] == pytest.approx(1.0)
    assert agg["round-robin"]["p99_vs_off"]["n"] == 1 and math.isnan(agg["round-robin"]["p99_vs_off"]["low"])
    assert [v[0][:20] for v in data["verdicts"]] == ["interactive TTFT p99", "interactive TTFT p99",
                                                     "batch completed with", "gate: every engine's"]
    report = out.with_suffix(".md").read_text()
    for heading in ("## Interactive TTFT and the batch", "## Overshoot", "## The criteria of issue 68", "## Every run"):
        assert heading in report
    assert all(f"| {arm} |" in report for arm in ARMS)
    assert data["command"].startswith("python -m bench.flow_control --repeat 1")
