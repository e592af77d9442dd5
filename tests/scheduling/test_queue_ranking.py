"""The shortlist's least-waiting ranking, kept between decisions (extproc/scheduling/queue_ranking.py)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from extproc.config.settings import LatencyConfig
from extproc.core.changes import LIMIT
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.scheduling.endpoint_work import EndpointWork
from extproc.scheduling.latency import LatencyModel
from extproc.scheduling.load import endpoint_load
from extproc.scheduling.queue_ranking import QueueRanking
from testkit.scheduling import Clock

# 0.1 ms per token (10 tokens per ms), 10 ms fixed, 0.5 ms per running sequence per step.
CONFIG = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.5, step_tokens=1000)


def setup(n: int = 4) -> tuple[Datastore, LatencyModel, QueueRanking, Clock]:
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.0.{i + 1}", 8000) for i in range(n))
    clock = Clock()
    model = LatencyModel(CONFIG, 4.0, clock)
    return ds, model, QueueRanking(model, refresh_s=0.02), clock


def exact(model: LatencyModel, ds: Datastore, now: float) -> tuple[list[float], list[float]]:
    eps = ds.snapshot()
    loads = list(map(endpoint_load, eps))
    return loads, model.predict_ttfts(eps, model.works(eps, now), [0.0] * len(eps), loads)


def test_what_changed_is_recomputed_at_once_and_the_rest_kept_until_the_refresh() -> None:
    ds, model, ranking, clock = setup()
    eps = ds.snapshot()
    keys = [ep.key for ep in eps]
    a, b, c, _ = eps
    assert ranking.rank(eps, keys, clock.now)[1] == [10.0] * 4 and ranking.full_passes == 1

    model.routed(a, 1000, None, clock.now)  # the model's own state: 1,000 tokens queued on a
    ds.acquire(b.key)  # b's in-flight count
    ds.set_metrics(c.key, ModelServerMetrics(waiting=0, running=3, updated_at=clock.now, ok=True))  # a scrape
    loads, costs = ranking.rank(eps, keys, clock.now)
    assert ranking.full_passes == 1  # none of it needed a full pass
    assert loads == [0.0, 1.0, 3.0, 0.0]
    assert costs == pytest.approx([10 + 1000 * 0.1, 10 + 0.5, 10 + 0.5 * 3, 10])
    assert (loads, costs) == exact(model, ds, clock.now)

    # Time alone: a's backlog drains 10 tokens a ms, 1 ms of its cost per ms; kept for up to refresh_s.
    clock.now += 0.015
    _, costs = ranking.rank(eps, keys, clock.now)
    assert ranking.full_passes == 1 and costs[0] == pytest.approx(110.0)
    assert costs[0] - exact(model, ds, clock.now)[1][0] == pytest.approx(15.0)  # within 20 ms of drain
    clock.now += 0.006  # 21 ms: a, the one endpoint whose cost moves with time, is recomputed
    _, costs = ranking.rank(eps, keys, clock.now)
    assert ranking.full_passes == 1 and costs[0] == pytest.approx(10 + 790 * 0.1)
    assert costs == exact(model, ds, clock.now)[1]

    # A response end the model hears of (touched), with nothing else changed: recomputed.
    model.finished(a, model.mark(a), clock.now)
    assert ranking.rank(eps, keys, clock.now)[1][0] == pytest.approx(10.0) and ranking.full_passes == 1


def test_a_time_refresh_recomputes_only_the_endpoints_whose_cost_moves_with_time() -> None:
    ds, model, ranking, clock = setup(8)
    eps = ds.snapshot()
    keys = [ep.key for ep in eps]
    ranking.rank(eps, keys, clock.now)
    model.routed(eps[1], 500, None, clock.now)  # a backlog: drains with time
    slots = model.work(eps[2], clock.now).slots  # a full endpoint: its slot wait shortens as its holders age
    slots.limit, slots.occupancy_ms = 1.0, 100.0
    for _ in range(2):
        ds.acquire(eps[2].key)
    ranking.rank(eps, keys, clock.now)
    assert ranking._timed == {1, 2}
    asked: list[list[str]] = []
    works = model.works

    def counted(endpoints: Sequence[Endpoint], now: float) -> list[EndpointWork]:
        asked.append([ep.key for ep in endpoints])
        return works(endpoints, now)

    model.works = counted  # type: ignore[method-assign]
    clock.now += 0.03
    _, costs = ranking.rank(eps, keys, clock.now)
    assert asked == [[eps[1].key, eps[2].key]] and ranking.full_passes == 1
    assert costs == exact(model, ds, clock.now)[1]


def test_a_pool_wide_move_or_another_pool_recomputes_everything() -> None:
    ds, model, ranking, clock = setup()
    eps = ds.snapshot()
    keys = [ep.key for ep in eps]
    ranking.rank(eps, keys, clock.now)
    model.pool_version += 1  # e.g. the pool's admission limit moved
    ranking.rank(eps, keys, clock.now)
    assert ranking.full_passes == 2
    ranking.rank(eps[:3], keys[:3], clock.now)
    assert ranking.full_passes == 3
    ranking.rank(eps[:3], keys[:3], clock.now)
    assert ranking.full_passes == 3


def test_the_pools_admission_limit_moving_bumps_the_pool_version() -> None:
    ds, model, _, clock = setup(2)
    a, _ = ds.snapshot()
    version = model.pool_version
    model._share_limits()  # no limit known: nothing moved
    assert model.pool_version == version
    model.work(a, clock.now).slots.limit = 8
    model._share_limits()
    assert model.pool_limit == 8 and model.pool_version == version + 1


def test_kept_costs_and_their_order_equal_a_full_recompute_after_any_changes() -> None:
    """A random walk of routed and answered requests, scrapes and model calls at one instant:
    after each step the kept loads and costs equal what a full pass computes, from the change
    log alone (a full pass only where a pool-wide quantity moved), and `least(k)` is k of the
    least costs."""
    ds, model, ranking, clock = setup(64)
    eps = ds.snapshot()
    keys = [ep.key for ep in eps]
    rng = random.Random(5)
    ranking.rank(eps, keys, clock.now)
    moves = 0
    for step in range(400):
        version = model.pool_version
        ep = rng.choice(eps)
        what = rng.randrange(5)
        if what == 0:
            ds.acquire(ep.key)
        elif what == 1:
            Datastore.release(ep)
        elif what == 2:
            ds.set_metrics(ep.key, ModelServerMetrics(waiting=rng.randrange(4), running=rng.randrange(4),
                                                      updated_at=clock.now + step * 1e-9, ok=True))
        elif what == 3:
            model.routed(ep, rng.randrange(100, 3000), None, clock.now)
        else:
            model.finished(ep, model.mark(ep), clock.now)
        loads, costs = ranking.rank(eps, keys, clock.now)
        moves += model.pool_version != version  # a scrape the ranking applied may move it too
        assert (loads, costs) == exact(model, ds, clock.now)
        k = rng.randrange(1, 20)
        least = ranking.least(k, rng)
        assert len(set(least)) == k and sorted(costs[i] for i in least) == sorted(costs)[:k]
    assert ranking.full_passes == 1 + moves and moves < 10


def test_kept_costs_equal_a_full_recompute_at_each_time_refresh() -> None:
    """The same walk with time passing (each step past the refresh) and endpoints with backlogs,
    admission limits and occupancies: at every refresh the kept costs equal a full recompute,
    with a full pass only where the pool's admission limit moved."""
    ds, model, ranking, clock = setup(32)
    eps = ds.snapshot()
    keys = [ep.key for ep in eps]
    rng, draws = random.Random(7), random.Random(8)
    for ep in eps[::3]:
        slots = model.work(ep, clock.now).slots
        slots.limit, slots.occupancy_ms = float(rng.randrange(1, 4)), rng.uniform(10.0, 200.0)
    ranking.rank(eps, keys, clock.now)
    admitted: dict[str, list[int]] = {ep.key: [] for ep in eps}
    for _ in range(300):
        for _ in range(rng.randrange(3)):
            ep = rng.choice(eps)
            what = rng.randrange(4)
            if what == 0:  # routed here: in flight, its prefill queued, its age among the slot holders
                ds.acquire(ep.key)
                model.routed(ep, rng.randrange(100, 3000), None, clock.now)
                admitted[ep.key].append(model.admit(ep, clock.now, 50.0, 0.0))
            elif what == 1 and admitted[ep.key]:
                Datastore.release(ep)
                model.leave(ep, admitted[ep.key].pop(0))
            elif what == 2:
                model.finished(ep, model.mark(ep), clock.now)
            elif rng.random() < 0.2:  # now and then a scrape (its queue hides the ages: load.py)
                ds.set_metrics(ep.key, ModelServerMetrics(waiting=rng.randrange(3), running=rng.randrange(3),
                                                          updated_at=clock.now, ok=True))
        clock.now += rng.uniform(0.02, 0.06)
        passes, version, moved = ranking.full_passes, model.pool_version, model.pool_version != ranking._version
        loads, costs = ranking.rank(eps, keys, clock.now)
        # A full pass only where a pool-wide quantity moved (in the walk, or by a scrape the ranking applied).
        assert ranking.full_passes == passes + (moved or model.pool_version != version)
        assert (loads, costs) == exact(model, ds, clock.now)
        k = draws.randrange(1, 12)
        assert sorted(costs[i] for i in ranking.least(k, draws)) == sorted(costs)[:k]
    assert 0 < len(ranking._timed) < len(eps) and 1 < ranking.full_passes < 10, ranking.full_passes


def test_a_change_log_that_dropped_unread_changes_costs_a_full_pass() -> None:
    ds, _, ranking, clock = setup()
    eps = ds.snapshot()
    keys = [ep.key for ep in eps]
    ranking.rank(eps, keys, clock.now)
    for _ in range(2 * LIMIT):
        ds.acquire(eps[0].key)
    assert ranking.rank(eps, keys, clock.now)[0][0] == 2 * LIMIT and ranking.full_passes == 2


def test_endpoints_tied_at_the_edge_are_drawn_at_random() -> None:
    ds, _, ranking, clock = setup(64)
    eps = ds.snapshot()
    ranking.rank(eps, [ep.key for ep in eps], clock.now)  # an idle pool: every cost is the same
    rng = random.Random(6)
    seen: Counter[int] = Counter()
    for _ in range(2000):
        least = ranking.least(8, rng)
        assert len(set(least)) == 8
        seen.update(least)
    assert len(seen) == 64 and min(seen.values()) > 150 and max(seen.values()) < 350  # ~250 each
