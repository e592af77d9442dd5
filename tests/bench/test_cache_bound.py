"""bench.lib.cache_bound: the finite-cache bound by hand, and against the infinite-cache oracle."""

from __future__ import annotations

from bench.lib.cache_bound import BlockTrace, cache_bound, run_bound
from bench.lib.client import RequestResult
from bench.lib.oracle import BLOCK_SIZE, oracle, workload_requests
from bench.lib.tables import bound_table
from bench.lib.workloads import MODEL, MultiTurnParams, SharedPrefixParams, multi_turn, shared_prefix
from prefix_epp_sim.kvcache import block_hash_seed


def trace(looked_up: tuple[int, ...], stored: tuple[int, ...]) -> BlockTrace:
    return BlockTrace(10 * max(len(looked_up), 1), 10, looked_up, stored)


# r0 stores blocks 1 and 2, r1 stores 3; then 1, 2 and 3 are each asked once, in that order.
SENDS = [trace((), (1, 2)), trace((), (3,)), trace((1,), (1,)), trace((2,), (2,)), trace((3,), (3,))]


def test_the_block_asked_again_soonest_is_kept() -> None:
    """Two blocks of room: 3 arrives with the farthest next use and is not kept (LRU would have
    dropped 1 for it, then 2 for 1, and hit nothing), so 1 and 2 hit and 3 misses."""
    assert cache_bound(SENDS, 2).cached_tokens == 20
    assert cache_bound(SENDS, 3).cached_tokens == 30  # room for all
    assert cache_bound(SENDS, 1).cached_tokens == 10  # 1 only: needed first
    assert cache_bound(SENDS, 0).cached_tokens == 0
    assert cache_bound(SENDS, 2).prompt_tokens == 50


def test_a_block_never_asked_again_leaves_room() -> None:
    """After 1's last lookup its room goes to 3, which a second lookup of 2 would otherwise keep out."""
    sends = [trace((), (1, 2)), trace((1,), (1,)), trace((), (3,)), trace((3,), (3,)), trace((2,), (2,))]
    assert cache_bound(sends, 2).cached_tokens == 30


def test_the_block_split_follows_the_oracle() -> None:
    """A prompt's looked-up blocks stop before its last token's; its answer's full blocks are stored."""
    t = BlockTrace.of(list(range(1, 10)), [10, 11, 12, 13], 4, 0)  # 9 prompt tokens, 4 generated
    assert t.prompt_tokens == 9 and len(t.looked_up) == 2  # (9 - 1) // 4
    assert len(t.stored) == 3  # 9 + 4 - 1 = 12 computed tokens (the last is never stored)
    assert len(BlockTrace.of(list(range(1, 10)), [10, 11, 12], 4, 0).stored) == 2  # 11 computed
    whole = BlockTrace.of(list(range(1, 9)), [], 4, 0)  # 8 tokens: the second block holds the last one
    assert len(whole.looked_up) == 1 and whole.looked_up == whole.stored[:1]


def _traces(requests: list[tuple[list[int], list[int]]]) -> list[BlockTrace]:
    seed = block_hash_seed(MODEL)
    return [BlockTrace.of(p, o, BLOCK_SIZE, seed) for p, o in requests]


def test_with_room_for_everything_it_is_the_infinite_cache_oracle() -> None:
    for workload in (shared_prefix(SharedPrefixParams(groups=3, per_group=4, system_tokens=320, question_tokens=48)),
                     multi_turn(MultiTurnParams(conversations=4, turns=3, first_user_tokens=300, user_tokens=50))):
        requests = workload_requests(workload)
        expected = oracle(requests, BLOCK_SIZE, block_hash_seed(MODEL))
        bound = cache_bound(_traces(requests), 10**9)
        assert expected.cached_tokens > 0
        assert (bound.cached_tokens, bound.prompt_tokens) == (expected.cached_tokens, expected.prompt_tokens)


def test_less_room_never_more_hits() -> None:
    params = MultiTurnParams(conversations=6, turns=4, first_user_tokens=300, user_tokens=50)
    requests = workload_requests(multi_turn(params))
    traces = _traces(requests)
    full = oracle(requests, BLOCK_SIZE, block_hash_seed(MODEL)).cached_tokens
    hits = [cache_bound(traces, room).cached_tokens for room in (0, 8, 32, 128, 512, 10**9)]
    assert hits == sorted(hits) and hits[0] == 0 and hits[-1] == full
    assert hits[2] < full  # 32 blocks cannot hold six conversations


def test_a_run_is_bounded_in_the_order_it_sent_its_answered_requests() -> None:
    """Request (1, 0) asks for the block (0, 0) stores: a hit only where (0, 0) was sent first; a
    request that failed stores nothing and is not counted."""
    traces = {(0, 0): trace((), (1,)), (1, 0): trace((1,), (1,)), (2, 0): trace((1,), (1,))}

    def sent(order: list[tuple[int, int]], failed: tuple[int, int] | None = None) -> list[RequestResult]:
        return [RequestResult(s, t, "x", float(k), 0.0, 500 if (s, t) == failed else 200)
                for k, (s, t) in enumerate(order)]

    assert run_bound(sent([(0, 0), (1, 0)]), traces, 4).cached_tokens == 10
    assert run_bound(list(reversed(sent([(0, 0), (1, 0)]))), traces, 4).cached_tokens == 10  # by sent_s, not list order
    assert run_bound(sent([(1, 0), (0, 0)]), traces, 4).cached_tokens == 0
    bound = run_bound(sent([(0, 0), (2, 0), (1, 0)], failed=(2, 0)), traces, 4)
    assert (bound.cached_tokens, bound.prompt_tokens) == (10, 20)


def test_the_report_sets_each_hit_rate_against_its_bound() -> None:
    rows = {"multi-turn": {"prefix-epp": {"hit_rate": 0.6, "hit_bound": 0.8}, "random": {"hit_rate": 0.3}},
            "no-reuse": {"prefix-epp": {"hit_rate": 0.0, "hit_bound": 0.0}}}
    header, rule, *body = bound_table(rows, {"multi-turn": 0.9}).splitlines()
    assert "of bound" in header and rule.startswith("|---")
    assert body == ["| multi-turn | prefix-epp | 60.0% | 80.0% | 75.0% | 90.0% |",  # random ran without a bound
                    "| no-reuse | prefix-epp | 0.0% | 0.0% | - | 0.0% |"]
    assert bound_table({"multi-turn": {"random": {"hit_rate": 0.3}}}, {}) == ""


def test_on_real_engines_the_report_sets_each_hit_rate_against_the_placement_reference_too() -> None:
    rows = {"multi-turn": {"prefix-epp": {"hit_rate": 0.6, "hit_bound": 0.8, "hit_reference": 0.75},
                           "random": {"hit_rate": 0.3, "hit_bound": 0.8}}}
    header, rule, *body = bound_table(rows, {"multi-turn": 0.9}).splitlines()
    assert "| placement reference | of reference | infinite-cache oracle |" in header
    assert rule.count("|") == header.count("|")
    assert body == ["| multi-turn | prefix-epp | 60.0% | 80.0% | 75.0% | 75.0% | 80.0% | 90.0% |",
                    "| multi-turn | random | 30.0% | 80.0% | 37.5% | - | - | 90.0% |"]
    rows["multi-turn"]["prefix-epp"]["hit_replayed"] = 0.61
    header, rule, *body = bound_table(rows, {"multi-turn": 0.9}).splitlines()
    assert "| of reference | its placement replayed | infinite-cache oracle |" in header
    assert rule.count("|") == header.count("|")
    assert body[0] == "| multi-turn | prefix-epp | 60.0% | 80.0% | 75.0% | 75.0% | 80.0% | 61.0% | 90.0% |"
