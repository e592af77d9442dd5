"""bench.lib.workloads mixed-length and bursts: counts, exact token lengths, timing, prefix sharing, sizing."""

from __future__ import annotations

from collections import Counter, defaultdict

from bench.lib.oracle import workload_oracle
from bench.lib.runner import sim_settings
from bench.lib.workloads import BurstParams, MixedLengthParams, build, bursts, mixed_length
from extproc.tokenization.builtin import count

SMALL_MIXED = MixedLengthParams(short_requests=40, short_systems=3, short_system_tokens=70, short_question_tokens=30,
                                long_docs=4, long_doc_tokens=2950, long_question_tokens=50)


def test_mixed_length_counts_and_exact_token_lengths() -> None:
    w = mixed_length(SMALL_MIXED)
    lengths = Counter(count(s.prompts[0]) for s in w.sessions)
    assert lengths == {100: 40, 3000: 2 + 3 + 2 + 3}  # every document asked 2 or 3 times, alternately
    full = build("mixed-length")
    assert full.requests == 950 + 50
    long = [s for s in full.sessions if s.label.startswith("doc")]
    assert len(long) == 50 and len(long) / full.requests == 0.05
    assert {count(s.prompts[0]) for s in long} == {30_000}
    assert {count(s.prompts[0]) for s in full.sessions if s.label.startswith("s")} == {1000}
    assert 45 <= full.duration_s <= 55  # ~50 s of load at 20 requests/s
    assert build("mixed-length", quick=True).requests == 317 + 17  # about a third


def test_mixed_length_reuse_short_prompts_share_a_few_systems_documents_their_text() -> None:
    w = mixed_length(SMALL_MIXED)
    by_label: dict[str, list[str]] = defaultdict(list)
    for s in w.sessions:
        by_label[s.label].append(s.prompts[0])
    shorts = [k for k in by_label if k.startswith("s")]
    assert len(shorts) == 3
    for label, prompts in by_label.items():
        head = 70 if label.startswith("s") else 2950
        # Same system prompt / document within a label; each request its own question.
        assert len({p[:len(p) - len(p.split("\n", 1)[1]) - 1] for p in prompts}) == 1, label
        assert len(set(prompts)) == len(prompts)
        assert all(count(p.split("\n", 1)[0]) == head for p in prompts)
    starts = [s.start_s for s in w.sessions]
    assert starts == sorted(starts) and starts[0] == 0.0


def test_bursts_arrive_within_100_ms_on_a_new_prefix_each() -> None:
    p = BurstParams(bursts=3, per_burst=50, gap_s=8.0, system_tokens=600, question_tokens=120)
    w = bursts(p)
    assert w.requests == 150
    by_burst: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for s in w.sessions:
        assert count(s.prompts[0]) == 720
        by_burst[s.label].append((s.start_s, s.prompts[0]))
    assert sorted(by_burst) == ["b0", "b1", "b2"]
    systems = set()
    for b, items in by_burst.items():
        k = int(b[1:])
        starts = [t for t, _ in items]
        assert len(items) == 50
        assert k * 8.0 <= min(starts) and max(starts) < k * 8.0 + 0.1  # all 50 within 100 ms
        heads = {prompt.split("\n", 1)[0] for _, prompt in items}
        assert len(heads) == 1 and count(heads.pop()) == 600  # one shared system prompt per burst
        systems.add(items[0][1].split("\n", 1)[0])
        assert len({prompt for _, prompt in items}) == 50  # each its own question
    assert len(systems) == 3  # a NEW prefix every burst
    full, quick = build("bursts"), build("bursts", quick=True)
    assert full.requests == 600 and quick.requests == 200
    assert 40 <= full.duration_s <= 50


def test_new_workloads_size_the_kv_cache_for_their_largest_requests() -> None:
    for name, largest_tokens in (("mixed-length", 30_000 + 64), ("bursts", 7200 + 64)):
        w = build(name, quick=True)
        o = workload_oracle(w)
        assert o.largest_request_blocks == -(-largest_tokens // 16)
        sim = sim_settings(o, 4, 1.0, w)
        # Room for the workload's running headroom of its largest requests plus the cached prefixes.
        assert sim.kv_cache_blocks >= w.running_headroom * o.largest_request_blocks + o.working_set_blocks // 2
        assert sim.kv_cache_blocks * sim.block_size >= sim.max_model_len >= largest_tokens  # the sim accepts them
    assert build("bursts").running_headroom * 4 >= 50  # a burst spread over 4 replicas runs at once
