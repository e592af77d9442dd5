"""bench.replay: the engines' caches replayed from per-request records, on constructed sequences."""

from __future__ import annotations

from bench.lib.oracle import BLOCK_SIZE
from bench.lib.workloads import MODEL, body, build
from bench.replay import Sent, analyse, records, replay
from extproc.tokenization.builtin import encode
from prefix_epp_sim.kvcache import block_hash_seed, hash_blocks

PREFIX = list(range(1000, 1000 + 10 * BLOCK_SIZE))  # 10 blocks shared by group "g"


def sent(i: int, group: str, start: float, replica: str, own: int, cached: int = 0) -> Sent:
    tokens = (PREFIX if group == "g" else list(range(5000 + 1000 * i, 5000 + 1000 * i + 10 * BLOCK_SIZE)))
    tokens = tokens + list(range(90_000 + 100 * i, 90_000 + 100 * i + own))
    return Sent(i, group, start, start + 0.5, replica, len(tokens), 16, tuple(hash_blocks(tokens, BLOCK_SIZE, 1)),
                cached)


def test_each_request_is_classified_by_what_the_caches_held_when_it_was_sent() -> None:
    seq = [
        sent(0, "g", 0.0, "a", 32),  # cold: nobody holds g
        sent(1, "g", 1.0, "a", 32, cached=10 * BLOCK_SIZE),  # hit on a
        sent(2, "g", 2.0, "b", 32),  # a holds g's prefix, b is chosen: sent away, 10 blocks lost
        sent(3, "x", 3.0, "b", 0),  # other groups' first requests: cold
        sent(4, "y", 4.0, "a", 0),
    ]
    out = replay(seq, blocks=24)
    kinds = out["kinds"]
    assert kinds == {"cold": 3, "hit": 1, "sent away": 1}
    assert out["lost_tokens"] == 10 * BLOCK_SIZE
    assert out["cached"][1] == 10 * BLOCK_SIZE and out["cached"][0] == 0


def test_a_prefix_evicted_everywhere_is_evicted_not_cold() -> None:
    seq = [
        sent(0, "g", 0.0, "a", 0),
        sent(1, "x", 1.0, "a", 0),  # each request takes 11 blocks (10 + 1 for its output) of 24:
        sent(2, "y", 2.0, "a", 0),  # x, y and z push g's blocks out of the LRU
        sent(3, "z", 3.0, "a", 0),
        sent(4, "g", 4.0, "a", 0),
    ]
    out = replay(seq, blocks=24)
    assert out["kinds"] == {"cold": 4, "evicted": 1}
    assert out["cached"][4] == 0


def test_sticky_counterfactual_keeps_each_group_on_its_first_replica() -> None:
    seq = [sent(0, "g", 0.0, "a", 32, cached=0), sent(1, "g", 1.0, "b", 32, cached=0)]
    result = analyse(seq, blocks=200)
    assert result["agree"] == 2  # the engine missed both, and so does the replay
    assert result["replayed_hit_rate"] == 0.0
    # On a, the second request would have hit its 10-block prefix.
    assert result["sticky_hit_rate"] == 10 * BLOCK_SIZE / sum(x.prompt_tokens for x in seq)
    assert result["kinds"]["sent away"] == 1


def test_records_rebuild_the_prompts_of_the_seeded_workload() -> None:
    w = build("cache-pressure", quick=True, seed=3)
    s = w.sessions[5]
    raw = [{"session": s.id, "status": 200, "error": "", "served_by": ["r1"], "sent_s": 1.0, "e2e_s": 2.0,
            "cached_tokens": 0}]
    (x,) = records(w, raw)
    tokens = encode(body(s, 0, [])[1]["prompt"])
    assert x.prompt_tokens == len(tokens) and x.group == s.label and x.end == 3.0
    assert x.hashes == tuple(hash_blocks(tokens, BLOCK_SIZE, block_hash_seed(MODEL)))
