"""bench.lib.workloads: determinism by seed, exact token lengths, and each workload's promised shape."""

from __future__ import annotations

import itertools
import random
import statistics
from collections import Counter, defaultdict

import pytest

from bench.lib.oracle import prompt_tokens
from bench.lib.workloads import (
    WORKLOADS,
    MultiTurnParams,
    NoReuseParams,
    Session,
    SharedPrefixParams,
    body,
    build,
    cache_pressure,
    hot_prefix,
    kv_cache_blocks,
    multi_turn,
    no_reuse,
    poisson_starts,
    shared_prefix,
    text,
)
from extproc.tokenization.builtin import count, render_chat
from prefix_epp_sim.kvcache import hash_blocks

SMALL = SharedPrefixParams(groups=6, per_group=5, system_tokens=300, question_tokens=60, rate=5.0)


def prompts(sessions: tuple[Session, ...]) -> list[str]:
    return [s.prompts[0] for s in sessions]


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_workload_other_seed_other_workload(name: str) -> None:
    a, b, c = build(name, quick=True, seed=3), build(name, quick=True, seed=3), build(name, quick=True, seed=4)
    assert a == b
    assert a.sessions != c.sessions
    assert a.requests == c.requests  # the seed changes content and timing, not the shape


def test_text_has_exactly_the_requested_tokens() -> None:
    rng = random.Random(1)
    for n in (5, 16, 17, 1000):
        assert count(text(rng, n, "Header 12:")) == n
    assert text(rng, 1, "Header 12:") == "Header 12:"  # never shorter than its header


def test_poisson_arrivals_start_at_zero_and_average_one_over_rate() -> None:
    starts = poisson_starts(random.Random(0), 2000, rate=4.0)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert starts[0] == 0.0 and all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.15)  # exponential: sd == mean


def test_shared_prefix_groups_share_their_system_prompt_and_nothing_else() -> None:
    w = shared_prefix(SMALL)
    by_group: dict[str, list[str]] = defaultdict(list)
    for s in w.sessions:
        by_group[s.label].append(s.prompts[0])
    assert sorted(Counter(s.label for s in w.sessions).values()) == [SMALL.per_group] * SMALL.groups
    systems = set()
    for group_prompts in by_group.values():
        system = group_prompts[0].split("\nQuestion")[0]
        assert all(p.startswith(system) for p in group_prompts)
        assert len(set(group_prompts)) == SMALL.per_group  # each has its own question
        assert count(system) == SMALL.system_tokens
        systems.add(system)
    assert len(systems) == SMALL.groups
    assert all(count(p) == SMALL.system_tokens + SMALL.question_tokens for p in prompts(w.sessions))
    # Shuffled over the run: neighbours rarely share a group (grouped order would give 24 such pairs).
    labels = [s.label for s in w.sessions]
    assert sum(a == b for a, b in itertools.pairwise(labels)) < 12


def test_requests_stream_with_usage() -> None:
    path, payload = body(shared_prefix(SMALL).sessions[0], 0, [])
    assert path == "/v1/completions"
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == SMALL.max_tokens


def test_multi_turn_turns_extend_the_previous_turn_with_its_answer() -> None:
    params = MultiTurnParams(conversations=3, turns=4, system_tokens=50, first_user_tokens=80, user_tokens=20)
    w = multi_turn(params)
    assert w.requests == 12 and all(s.turns == 4 and len(s.think_s) == 3 for s in w.sessions)
    s = w.sessions[1]
    answers = ["first answer", "second answer", "third answer"]
    for turn in range(1, s.turns):
        path, prev = body(s, turn - 1, answers)
        _, cur = body(s, turn, answers)
        assert path == "/v1/chat/completions"
        assert cur["messages"][:len(prev["messages"])] == prev["messages"]
        assert cur["messages"][len(prev["messages"])] == {"role": "assistant", "content": answers[turn - 1]}
        # As the model server renders them, turn k + its answer is a prefix of turn k+1.
        assert render_chat(cur["messages"]).startswith(render_chat(prev["messages"]) + answers[turn - 1])
    assert {m["role"] for m in body(s, 0, [])[1]["messages"]} == {"system", "user"}


def test_multi_turn_conversations_share_a_few_system_prompts() -> None:
    w = multi_turn(MultiTurnParams(conversations=40, system_prompts=3, system_tokens=40, first_user_tokens=40,
                                   user_tokens=10, turns=2))
    systems = Counter(s.system for s in w.sessions)
    assert len(systems) == 3 and min(systems.values()) > 1


def test_hot_prefix_carries_half_the_traffic_on_one_system_prompt() -> None:
    w = hot_prefix(SharedPrefixParams(groups=10, per_group=5, system_tokens=200, question_tokens=40, hot_share=0.5))
    hot = [s.prompts[0] for s in w.sessions if s.label == "hot"]
    assert len(hot) / w.requests == pytest.approx(0.5, abs=0.01)
    system = hot[0].split("\nHot question")[0]
    assert all(p.startswith(system) for p in hot) and len(set(hot)) == len(hot)
    rest = Counter(s.label for s in w.sessions if s.label != "hot")
    assert len(rest) == 10 and set(rest.values()) == {5}
    # Hot requests are spread over the run, not bunched at one end.
    positions = [i for i, s in enumerate(w.sessions) if s.label == "hot"]
    assert statistics.fmean(positions) == pytest.approx(w.requests / 2, rel=0.25)


def test_no_reuse_prompts_share_no_block() -> None:
    w = no_reuse(NoReuseParams(requests=40, tokens=400))
    seen: set[int] = set()
    for s in w.sessions:
        path, payload = body(s, 0, [])
        hashes = hash_blocks(prompt_tokens(path, payload), 16, 0)
        assert len(hashes) == 25
        assert seen.isdisjoint(hashes)
        seen.update(hashes)


def test_kv_cache_fits_the_working_set_in_the_pool_but_not_in_one_replica() -> None:
    working_set, largest = 18000, 454
    for replicas in (2, 4, 8):
        per_replica = kv_cache_blocks(working_set, largest, replicas)
        assert per_replica < working_set
        assert per_replica * replicas >= working_set + replicas * 8 * largest
    assert kv_cache_blocks(0, largest, 4) == 8 * largest  # no reuse: room for running requests only


def test_cache_pressure_pool_is_smaller_than_the_prefix_working_set() -> None:
    w = cache_pressure(SMALL)
    assert w.name == "cache-pressure" and w.requests == 30 and w.running_headroom == 0
    assert prompts(w.sessions) != prompts(shared_prefix(SMALL).sessions)  # its own seed
    working_set, largest = 33750, 454
    per_replica = kv_cache_blocks(working_set, largest, 4, w.pool_factor, w.running_headroom)
    assert working_set / (4 * per_replica) == pytest.approx(1.15, abs=0.01)  # whole pool, no headroom
    assert kv_cache_blocks(working_set, largest, 4) * 4 >= 2 * working_set  # the other workloads: 2x


def test_unknown_workload_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope")
