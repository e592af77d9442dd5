"""bench.lib.oracle on hand-checkable inputs (block size 4 unless said otherwise)."""

from __future__ import annotations

import pytest

from bench.lib.oracle import oracle, workload_oracle, workload_requests
from bench.lib.workloads import MultiTurnParams, NoReuseParams, SharedPrefixParams, multi_turn, no_reuse, shared_prefix

A = list(range(1, 9))  # two full blocks of 4


def test_first_request_never_hits() -> None:
    r = oracle([(A, [])], block_size=4)
    assert (r.prompt_tokens, r.cached_tokens, r.hit_rate) == (8, 0, 0.0)


def test_later_request_hits_the_leading_blocks_seen_before() -> None:
    r = oracle([(A, []), ([*A, 9], [])], block_size=4)
    assert r.cached_tokens == 8 and r.prompt_tokens == 17
    assert r.hit_rate == pytest.approx(8 / 17)
    assert r.working_set_blocks == 2


def test_identical_prompt_recomputes_its_last_token() -> None:
    # vLLM caps hits at (prompt_tokens - 1) // block_size blocks: 7 // 4 = 1.
    assert oracle([(A, []), (A, [])], block_size=4).cached_tokens == 4


def test_matching_stops_at_the_first_different_block() -> None:
    r = oracle([(A, []), ([1, 2, 3, 4, 0, 6, 7, 8, 9], [])], block_size=4)
    assert r.cached_tokens == 4 and r.working_set_blocks == 1


def test_a_block_matches_only_behind_the_same_prefix() -> None:
    # Block [5..8] appears in both, but behind different first blocks: chained hashes differ.
    assert oracle([(A, []), ([0, 0, 0, 0, 5, 6, 7, 8, 9], [])], block_size=4).cached_tokens == 0


def test_generated_tokens_count_as_cached_for_the_next_turn() -> None:
    # Prompt 1..6, output 7, 8, 9: the first 6 + 3 - 1 = 8 tokens are computed -> 2 full blocks stored.
    r = oracle([([1, 2, 3, 4, 5, 6], [7, 8, 9]), ([*A, 10], [])], block_size=4)
    assert r.cached_tokens == 8
    assert r.largest_request_blocks == 3  # 9 tokens -> 3 blocks


def test_shared_prefix_oracle_by_hand() -> None:
    # 2 groups x 3 prompts; system prompt = 160 tokens = 10 blocks, question 32 tokens (2 blocks).
    # Per group the 2 later prompts hit the 10 system blocks: 2 groups x 2 x 160 = 640 of 6 x 192.
    w = shared_prefix(SharedPrefixParams(groups=2, per_group=3, system_tokens=160, question_tokens=32))
    r = workload_oracle(w)
    assert (r.cached_tokens, r.prompt_tokens) == (640, 1152)
    assert r.working_set_blocks == 20


def test_no_reuse_oracle_is_zero() -> None:
    assert workload_oracle(no_reuse(NoReuseParams(requests=10, tokens=100))).cached_tokens == 0


def test_chat_turn_hits_previous_prompt_and_answer() -> None:
    # The simulator stores prompt + answer; the next turn re-renders the answer as the same tokens.
    w = multi_turn(MultiTurnParams(conversations=1, turns=2, system_tokens=40, first_user_tokens=100,
                                   user_tokens=20, max_tokens=30))
    (p1, out1), (p2, _) = workload_requests(w)
    assert p2[:len(p1) + len(out1)] == p1 + out1
    r = oracle([(p1, out1), (p2, [])], block_size=16)
    assert r.cached_tokens == (len(p1) + len(out1) - 1) // 16 * 16
