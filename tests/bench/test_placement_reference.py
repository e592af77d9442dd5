"""bench.lib.placement_reference: vLLM's block pool by hand, and the greedy clairvoyant placement.

(tests/e2e/test_vllm_cache_model.py checks the cache model against a real engine.)"""

from __future__ import annotations

import random

from bench.lib.cache_bound import BlockTrace
from bench.lib.client import RequestResult
from bench.lib.placement_reference import (
    EngineCache,
    Timed,
    _events,
    _fresh,
    _rate,
    _run,
    base_choice,
    reference,
    replay,
    run_reference,
    run_replayed,
)


def trace(*blocks: int) -> BlockTrace:
    """A prompt of len(blocks) + 1 blocks of 10 tokens: it looks up `blocks` and stores them."""
    return BlockTrace(prompt_tokens=10 * (len(blocks) + 1), block_size=10, looked_up=blocks, stored=blocks)


def test_a_finished_prompt_is_evicted_tail_first_least_recently_freed_first() -> None:
    cache = EngineCache(3)
    a, b = trace(1, 2), trace(3, 4)
    assert cache.start(a) == 0
    cache.end(a)  # 2 is freed before 1: the tail goes first
    assert cache.start(b) == 0  # one empty block, then 2 is evicted
    cache.end(b)
    assert cache.leading(a) == 1  # 1 is still there, 2 is not
    assert cache.start(a) == 1  # takes 1 back and evicts 4 (freed before 3) for 2
    assert cache.leading(b) == 1


def test_blocks_a_running_request_holds_are_never_evicted_and_are_shared() -> None:
    cache = EngineCache(2)
    a = trace(1, 2)
    cache.start(a)
    assert cache.start(trace(5, 6)) == 0  # no room: the model takes the blocks anyway (vLLM would wait)
    assert cache.leading(a) == 2
    assert cache.start(a) == 2  # a second request on the same blocks
    cache.end(a)
    assert cache.held[1] == 1 and 1 not in cache.free  # still held by the first


def test_replay_keeps_two_families_apart_where_one_engine_would_thrash() -> None:
    x, y = trace(1, 2, 3), trace(4, 5, 6)
    requests = [Timed(float(t), t + 0.5, x if t % 2 == 0 else y) for t in range(8)]
    apart = replay(requests, [t % 2 for t in range(8)], engines=2, capacity=3)
    together = replay(requests, [0] * 8, engines=2, capacity=3)
    assert together == 0.0
    assert apart == (6 * 3 * 10) / (8 * 40)  # all but each family's first request hit 3 blocks
    assert reference(requests, engines=2, capacity=3) == apart


def test_an_end_at_a_start_instant_frees_before_the_start() -> None:
    assert _events([Timed(0.0, 1.0, trace(1)), Timed(1.0, 2.0, trace(2))])[:3] == [(0.0, 1, 0), (1.0, 0, 0),
                                                                                   (1.0, 1, 1)]


def _base_only(requests: list[Timed], engines: int, capacity: int) -> float:
    events = _events(requests)
    state = _run(requests, events, (0, len(events)), _fresh(engines, capacity),
                 lambda i, s: base_choice(requests[i].trace, s.caches, s.running))
    return _rate(requests, state)


def test_the_reference_never_does_worse_than_its_base_placement() -> None:
    """Each step keeps the base choice unless another engine's replay hits more, so the greedy
    placement's hits never fall below the base placement's (and exceed it on some draws here)."""
    better = 0
    for seed in range(30):
        rng = random.Random(seed)
        families = [[rng.randrange(10**9) for _ in range(rng.randrange(2, 6))] for _ in range(5)]
        requests, t = [], 0.0
        for _ in range(25):
            f = rng.choice(families)
            t += rng.expovariate(4.0)
            requests.append(Timed(t, t + rng.uniform(0.1, 1.0), trace(*f[:rng.randrange(1, len(f) + 1)])))
        base, ref = _base_only(requests, 2, 8), reference(requests, 2, 8)
        assert ref >= base
        better += ref > base
    assert better > 0


def test_run_reference_takes_the_answered_requests_at_their_times() -> None:
    x = trace(1, 2)
    traces = {(0, 0): x, (0, 1): x, (1, 0): x}
    results = [RequestResult(0, 0, "a", 0.0, 0.0, status=200, e2e_s=0.5),
               RequestResult(0, 1, "a", 1.0, 0.0, status=200, e2e_s=0.5),
               RequestResult(1, 0, "b", 2.0, 0.0, status=503, error="no endpoint")]
    assert run_reference(results, traces, engines=2, capacity=4) == 20 / 60  # the 503 is left out


def test_a_runs_own_placement_is_replayed_only_where_every_engine_is_named() -> None:
    x, y = trace(1, 2), trace(3, 4)
    traces = {(0, 0): x, (0, 1): x, (1, 0): y, (1, 1): y}
    results = [RequestResult(s, t, "", 2.0 * t + s, 0.0, status=200, ttft_s=0.1, e2e_s=0.5,
                             decision=f"endpoint=e{s}; matched=0/2")
               for s in (0, 1) for t in (0, 1)]
    assert run_replayed(results, traces, ["e0", "e1"], capacity=2) == (2 * 20) / (4 * 30)  # apart: both hit
    assert run_replayed(results, traces, ["e1", "e0"], capacity=2) == (2 * 20) / (4 * 30)
    results[0].decision = ""
    assert run_replayed(results, traces, ["e0", "e1"], capacity=2) is None
    results[0].served_by = "e0"
    assert run_replayed(results, traces, ["e0", "e1"], capacity=2) is not None
