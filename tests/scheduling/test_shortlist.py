"""A large pool's decision scores a shortlist (extproc/scheduling/shortlist.py)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest

from extproc.config.settings import EppConfig, LatencyConfig, PrefixConfig
from extproc.config.validate import check
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.prefix.hashing import block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler
from extproc.scheduling.draws import draw_into
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from extproc.scheduling.shortlist import Shortlist
from testkit.scheduling import Clock

P = PrefixConfig()


def pool(n: int) -> Datastore:
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.{i // 250}.{i % 250 + 1}", 8000) for i in range(n))
    return ds


def req(prompt: bytes, rid: str = "r") -> SchedulingRequest:
    hashes = block_hashes([prompt], "m", block_size=P.block_size_bytes, max_blocks=P.max_prefix_blocks)
    return SchedulingRequest(request_id=rid, model="m", block_hashes=hashes, prompt_bytes=len(prompt))


def test_the_shortlist_holds_the_prompts_holders_the_least_loaded_and_a_sample() -> None:
    ds = pool(64)
    eps = ds.snapshot()
    for i, ep in enumerate(eps):
        if i not in (40, 41):
            for _ in range(i % 5 + 1):
                ds.acquire(ep.key)
    r = req(b"x" * 640)
    r.prefix_match = {eps[3].key: 5, eps[7].key: 9}
    r.affinity_match = frozenset({eps[50].key})
    shortlist = Shortlist(16, random.Random(0))
    assert shortlist.applies(64) and not shortlist.applies(16) and not Shortlist(0).applies(10_000)
    chosen = shortlist.select(r, eps, [ep.key for ep in eps])
    assert len(chosen) == 16 and len(set(chosen)) == 16
    assert {eps[i] for i in (3, 7, 50, 40, 41)} <= set(chosen)  # holders, affinity, the idle two
    assert [eps.index(ep) for ep in chosen] == sorted(eps.index(ep) for ep in chosen)  # pool order
    assert list(r.pool) == list(eps) and sum(r.pool_loads) == sum(ep.inflight for ep in eps)


def test_at_most_half_the_shortlist_goes_to_holders_the_longest_matches_first() -> None:
    ds = pool(64)
    eps = ds.snapshot()
    r = req(b"x" * 640)
    r.prefix_match = {eps[i].key: i + 1 for i in range(12)}  # endpoint i holds i + 1 blocks
    r.precise_match = {eps[20].key: 30}  # the longest match of all, from the precise index
    chosen = set(Shortlist(16, random.Random(1)).select(r, eps, [ep.key for ep in eps]))
    assert {eps[i] for i in (20, *range(5, 12))} <= chosen  # the 8 longest of 13 holders


def test_equal_loads_do_not_favour_the_pools_first_endpoints() -> None:
    ds = pool(64)
    eps = ds.snapshot()
    keys = [ep.key for ep in eps]
    shortlist = Shortlist(8, random.Random(2))
    seen: Counter[int] = Counter()
    for _ in range(2000):
        seen.update(eps.index(ep) for ep in shortlist.select(req(b"y"), eps, keys))
    assert len(seen) == 64 and min(seen.values()) > 150 and max(seen.values()) < 350  # ~250 each


def test_a_large_pool_keeps_prefixes_finds_the_idle_replica_and_the_state_of_all() -> None:
    ds, clock = pool(100), Clock()
    sched = build_scheduler(EppConfig(seed=3, max_scored_endpoints=16), PrefixIndex(100_000), clock=clock)
    scorer = sched.scorers[0].scorer
    assert isinstance(scorer, PredictedTtftScorer)

    def route(prompt: bytes) -> Endpoint:
        clock.now += 1.0  # each prefill done before the next request
        return sched.schedule(req(prompt), ds.snapshot()).primary

    for i in range(300):  # one family per request: each is new
        route(random.Random(i).randbytes(2000))
    assert len(scorer.model) > 2 * 16 + 16  # not dropped to the last shortlist's endpoints
    system = b"a shared system prompt " * 60
    home = route(system + b"first")
    assert all(route(system + b"q%d" % i) is home for i in range(20))
    idle = ds.snapshot()[77]
    for ep in ds.snapshot():
        if ep is not idle:
            ds.acquire(ep.key)
    assert route(random.Random(999).randbytes(2000)) is idle


def test_a_hot_prefix_spreads_with_a_shortlist_as_without() -> None:
    """A hot prefix's holders past their bounded reuse (reuse.py: the pool's mean load, not the
    shortlist's) give way to cold replicas; the shortlist keeps the least-loaded holders, so the
    prefix is copied onto as many replicas as when every replica is scored."""

    def spread(limit: int) -> list[int]:
        ds, clock = pool(40), Clock()
        sched = build_scheduler(EppConfig(seed=4, max_scored_endpoints=limit), PrefixIndex(100_000), clock=clock)
        hot = b"hot system prompt " * 60
        for i in range(40):
            clock.now += 0.5  # the prefill before it done, the request still decoding
            d = sched.schedule(req(hot + b"%d" % i), ds.snapshot())
            ds.acquire(d.primary.key)  # requests stay in flight
        return sorted(ep.inflight for ep in ds.snapshot())

    everywhere = spread(0)
    assert max(everywhere) <= 4 and spread(16) == everywhere


def test_a_shortlist_smaller_than_its_parts_is_refused() -> None:
    assert any("--max-scored-endpoints" in p for p in check(EppConfig(max_scored_endpoints=3)))
    assert not check(EppConfig(max_scored_endpoints=0)) and not check(EppConfig(max_scored_endpoints=4))
    with pytest.raises(ValueError):
        Shortlist(2)


def test_bounded_reuse_reads_the_pools_mean_load_not_the_shortlists() -> None:
    """Four candidates scored, each holding 2 requests, of a pool of 40 otherwise idle: the
    holder of a prefix already reused by 3 requests there is over the pool's bound
    (ceil(1.25 x 9 / 40) = 1) and priced cold; over the four alone (ceil(1.25 x 9 / 4) = 3) it
    would not be."""
    ds = pool(40)
    eps = ds.snapshot()
    scored = eps[:4]
    for ep in scored:
        ds.acquire(ep.key)
        ds.acquire(ep.key)
    index = PrefixIndex(100_000)
    scorer = PredictedTtftScorer(EppConfig(), Clock(), index)
    for pooled in (False, True):
        r = req(b"hot system prompt " * 60)
        r.prefix_match = {eps[0].key: len(r.block_hashes)}
        for _ in range(3):
            scorer.reuse.acquire(eps[0].key, r.block_hashes[-1])
        if pooled:
            r.pool, r.pool_loads = eps, [float(ep.inflight) for ep in eps]
        scorer.score(r, scored)
        assert ("reuse=over-bound" in r.signals.get(eps[0].key, "")) is pooled


class Ranked:
    """A QueueRanker with set costs."""

    def __init__(self, costs: list[float]) -> None:
        self.costs = costs

    def queue_costs(self, endpoints: Sequence[Endpoint], keys: Sequence[str]) -> tuple[list[float], list[float]]:
        return [float(ep.inflight) for ep in endpoints], self.costs

    def least_waiting(self, k: int, rng: random.Random) -> list[int]:
        return sorted(range(len(self.costs)), key=self.costs.__getitem__)[:k]


def test_the_least_waiting_quarter_follows_the_rankers_queue_not_the_request_count() -> None:
    ds = pool(16)
    eps = ds.snapshot()
    for i in (5, 9):  # the most requests in flight, the shortest queue
        for _ in range(3):
            ds.acquire(eps[i].key)
    costs = [100.0 + i for i in range(16)]
    costs[5], costs[9] = 1.0, 2.0
    keys = [ep.key for ep in eps]
    for seed in range(20):
        chosen = Shortlist(8, random.Random(seed)).select(req(b"z"), eps, keys, Ranked(costs))
        assert eps[5] in chosen and eps[9] in chosen


def test_the_scorers_ranking_is_its_prediction_for_a_prompt_held_whole_and_reads_every_scrape() -> None:
    """predicted-ttft-scorer's queue_costs: slowdown x (overhead + drained backlog x ms per token +
    steps x decode per sequence x load), i.e. predict_ttfts for 0 uncached tokens; on the way
    every endpoint's new scrape is applied, scored or not (a waiting queue raises its backlog)."""
    config = replace(EppConfig(), latency=LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0,
                                                        decode_ms_per_seq=0.5, step_tokens=1000))
    clock = Clock()
    scorer = PredictedTtftScorer(config, clock, PrefixIndex(1000))
    model = scorer.model
    ds = pool(3)
    a, b, c = ds.snapshot()
    model.routed(a, 1500, None, clock.now)
    ds.acquire(b.key)
    ds.acquire(b.key)
    clock.now += 0.05  # 50 ms at 10 tokens per ms: 1,000 tokens left on a
    loads, costs = scorer.queue_costs([a, b, c], [a.key, b.key, c.key])
    assert loads == [0.0, 2.0, 0.0]
    assert costs == pytest.approx([10 + 1000 * 0.1, 10 + 0.5 * 2, 10])
    model.routed(c, 200, None, clock.now)  # c's mean routed request: 200 tokens
    ds.set_metrics(c.key, ModelServerMetrics(waiting=20, running=1, updated_at=clock.now, ok=True))
    loads, costs = scorer.queue_costs([a, b, c], [a.key, b.key, c.key])
    queued = 20 * model.work(c, clock.now).mean_uncached  # at least 20 mean requests wait there
    assert loads[2] == 21.0 and queued > 200
    assert costs[2] == pytest.approx(10 + queued * 0.1 + math.ceil(queued / 1000) * 0.5 * 21)


def test_the_draws_fill_the_shortlist_with_distinct_uniform_positions() -> None:
    rng = random.Random(7)
    seen: Counter[int] = Counter()
    for _ in range(4000):
        chosen = {0, 1}
        draw_into(chosen, 40, 10, rng)
        assert len(chosen) == 10 and {0, 1} <= chosen and max(chosen) < 40
        seen.update(chosen - {0, 1})
    # 8 of 38 each time: ~842 each (sd ~26)
    assert len(seen) == 40 - 2 and min(seen.values()) > 690 and max(seen.values()) < 1000
    everything: set[int] = set()
    draw_into(everything, 33, 32, rng)  # nearly the whole pool: drawn until it is there
    assert len(everything) == 32
    draw_into(everything, 5, 32, rng)
    assert everything >= set(range(5))
