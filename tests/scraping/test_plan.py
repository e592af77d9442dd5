"""The scrape plan on a virtual clock: the pool-wide rate is bounded, starts are spread, small pools
keep the base interval, touched endpoints are refreshed first, running scrapes are not repeated, and
an endpoint whose scrape costs its engine more is scraped less often (the engine-share floor)."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import pytest

from extproc.scraping.plan import COST_WINDOW, ScrapePlan

BASE, BUDGET = 0.05, 1000.0


def simulate(plan: ScrapePlan, seconds: float, scrape_s: float | dict[str, float] = 0.002,
             touch: set[str] | None = None) -> dict[str, list[float]]:
    """Run the plan as the scraper does, each scrape taking `scrape_s` (or its endpoint's entry),
    its duration handed to the plan; the start times per endpoint."""
    starts: dict[str, list[float]] = defaultdict(list)
    running: list[tuple[float, str]] = []  # (ends at, key)
    took = scrape_s if isinstance(scrape_s, dict) else defaultdict(lambda: scrape_s)
    now = 0.0
    while now < seconds:
        for end, key in [r for r in running if r[0] <= now]:
            running.remove((end, key))
            plan.observe(key, took[key])
            plan.done(key, end)
            if touch and key in touch:
                plan.touch(key)
        started = plan.start(now)
        if started is not None:
            starts[started].append(now)
            running.append((now + took[started], started))
            continue
        wait = plan.wait(now)
        ends = [end for end, _ in running]
        now = min([now + (wait if wait is not None else BASE), *ends])
    return starts


def pool(n: int, budget: float = BUDGET) -> ScrapePlan:
    plan = ScrapePlan(BASE, budget)
    for i in range(n):
        plan.add(f"ep{i}", 0.0)
    return plan


def test_256_endpoints_share_the_budget() -> None:
    plan = pool(256)
    assert plan.interval() == pytest.approx(0.256) and plan.rate() == pytest.approx(BUDGET)
    starts = simulate(plan, 10.0)
    every = sorted(t for ts in starts.values() for t in ts)
    assert len(every) <= BUDGET * 10 + 2  # the budget holds over the whole run
    gaps = [b - a for a, b in pairwise(every)]
    assert min(gaps) >= plan.spacing() - 1e-9  # never two starts closer than the spacing
    for ts in starts.values():  # every endpoint is scraped, once per interval
        assert len(ts) >= 10 / 0.256 - 2
        assert max(b - a for a, b in pairwise(ts)) <= 0.256 + 0.003


def test_a_pool_added_at_once_is_spread_over_one_interval() -> None:
    plan = pool(256)
    starts = simulate(plan, 0.3)
    firsts = sorted(ts[0] for ts in starts.values())
    assert len(firsts) == 256 and firsts[-1] <= 0.256
    assert len({round(t * 1000) for t in firsts}) == 256  # one start per millisecond slot


def test_a_small_pool_keeps_the_base_interval() -> None:
    plan = pool(4)
    assert plan.interval() == BASE
    starts = simulate(plan, 2.0)
    for ts in starts.values():
        gaps = [b - a for a, b in pairwise(ts)]
        assert min(gaps) >= BASE - 1e-9 and max(gaps) <= BASE + 1e-9
    assert sorted(ts[0] for ts in starts.values()) == pytest.approx([0.0, 0.0125, 0.025, 0.0375])


def test_an_unbounded_budget_scrapes_every_endpoint_at_the_base_interval() -> None:
    plan = pool(256, budget=0)
    assert plan.interval() == BASE and plan.rate() == pytest.approx(256 / BASE)


def test_a_touched_endpoint_is_refreshed_first_within_the_same_budget() -> None:
    plan = pool(256)
    starts = simulate(plan, 5.0, touch={"ep7"})
    hot = starts["ep7"]
    assert max(b - a for a, b in pairwise(hot[5:])) <= BASE + 2 * plan.spacing() + 0.003
    every = sorted(t for ts in starts.values() for t in ts)
    assert len(every) <= BUDGET * 5 + 2
    others = [len(ts) for k, ts in starts.items() if k != "ep7"]
    assert min(others) >= 5 / 0.256 - 3  # the rest wait a little longer, never starve


def test_touching_every_endpoint_cannot_exceed_the_budget() -> None:
    plan = pool(256)
    starts = simulate(plan, 3.0, touch={f"ep{i}" for i in range(256)})
    assert sum(len(ts) for ts in starts.values()) <= BUDGET * 3 + 2
    assert min(len(ts) for ts in starts.values()) >= 3 / 0.256 - 3


def test_a_running_scrape_is_not_started_again_and_a_slow_one_is_due_when_it_ends() -> None:
    plan = pool(1)
    assert plan.start(0.0) == "ep0"
    assert plan.start(1.0) is None and plan.wait(1.0) is None  # still running
    plan.done("ep0", 1.0)  # took longer than its interval: due again at once
    assert plan.wait(1.0) == 0.0 and plan.start(1.0) == "ep0"


def test_a_removed_endpoint_is_never_started() -> None:
    plan = pool(3)
    plan.remove("ep1")
    starts = simulate(plan, 0.5)
    assert set(starts) == {"ep0", "ep2"}
    assert plan.interval() == BASE and len(plan) == 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        ScrapePlan(0, BUDGET)
    with pytest.raises(ValueError):
        ScrapePlan(BASE, -1)
    with pytest.raises(ValueError):
        ScrapePlan(BASE, BUDGET, 1.5)


def gaps_after_first(ts: list[float]) -> list[float]:
    return [round(b - a, 9) for a, b in pairwise(ts[1:])]


def test_a_scrape_that_costs_its_engine_6_ms_is_taken_every_300_ms() -> None:
    """2% of the engine's time: 6 ms / 0.02 = 300 ms; a 1 ms page keeps the base 50 ms."""
    plan = ScrapePlan(BASE, BUDGET, 0.02)
    plan.add("slow", 0.0)
    plan.add("fast", 0.0)
    starts = simulate(plan, 3.0, scrape_s={"slow": 0.006, "fast": 0.001})
    assert set(gaps_after_first(starts["slow"])) == {0.3}
    assert set(gaps_after_first(starts["fast"])) == {BASE}
    assert plan.interval_of("slow") == pytest.approx(0.3) and plan.interval_of("fast") == BASE


def test_the_floor_follows_the_shortest_recent_scrape() -> None:
    plan = ScrapePlan(BASE, BUDGET, 0.02)
    plan.add("e", 0.0)
    plan.observe("e", 0.006)
    assert plan.interval_of("e") == pytest.approx(0.3)
    plan.observe("e", 0.002)  # a faster render: the floor comes down at once
    assert plan.interval_of("e") == pytest.approx(0.1)
    for _ in range(COST_WINDOW - 1):  # answers delayed by the engine's own work cost it no more CPU
        plan.observe("e", 0.05)
    assert plan.interval_of("e") == pytest.approx(0.1)
    plan.observe("e", 0.05)  # a whole window of slow answers: the render itself got dearer
    assert plan.interval_of("e") == 1.0  # 2.5 s, capped: never less than once a second


def test_the_share_is_the_pools_so_more_pickers_each_scrape_less() -> None:
    plan = ScrapePlan(BASE, BUDGET, 0.02)
    plan.add("e", 0.0)
    plan.observe("e", 0.003)
    assert plan.interval_of("e") == pytest.approx(0.15)
    plan.set_scrapers(4)  # 2 pods x 2 workers
    assert plan.interval_of("e") == pytest.approx(0.6)
    plan.set_scrapers(8)
    assert plan.interval_of("e") == 1.0


def test_a_touched_endpoint_is_still_held_to_its_floor() -> None:
    plan = ScrapePlan(BASE, BUDGET, 0.02)
    plan.add("slow", 0.0)
    starts = simulate(plan, 3.0, scrape_s=0.006, touch={"slow"})
    assert min(gaps_after_first(starts["slow"])) == pytest.approx(0.3)


def test_a_pool_past_its_budget_keeps_the_longer_of_the_two_intervals() -> None:
    plan = pool(256)  # 256 ms from the budget
    plan.engine_share = 0.02
    plan.observe("ep0", 0.002)  # floor 100 ms: the budget's interval wins
    plan.observe("ep1", 0.008)  # floor 400 ms: its own wins
    assert plan.interval_of("ep0") == pytest.approx(0.256) and plan.interval_of("ep1") == pytest.approx(0.4)


def test_no_share_no_floor() -> None:
    plan = ScrapePlan(BASE, BUDGET, 0.0)
    plan.add("slow", 0.0)
    starts = simulate(plan, 1.0, scrape_s=0.006)
    assert set(gaps_after_first(starts["slow"])) == {BASE}
