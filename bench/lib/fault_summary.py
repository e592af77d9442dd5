"""What one fault scenario did to its traffic: the figures of the fault benchmark's report.

A `ScenarioRun` holds every request's `Outcome` (`bench.lib.fault_traffic`) and the fault's
timeline in seconds after the traffic began: `fault_start_s`, `fault_end_s` (None: the fault lasts
to the end of the run), the faulty replica's address (`faulty`, "" for a picker fault) and, after a
SIGTERM, the picker's exit status and seconds to exit. `summarize(run)` gives, with the fault's
window W = [fault_start_s, fault_end_s or end_s]:

- `sent`, `failed`, `failed_by_kind` (`http_<status>`, `truncated`, `connection`, `timeout`);
- `failed_in_fault`: failed requests whose lifetime [sent, end] overlaps W;
- `in_flight_at_fault`: requests sent before the fault's start and not finished then; of them
  `in_flight_on_faulty` went to the faulty replica or to an unknown place (a request whose answer
  names no replica is counted: it may have been there), `open_streams_at_fault` had their 200
  (a routed generation under way), `cut_at_fault` ended `truncated` (a routed generation cut);
- `new_in_fault` / `new_failed_in_fault`: requests sent inside W, and those that failed;
- `max_latency_in_fault_s`: the longest request overlapping W (a frozen replica holds its requests);
  `baseline_max_latency_s` / `baseline_p50_latency_s`: of the successful requests that ended before
  the fault (one request's time, undisturbed);
- `to_faulty_in_fault`: of the requests sent inside W whose answer names a replica, the share that
  names the faulty one: the replica that answered, or Envoy's last attempt when none did (an
  attempt that Envoy retried elsewhere successfully is not seen); None without a faulty replica or
  such requests;
- `recovery_s` (`recovered_after`): requests in order of sending, the last failed one is found; the
  requests after it must be at least `RECOVERY_RUN` (10) successes, and the first of them was sent
  `recovery_s` after the fault's end (0 when it was sent before the end; for a fault lasting the
  whole run, after its start: the time to route around it). None: not recovered by the end of the
  run (fewer than 10 successes after the last failure), or not measured (`recovers` false: the
  SIGTERM scenario, where nothing restarts the picker);
- `picker_exit`, `picker_exit_s`, `problems` (a process that died unasked, a fault that found no
  open stream), and the run's identity: scenario, arm, commit, the envoy-config command.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.lib.fault_traffic import Outcome

RECOVERY_RUN = 10


@dataclass
class ScenarioRun:
    scenario: str
    arm: str = ""
    commit: str = ""
    envoy_config: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    fault_start_s: float = 0.0
    fault_end_s: float | None = None
    faulty: str = ""
    end_s: float = 0.0
    recovers: bool = True
    picker_exit: int | None = None
    picker_exit_s: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def window(self) -> tuple[float, float]:
        end = self.fault_end_s if self.fault_end_s is not None else max(self.end_s, self.fault_start_s)
        return self.fault_start_s, end


def recovered_after(outcomes: Sequence[Outcome], ref_s: float, run: int = RECOVERY_RUN) -> float | None:
    """Seconds from `ref_s` to the send of the first request of the final run of successes, when
    that run (the requests after the last failure, by send time) holds at least `run` requests;
    0 when it began before `ref_s`, None when it is shorter (see the module docstring)."""
    ordered = sorted(outcomes, key=lambda o: o.sent_s)
    last_failed = max((i for i, o in enumerate(ordered) if not o.ok), default=-1)
    tail = ordered[last_failed + 1:]
    if len(tail) < run:
        return None
    return max(0.0, tail[0].sent_s - ref_s)


def overlaps(o: Outcome, start: float, end: float) -> bool:
    return o.sent_s <= end and o.end_s >= start


def in_flight_at(outcomes: Sequence[Outcome], t: float) -> list[Outcome]:
    return [o for o in outcomes if o.sent_s <= t < o.end_s]


def sent_between(outcomes: Sequence[Outcome], start: float, end: float) -> list[Outcome]:
    return [o for o in outcomes if start <= o.sent_s < end]


def summarize(run: ScenarioRun) -> dict[str, Any]:
    outcomes = run.outcomes
    start, end = run.window
    failed = [o for o in outcomes if not o.ok]
    at_fault = in_flight_at(outcomes, start)
    new = sent_between(outcomes, start, end)
    baseline = [o.latency_s for o in outcomes if o.ok and o.end_s <= start]
    named = [o for o in new if o.routed_to]
    recovery = None
    if run.recovers:
        recovery = recovered_after(outcomes, run.fault_end_s if run.fault_end_s is not None else run.fault_start_s)
    return {
        "scenario": run.scenario, "arm": run.arm, "commit": run.commit, "envoy_config": run.envoy_config,
        "faulty": run.faulty, "fault_start_s": round(start, 3),
        "fault_end_s": None if run.fault_end_s is None else round(run.fault_end_s, 3),
        "duration_s": round(run.end_s, 3),
        "sent": len(outcomes), "failed": len(failed),
        "failed_by_kind": dict(sorted(Counter(o.kind for o in failed).items())),
        "failed_in_fault": sum(1 for o in failed if overlaps(o, start, end)),
        "in_flight_at_fault": len(at_fault),
        "in_flight_on_faulty": sum(1 for o in at_fault if not run.faulty or o.routed_to in (run.faulty, "")),
        "open_streams_at_fault": sum(1 for o in at_fault if o.stream and o.status == 200
                                     and o.headers_s is not None and o.headers_s <= start),
        "cut_at_fault": sum(1 for o in at_fault if o.status == 200 and o.kind == "truncated"),
        "new_in_fault": len(new), "new_failed_in_fault": sum(1 for o in new if not o.ok),
        "max_latency_in_fault_s": _round(max((o.latency_s for o in outcomes if overlaps(o, start, end)),
                                             default=None)),
        "baseline_max_latency_s": _round(max(baseline, default=None)),
        "baseline_p50_latency_s": _round(statistics.median(baseline) if baseline else None),
        "to_faulty_in_fault": (round(sum(o.routed_to == run.faulty for o in named) / len(named), 3)
                               if run.faulty and named else None),
        "recovery_s": _round(recovery),
        "picker_exit": run.picker_exit, "picker_exit_s": _round(run.picker_exit_s),
        "problems": list(run.problems),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
