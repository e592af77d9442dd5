"""bench.replicas' summary and table: partial runs (a subset of configurations or workloads, any
worker counts) render, and each cell is the median and range of the runs it names."""

from __future__ import annotations

from typing import Any

from bench.replicas import summarize, table


def _row(config: str, n: int, sync: bool, workload: str, seed: int, hit: float) -> dict[str, Any]:
    return {"config": config, "pickers": n, "sync": sync, "workload": workload, "seed": seed, "hit_rate": hit,
            "hit_rate_per_gateway": [hit] * n, "picker_cpu_ms_per_request": 1.0,
            "sync_bytes_per_request_per_link": 100.0 if sync else 0.0,
            "sync_bytes_per_request_per_picker": 700.0 if sync else 0.0}


def test_a_configuration_run_on_one_workload_only_renders_where_it_ran() -> None:
    rows = [_row("1", 1, False, "shared-prefix", s, h) for s, h in enumerate((0.6, 0.65, 0.7))]
    rows += [_row("8 synced", 8, True, "shared-prefix", 0, 0.66), _row("1", 1, False, "multi-turn", 0, 0.8)]
    summary = summarize({"hit_rate": rows, "workers": [], "snapshot": []})
    assert summary["hit_rate"]["shared-prefix"]["1"] == {"median": 0.65, "min": 0.6, "max": 0.7}
    assert "8 synced" not in summary["hit_rate"]["multi-turn"]
    text = table(summary)
    assert "| 8 synced | shared-prefix | 0.660 (0.660-0.660) |" in text
    assert "| 8 synced | multi-turn |" not in text
    assert "| 1 | multi-turn | 0.800 (0.800-0.800) |" in text


def test_every_worker_count_that_ran_gets_a_row() -> None:
    runs = [{"workers": n, "rps": 100.0 * n + r} for n in (1, 2, 4, 8) for r in (0, 10, 20)]
    summary = summarize({"hit_rate": [], "workers": runs, "snapshot": []})
    assert list(summary["workers_rps"]) == ["1", "2", "4", "8"]
    assert summary["workers_rps"]["8"] == {"median": 810.0, "min": 800.0, "max": 820.0}
    assert "| 8 | 810 (800-820) |" in table(summary)
