"""Faults under steady traffic through the quick-start stack: what clients may see of each.

Each test is one scenario of the fault benchmark (`bench.lib.fault_scenarios`, the same runner as
`python -m bench.faults`) with short windows: a fresh stack (three simulated replicas, each its
own process, the picker, real Envoy configured by `prefix-epp envoy-config`), 6 paced clients at
20 requests/s, half of them streaming, every answer checked whole (a 200 whose stream lacks its
final chunk or `[DONE]` counts as cut). The warm-up ends after 1 s and 15 successes; after the
fault the traffic stops once 10 requests in a row have succeeded (or a few seconds have passed).

What the picker must guarantee:

- a replica killed and restarted: failures at most the requests in flight on it at the kill
  (once it is gone, nothing more is sent to it), and the traffic recovers;
- a replica frozen: a request sent once the picker's first scrape after the freeze has timed out
  (`EppConfig.scrape_timeout_s` plus one `refresh_metrics_interval_s` after it) waits at most the
  scrape timeout plus one request's time (the longest answer before the fault): the picker stops
  sending to a replica whose /metrics do not answer. Requests sent to it earlier are held until it
  thaws: nothing but the replica can release them;
- a replica answering 500 to every request (its /metrics healthy): at most 5 of those 500s reach
  clients before it is ejected;
- the picker killed while streams are open and restarted: no routed generation (200 received) is cut;
- SIGTERM to the only picker under steady traffic: the routed streams finish, and the picker exits
  with status 0 within its drain timeout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.lib.fault_scenarios import Load, Timing, run_scenario
from bench.lib.fault_summary import ScenarioRun, sent_between, summarize
from extproc.config.settings import EppConfig
from testkit.quickstart import HERE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

SHORT = Timing(before_s=1.0, fault_s=2.0, after_s=4.0, picker_down_s=1.0, drain_timeout_s=5.0,
               warm_requests=15, stop_when_recovered=True)
LOAD = Load(clients=6, rate=20.0, max_tokens=128)
MAX_500S = 5


async def scenario(name: str, tmp: Path, timing: Timing = SHORT,
                   load: Load = LOAD) -> tuple[ScenarioRun, dict[str, Any]]:
    run = await run_scenario(name, HERE, tmp, timing, load)
    summary = summarize(run)
    assert not run.problems, run.problems
    assert summary["sent"] >= 20, summary  # the traffic ran
    return run, summary


def explain(summary: dict[str, Any], run: ScenarioRun) -> str:
    failed = [(round(o.sent_s, 2), o.kind, o.routed_to) for o in run.outcomes if not o.ok][:20]
    return json.dumps(summary, indent=1) + f"\nfirst failures (sent s, kind, routed to): {failed}"


async def test_a_killed_replica_fails_at_most_its_requests_in_flight(tmp_path: Path) -> None:
    run, s = await scenario("replica-kill", tmp_path)
    assert s["failed"] <= s["in_flight_on_faulty"], explain(s, run)
    assert s["recovery_s"] is not None, explain(s, run)


async def test_a_frozen_replica_holds_no_request_past_the_scrape_timeout(tmp_path: Path) -> None:
    # 12 clients: a closed-loop client whose request went to the frozen replica before the picker
    # could know waits for the thaw, and 6 could all be held, leaving nothing to judge.
    timing = Timing(before_s=1.0, fault_s=4.0, after_s=4.0, warm_requests=15, stop_when_recovered=True)
    run, s = await scenario("replica-freeze", tmp_path, timing, Load(clients=12, rate=40.0, max_tokens=128))
    config = EppConfig()
    start, end = run.window
    bound = config.scrape_timeout_s + s["baseline_max_latency_s"]
    # Sent once the first scrape after the freeze has timed out, and early enough that the thaw
    # would not release it within the bound anyway.
    judged = sent_between(run.outcomes, start + config.scrape_timeout_s + config.refresh_metrics_interval_s,
                          end - bound)
    assert judged, explain(s, run)
    worst = max(judged, key=lambda o: o.latency_s)
    assert worst.latency_s <= bound, (
        f"a request sent {worst.sent_s - start:.2f} s into the freeze waited {worst.latency_s:.2f} s "
        f"(bound {bound:.2f} s, routed to {worst.routed_to or 'unknown'})\n" + explain(s, run))


async def test_a_replica_answering_500_is_ejected_after_a_handful(tmp_path: Path) -> None:
    timing = Timing(before_s=1.0, fault_s=3.0, after_s=2.0, warm_requests=15)
    run, s = await scenario("replica-500", tmp_path, timing)
    assert s["failed_by_kind"].get("http_500", 0) <= MAX_500S, explain(s, run)


async def test_a_killed_picker_cuts_no_routed_generation(tmp_path: Path) -> None:
    run, s = await scenario("picker-kill", tmp_path)
    assert s["open_streams_at_fault"] >= 1, explain(s, run)
    assert s["failed_by_kind"].get("truncated", 0) == 0, explain(s, run)


async def test_sigterm_lets_routed_streams_finish_and_exits_0(tmp_path: Path) -> None:
    run, s = await scenario("picker-sigterm", tmp_path)
    assert s["open_streams_at_fault"] >= 1, explain(s, run)
    assert s["failed_by_kind"].get("truncated", 0) == 0, explain(s, run)
    assert s["picker_exit"] == 0, explain(s, run)
    assert s["picker_exit_s"] is not None and s["picker_exit_s"] <= SHORT.drain_timeout_s + 2.0, explain(s, run)
