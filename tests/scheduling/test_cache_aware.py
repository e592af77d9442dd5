"""The cache-aware reference scheduler (extproc/scheduling/scorers/cache_aware.py): its three rules,
its fallback order, its in-flight counts through the director, and its bounded index."""

from __future__ import annotations

import orjson
import pytest

from extproc.config.settings import CacheAwareConfig, EppConfig, PrefixConfig
from extproc.control.director import RequestContext
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec
from extproc.prefix.hashing import block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.runtime.app import App
from extproc.scheduling.build import build_scheduler, default_scheduler
from extproc.scheduling.config_loader import load_text
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scheduler import Decision, Scheduler
from extproc.scheduling.scorers.cache_aware import CacheAwareScorer

P = PrefixConfig()
PROMPT = b"p" * 640  # 10 blocks of 64 bytes


def req(prompt: bytes = PROMPT) -> SchedulingRequest:
    hashes = block_hashes([prompt], "m", block_size=P.block_size_bytes, max_blocks=P.max_prefix_blocks)
    return SchedulingRequest(request_id="r", model="m", block_hashes=hashes)


def pool(*inflight: int) -> tuple[Datastore, list[Endpoint]]:
    """Endpoints 10.0.0.1.. with these requests in flight (counted as the director counts them)."""
    ds = Datastore()
    ds.set_endpoints(EndpointSpec(f"10.0.0.{i + 1}", 8000) for i in range(len(inflight)))
    eps = list(ds.snapshot())
    for ep, n in zip(eps, inflight, strict=True):
        for _ in range(n):
            ds.acquire(ep.key)
    return ds, eps


def scheduler(index: PrefixIndex, **kw: object) -> Scheduler:
    return default_scheduler(EppConfig(seed=1, scheduler="cache-aware", **kw), index)  # type: ignore[arg-type]


def held_by(index: PrefixIndex, ep: Endpoint, blocks: int, prompt: bytes = PROMPT) -> None:
    """`ep` holds the prompt's first `blocks` blocks in the approximate index."""
    index.record(ep.key, req(prompt).block_hashes[:blocks])


def test_the_longest_match_wins_while_loads_are_balanced_and_the_least_loaded_once_they_are_not() -> None:
    index = PrefixIndex(10_000)
    sched = scheduler(index)
    ds, (a, b, c) = pool(64, 0, 0)  # max - min = 64, not > 64: balanced
    held_by(index, a, 10)
    assert sched.schedule(req(), ds.snapshot()).primary is a
    ds.acquire(a.key)  # 65 - 0 > 64 and 65 > 1.5 x 0: imbalanced
    d = sched.schedule(req(), ds.snapshot())
    assert d.primary in (b, c) and d.matched_blocks == 0
    assert index.match(req().block_hashes, [d.primary.key]) == {d.primary.key: 10}  # recorded there too
    # Both conditions are needed: 195 - 130 > 64 but 195 = 1.5 x 130 is not above it.
    ds, (a, b, c) = pool(195, 130, 130)
    index = PrefixIndex(10_000)
    held_by(index, a, 10)
    assert scheduler(index).schedule(req(), ds.snapshot()).primary is a
    ds.acquire(a.key)  # 196 > 195: imbalanced
    assert scheduler(index).schedule(req(), ds.snapshot()).primary in (b, c)


@pytest.mark.parametrize(("held", "hit"), [(3, False), (4, True)])
def test_a_match_counts_only_above_the_cache_threshold(held: int, hit: bool) -> None:
    index = PrefixIndex(10_000)
    ds, (a, _, _) = pool(1, 0, 0)  # a holds the prefix but is not the least loaded
    held_by(index, a, held)  # 3 of 10 blocks is 0.3, not above it; 4 is
    d = scheduler(index).schedule(req(), ds.snapshot())
    assert (d.primary is a) is hit
    assert d.matched_blocks == (held if hit else 0)


def test_a_miss_goes_to_the_least_loaded_not_the_smallest_tree() -> None:
    index = PrefixIndex(10_000)
    ds, (_, b, _) = pool(3, 1, 2)
    held_by(index, b, 10, b"b" * 6400)  # b holds the most (sglang once sent misses to the smallest tree)
    assert scheduler(index).schedule(req(), ds.snapshot()).primary is b


def test_fallbacks_follow_the_choice_by_load_and_equal_loads_share_misses() -> None:
    index = PrefixIndex(10_000)
    ds, (a, b, c) = pool(2, 0, 1)
    held_by(index, a, 10)
    sched = scheduler(index, max_endpoints=3)
    assert sched.schedule(req(), ds.snapshot()).endpoints == [a, b, c]  # the holder, then by load
    assert sched.schedule(req(b"unrelated " * 64), ds.snapshot()).endpoints == [b, c, a]
    held_by(index, b, 10)  # of two holders of the longest match, the less loaded
    assert sched.schedule(req(), ds.snapshot()).endpoints == [b, a, c]
    ds, eps = pool(0, 0, 0)
    sched = scheduler(PrefixIndex(10_000))
    chosen = {sched.schedule(req(b"%d " % i * 64), eps).primary.key for i in range(30)}
    assert chosen == {ep.key for ep in eps}


def test_scores_separate_the_holders_from_the_rest() -> None:
    _, eps = pool(9, 0)
    r = req()
    r.prefix_match = {eps[0].key: 10}
    scores = CacheAwareScorer(CacheAwareConfig()).score(r, eps)
    assert scores == [2 / 3, 1 / 3]  # the busiest holder above the idlest non-holder
    with pytest.raises(ValueError):
        CacheAwareScorer(CacheAwareConfig(balance_rel=0.5))


def route(app: App, prompt: str, subset: list[str] | None = None) -> Decision:
    ctx = RequestContext(path="/v1/completions", subset=subset)
    return app.director.route(ctx, orjson.dumps({"model": "m", "prompt": prompt}))


def test_in_flight_counts_rise_at_routing_and_fall_at_the_end() -> None:
    app = App(EppConfig(seed=1, scheduler="cache-aware"))
    app.datastore.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in (1, 2, 3)])
    prompt = "a shared system prompt. " * 40
    home = [route(app, prompt + f"question {i}") for i in range(65)]
    first = home[0].primary
    assert all(d.primary is first for d in home) and first.inflight == 65
    moved = route(app, prompt + "question 65")  # 65 in flight against 0: imbalanced
    assert moved.primary is not first and moved.primary.inflight == 1
    for d in home:
        app.director.complete(d.primary, d)
    assert first.inflight == 0
    back = route(app, prompt + "question 66")  # both hold the prefix now: the less loaded
    assert back.primary is first


def test_candidate_filtering_happens_before_it() -> None:
    app = App(EppConfig(seed=1, scheduler="cache-aware"))
    app.datastore.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in (1, 2, 3)])
    prompt = "a shared system prompt. " * 40
    home = route(app, prompt).primary
    other = next(ep for ep in app.datastore.snapshot() if ep is not home)
    assert route(app, prompt, subset=[other.key]).primary is other


def test_the_index_stays_within_its_capacity() -> None:
    index = PrefixIndex(20)
    sched = scheduler(index)
    ds, (a, b) = pool(1, 0)
    d = sched.schedule(req(), [a])
    sched.finished(d, a)  # its end unpins the blocks (the director's complete)
    for i in range(10):
        d = sched.schedule(req(b"other %d " % i * 80), [a])
        sched.finished(d, a)
        assert index.held_by(a.key) <= 20
    assert index.match(req().block_hashes, [a.key]) == {}  # evicted: a miss, the least loaded takes it
    assert sched.schedule(req(), ds.snapshot()).primary is b


def test_parameters_come_from_flags_or_an_endpoint_picker_config() -> None:
    text = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: cache-aware-scorer
  parameters: {cacheThreshold: 0.5, balanceAbsThreshold: 8, balanceRelThreshold: 2}
"""
    cfg, profile = load_text(text, EppConfig())
    assert cfg.cache_aware == CacheAwareConfig(cache_threshold=0.5, balance_abs=8, balance_rel=2.0)
    sched = build_scheduler(cfg, PrefixIndex(10_000), profile)
    scorer = sched.scorers[0].scorer
    assert isinstance(scorer, CacheAwareScorer) and scorer.imbalanced([9, 0]) and not scorer.imbalanced([8, 0])
