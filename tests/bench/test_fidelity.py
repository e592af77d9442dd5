"""bench.fidelity: the fitted cost profile and the real-vs-simulated table (no engine needed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.fidelity import fit_line, profile_of, rows
from bench.lib import sim_vllm


def test_fit_line_recovers_a_line() -> None:
    a, b = fit_line([0, 1000, 2000, 3000], [5.0, 29.0, 53.0, 77.0])
    assert a == pytest.approx(5.0) and b == pytest.approx(0.024)


def test_profile_maps_measurements_onto_the_simulators_cost_model() -> None:
    m = {"cold_ttft_ms": [(n, 12.0 + 0.03 * n) for n in (500, 1000, 2000, 3000)],
         "warm_ttft_ms": [(6, 12.18), (6, 12.18)], "decode_ms_1": [2.0, 2.2, 2.1], "decode_ms_4": [2.7, 2.7, 2.7]}
    p = profile_of(m)
    assert p["prefill_time_per_token"] == pytest.approx(0.03)
    assert p["inter_token_latency"] == pytest.approx(2.1)
    assert p["prefill_overhead"] == pytest.approx(12.0 - 2.1)  # the rest of a first token's fixed cost
    assert p["decode_time_per_seq"] == pytest.approx(0.2)  # (2.7 - 2.1) / 3 extra sequences
    flags = sim_vllm.sim_flags(p)
    assert flags[flags.index("--prefill-time-per-token") + 1] == str(p["prefill_time_per_token"])


def test_settings_give_the_simulator_and_the_picker_the_models_tokenizer(tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer.json"
    s = sim_vllm.settings(tok, {"inter_token_latency": 2, "decode_time_per_seq": 0.2, "prefill_time_per_token": 0.03,
                                "prefill_overhead": 8})
    assert (s.replicas, s.kv_cache_blocks, s.block_size) == (2, 511, 32)  # vLLM's 512 less its null block
    assert s.sim_args[-2:] == ("--tokenizer", str(tok)) and "--prefill-overhead" in s.sim_args
    assert s.picker_args == ("--tokenizer", str(tok), "--kv-events-block-size", "32")


def test_rows_compare_the_engines_hit_rate_and_flag_the_bounds() -> None:
    def result(hit: float, p50: float, p90: float, **extra: float) -> dict[str, object]:
        return {"hit_rate": hit, "ttft_ms": {"p50": p50, "p90": p90}, **extra}

    real = {"results": {"w": {"a": result(0.5, 100, 200, engine_hit_rate=0.6), "b": result(0.4, 100, 200),
                              "only-real": result(0.1, 1, 2)}}}
    sim = {"results": {"w": {"a": result(0.62, 110, 150), "b": result(0.3, 100, 200)}}}
    out = {r["router"]: r for r in rows(real, sim)}
    assert set(out) == {"a", "b"}
    assert out["a"]["hit_real"] == 0.6 and out["a"]["hit_err"] == pytest.approx(0.02)
    assert out["a"]["ttft_p50_err"] == pytest.approx(0.1) and out["a"]["ttft_p90_err"] == pytest.approx(-0.25)
    assert out["a"]["hit_within"] and out["a"]["ttft_within"]
    assert not out["b"]["hit_within"] and out["b"]["ttft_within"]  # b: 10 points off a 40% hit rate
    assert not math.isnan(out["b"]["ttft_p50_err"])
