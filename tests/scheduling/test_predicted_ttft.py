"""predicted-ttft-scorer in the default profile: constructed cases with known answers."""

from __future__ import annotations

import base64
from dataclasses import replace

import orjson
import pytest

from extproc.config.settings import EppConfig, LatencyConfig, PrefixConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.prefix.hashing import block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.request.media import MEDIA_TOKENS
from extproc.request.openai import Api, parse_request
from extproc.scheduling.build import build_scheduler, default_profile
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from testkit.scheduling import Clock

LATENCY = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0, step_tokens=1000,
                        calibrate=False)


def pool(n: int) -> list[Endpoint]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i + 1}", 8000) for i in range(n)])
    return list(ds.snapshot())


def request(text: bytes, rid: str = "r", key: int | None = None) -> SchedulingRequest:
    # 4 bytes per token: len(text) / 4 tokens.
    hashes = block_hashes([text], "m", block_size=PrefixConfig().block_size_bytes, max_blocks=4096)
    return SchedulingRequest(request_id=rid, model="m", block_hashes=hashes,
                             prompt_bytes=len(text), affinity_hash=key)


def scheduler(clock: Clock, index: PrefixIndex | None = None, **latency: object) -> Scheduler:
    cfg = EppConfig(seed=1, latency=replace(LATENCY, **latency))  # type: ignore[arg-type]
    return build_scheduler(cfg, index or PrefixIndex(100_000), clock=clock)


def ttft_scorer(s: Scheduler) -> PredictedTtftScorer:
    scorer = s.scorers[0].scorer
    assert isinstance(scorer, PredictedTtftScorer)
    return scorer


def test_default_profile_is_predicted_ttft_and_weighted_stays_available() -> None:
    assert default_profile(EppConfig()).scorers == (("predicted-ttft-scorer", 1.0),)
    assert default_profile(EppConfig()).filters == ()
    weighted = default_profile(EppConfig(scheduler="weighted"))
    assert weighted.filters == ("hot-spot-spill-filter",) and weighted.scorers[0] == ("prefix-cache-scorer", 5.0)
    with pytest.raises(ValueError, match="unknown scheduler"):
        default_profile(EppConfig(scheduler="fastest"))


def test_warm_replica_with_a_long_queue_loses_to_an_idle_cold_one() -> None:
    clock = Clock()
    a, b = pool(2)
    s = scheduler(clock)
    system = b"S" * 16000  # 4,000 tokens
    first = s.schedule(request(system + b"q0" * 200, "r0"), [a, b]).primary
    clock.now += 10.0  # its prefill is long done
    # A short queue on the warm replica: 400 uncached tokens there beat 4,100 anywhere else.
    d = s.schedule(request(system + b"q1" * 200, "r1"), [a, b])
    assert d.primary is first
    warm, cold = d.request.predictions[first.key], d.request.predictions[(b if first is a else a).key]  # type: ignore[union-attr]
    assert warm[1] == pytest.approx(100) and cold[1] == pytest.approx(4100)
    assert warm[0] == pytest.approx(10 + 0.1 * 100) and cold[0] == pytest.approx(10 + 0.1 * 4100)
    # Now pile 60,000 unrelated tokens onto the warm replica: waiting there costs more than a cold prefill.
    other = b if first is a else a
    ttft_scorer(s).model.routed(first, 60_000, None, clock.now)
    d = s.schedule(request(system + b"q2" * 200, "r2"), [a, b])
    assert d.primary is other
    explained = d.explain()
    assert f"predicted_ttft_ms={other.key}:420.0,{first.key}:6030.0" in explained  # r1 still queued: 100 + 60,000 + 100
    # No engine metrics here: the signals the prediction lacked are named unknown, not taken as 0.
    assert explained.endswith("signals=slots=unknown occupancy=unknown slot_wait=0ms queue=unknown "
                              "slowdown=1.00(prior)")
    # Described for the chosen endpoint only (the one reported), not for every candidate.
    assert d.request is not None and set(d.request.signals) == {other.key}


def test_a_prefix_still_prefilling_counts_as_cached_where_it_was_routed() -> None:
    """The engine caches blocks once their chunk is scheduled, and a request routed behind the
    first one is admitted after it: it finds the prefix even while the first prefill runs."""
    clock = Clock()
    eps = pool(4)
    s = scheduler(clock)
    system = b"B" * 24000  # 6,000 tokens, more than one 1,000-token step
    first = s.schedule(request(system + b"00" * 50, "r0"), eps).primary
    d = s.schedule(request(system + b"01" * 50, "r1"), eps)
    assert d.request is not None
    assert d.request.predictions[first.key][1] == pytest.approx(25)
    assert all(d.request.predictions[ep.key][1] == pytest.approx(6025) for ep in eps if ep is not first)


def test_copying_a_prefix_onto_a_full_cache_is_charged_for_what_it_evicts() -> None:
    clock = Clock()
    a, b = pool(2)
    system = b"E" * 8000  # 2,000 tokens = 125 index blocks of 64 bytes
    for eviction_weight, expected in ((0.0, "b"), (1.0, "a")):
        index = PrefixIndex(130)
        s = scheduler(clock, index, eviction_weight=eviction_weight)
        index.record(a.key, request(system).block_hashes)  # a holds the prefix, its cache is full
        index.record(b.key, request(b"F" * 8000).block_hashes)  # so is b's, with another prefix
        # a's queue: 2,300 tokens; b is idle. Without the charge b wins (10 + 210 < 10 + 240);
        # with it, copying 2,000 tokens onto b costs 200 ms more: a wins.
        ttft_scorer(s).model.routed(a, 2300, None, clock.now)
        d = s.schedule(request(system + b"x" * 400, f"w{eviction_weight}"), [a, b])
        assert d.primary is (a if expected == "a" else b)
        clock.now += 100.0


def test_a_new_prefix_on_full_caches_goes_where_fewer_families_live() -> None:
    clock = Clock()
    a, b = pool(2)
    for eviction_weight, expected in ((0.0, a), (1.0, b)):
        index = PrefixIndex(130)
        s = scheduler(clock, index, eviction_weight=eviction_weight)
        scorer = ttft_scorer(s)
        index.record(a.key, request(b"F" * 8000).block_hashes)  # both caches full
        index.record(b.key, request(b"G" * 8000).block_hashes)
        scorer.model.routed(b, 100_000, None, clock.now)  # b busy: three new families go to a
        for i in range(3):
            assert s.schedule(request(bytes([65 + i]) * 4000, f"f{i}"), [a, b]).primary is a
        clock.now += 100.0  # every queue drained
        scorer.model.routed(b, 100, None, clock.now)
        # A fourth new family: a is idle (10 + 100 ms), b is 10 ms busier; a is home to all three
        # families (mean 1.5), so placing it there is charged 1,000 tokens x 0.1 ms x 3 / 1.5.
        d = s.schedule(request(b"N" * 4000, f"new{eviction_weight}"), [a, b])
        assert d.primary is expected
        clock.now += 100.0


def test_by_churn_a_new_prefix_on_full_caches_goes_where_fewer_tokens_were_inserted() -> None:
    """a is home to more families, b inserted more tokens lately: homes picks b, churn picks a."""
    clock = Clock()
    a, b = pool(2)
    for placement, expected in (("homes", b), ("churn", a)):
        index = PrefixIndex(130)
        s = scheduler(clock, index, eviction_weight=1.0, new_prefix_placement=placement)
        scorer = ttft_scorer(s)
        index.record(a.key, request(b"F" * 8000).block_hashes)  # both caches full
        index.record(b.key, request(b"G" * 8000).block_hashes)
        scorer.model.routed(b, 100_000, None, clock.now)  # b busy: three small new families go to a
        for i in range(3):
            assert s.schedule(request(bytes([65 + i]) * 400, f"{placement}{i}"), [a, b]).primary is a
        clock.now += 100.0  # queues drained; churn x 2^(-100/120): a 300 -> 168, b 100,000 -> 56,123
        # A new 1,000-token family, both idle: homes charges a 1,000 x 0.1 ms x 3 / 1.5 = 200 ms
        # (b: 0); churn charges b 1,000 x 0.1 ms x 56,123 / 28,146 = 199 ms (a: 0.6 ms).
        assert s.schedule(request(b"N" * 4000, f"new-{placement}"), [a, b]).primary is expected
        clock.now += 100.0


@pytest.mark.parametrize(("system", "question", "charged"), [(2000, 2000, True), (4000, 1000, False)])
def test_a_mostly_fresh_prompt_goes_where_fewer_tokens_were_inserted(system: int, question: int,
                                                                     charged: bool) -> None:
    """Both replicas hold the system prompt and are full; b inserted far more lately (more
    conversations live there), a's queue is 100 tokens longer. A prompt whose larger part no
    candidate holds (500 of 1,000 tokens held) is charged by churn for that part and goes to a;
    one mostly held (1,000 of 1,250) is not charged and goes to the shorter queue, b, as it does
    for both without the charge (eviction_weight 0)."""
    clock = Clock()
    a, b = pool(2)
    prefix = b"S" * system
    for eviction_weight in (0.0, 1.0):
        index = PrefixIndex(130)
        s = scheduler(clock, index, eviction_weight=eviction_weight)
        scorer = ttft_scorer(s)
        for ep, other in ((a, b"F"), (b, b"G")):  # full caches, the system prompt most recent
            index.record(ep.key, request(other * 8000).block_hashes)
            index.record(ep.key, request(prefix).block_hashes)
        scorer.model.routed(a, 300, None, clock.now)
        scorer.model.routed(b, 100_000, None, clock.now)
        clock.now += 100.0  # queues drained; churn x 2^(-100/120): a 300 -> 168, b 100,000 -> 56,123
        scorer.model.routed(a, 100, None, clock.now)  # a 100 tokens busier: 10 ms more
        d = s.schedule(request(prefix + b"q" * question, f"q{eviction_weight}"), [a, b])
        assert d.request is not None
        fresh = d.request.predictions[b.key][1]
        assert d.request.predictions[a.key][0] == pytest.approx(d.request.predictions[b.key][0] + 10)
        assert fresh == pytest.approx((system + question) / 4 - system // 64 * 16)
        # Charged fresh tokens x 0.1 ms x churn / mean: b ~50 ms, a ~0.3 ms (500 fresh tokens).
        assert d.primary is (a if charged and eviction_weight else b)
        clock.now += 100.0


def test_an_unknown_new_prefix_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="new_prefix_placement"):
        scheduler(Clock(), new_prefix_placement="nearest")


def test_a_prompt_matched_as_far_as_it_is_hashed_counts_as_cached() -> None:
    """Hashing stops at max_prefix_blocks: a long document asked again matches every block looked
    up, and the rest of it is taken as cached, not recomputed."""
    clock = Clock()
    a, b = pool(2)
    cfg = EppConfig(seed=1, latency=LATENCY, prefix=PrefixConfig(max_prefix_blocks=8))
    s = build_scheduler(cfg, PrefixIndex(100_000), clock=clock)
    doc = b"D" * 4000  # 1,000 tokens, 62 blocks: only the first 8 (128 tokens) are hashed

    def long_request(question: bytes, rid: str) -> SchedulingRequest:
        text = doc + question
        hashes = block_hashes([text], "m", block_size=PrefixConfig().block_size_bytes, max_blocks=8)
        return SchedulingRequest(request_id=rid, model="m", block_hashes=hashes, prompt_bytes=len(text))

    first = s.schedule(long_request(b"q1" * 20, "d1"), [a, b]).primary
    clock.now += 100.0
    d = s.schedule(long_request(b"q2" * 20, "d2"), [a, b])
    assert d.primary is first and d.request is not None
    assert d.request.predictions[first.key][1] == 0.0  # not 1,010 - 128 tokens
    other = b if first is a else a
    assert d.request.predictions[other.key][1] == pytest.approx(1010)


def test_fullness_comes_from_the_prefix_index() -> None:
    clock = Clock()
    a, b = pool(2)
    index = PrefixIndex(100)
    scorer = ttft_scorer(scheduler(clock, index))
    index.record(a.key, list(range(50)))
    assert scorer._fullness(a) == 0.5 and scorer._fullness(b) == 0.0
    b.metrics = ModelServerMetrics(kv_usage=0.75, ok=True)  # running requests hold 75 % of b's blocks
    a.metrics = ModelServerMetrics(kv_usage=0.25, ok=True)
    assert scorer._fullness(a) == 0.5 and scorer._fullness(b) == 0.75


def test_affinity_credit_keeps_a_key_on_its_endpoint_until_its_queue_costs_more() -> None:
    clock = Clock()
    a, b = pool(2)
    index = PrefixIndex(100_000)
    s = scheduler(clock, index)
    key = 0xABC
    index.record(a.key, [key])
    prompt = b"P" * 8000  # 2,000 tokens, nothing shared with earlier requests
    scorer = ttft_scorer(s)
    scorer.model.routed(a, 900, None, clock.now)  # a: 900 tokens queued
    req = request(prompt, "k1", key=key)
    # a: 10 + 290 - 0.5 x 200 = 200; b: 10 + 200 = 210 -> a
    assert s.schedule(req, [a, b]).primary is a
    assert req.affinity_match == frozenset({a.key})
    clock.now += 100.0
    scorer.model.routed(a, 1100, None, clock.now)  # a: 1,100 queued -> 10 + 310 - 100 = 220 > 210 -> b
    assert s.schedule(request(b"Q" * 8000, "k2", key=key), [a, b]).primary is b


def test_a_fallback_that_served_takes_the_backlog() -> None:
    clock = Clock()
    a, b = pool(2)
    s = scheduler(clock)
    d = s.schedule(request(b"Z" * 4000, "f"), [a, b])
    other = b if d.primary is a else a
    model = ttft_scorer(s).model
    assert model.work(d.primary, clock.now).backlog == pytest.approx(1000)
    s.reassign(d, other)
    assert model.work(d.primary, clock.now).backlog == 0.0
    assert model.work(other, clock.now).backlog == pytest.approx(1000)
    assert d.predicted_ms == pytest.approx(10 + 100)


def test_a_family_keeps_its_home_after_the_index_forgot_it() -> None:
    """Under cache pressure the index forgets a prefix first; sending its family elsewhere would
    copy it into a second full cache, so the home keeps the charge-free claim."""
    clock = Clock()
    a, b = pool(2)
    index = PrefixIndex(130)
    s = scheduler(clock, index)
    system = b"H" * 8000  # 2,000 tokens, 125 index blocks
    first = s.schedule(request(system + b"a" * 40, "h0"), [a, b]).primary
    other = b if first is a else a
    clock.now += 10.0
    assert s.schedule(request(system + b"b" * 40, "h1"), [a, b]).primary is first  # 2,000 tokens shared
    index.remove_endpoint(first.key)  # the index forgot the family everywhere...
    index.record(first.key, list(range(130)))  # ...both caches are full of other prefixes
    index.record(other.key, list(range(1000, 1130)))
    clock.now += 10.0
    ttft_scorer(s).model.routed(first, 1000, None, clock.now)  # the home has 100 ms of queue
    d = s.schedule(request(system + b"c" * 40, "h2"), [a, b])
    assert d.primary is first  # 100 ms of queue < 200 ms for the 2,000 tokens a copy would evict
    assert d.request is not None and d.request.predictions[other.key][0] < d.request.predictions[first.key][0]


def test_the_end_of_a_response_tells_the_backlog() -> None:
    clock = Clock()
    a, b = pool(2)
    s = scheduler(clock)
    d = s.schedule(request(b"R" * 8000, "done"), [a, b])
    model = ttft_scorer(s).model
    assert model.work(d.primary, clock.now).backlog == pytest.approx(2000)
    s.finished(d, d.primary)
    assert model.work(d.primary, clock.now).backlog == 0.0


def test_an_engine_calibrated_far_below_the_prior_still_prefers_its_cache() -> None:
    """Every endpoint measured 10x faster than the prior: predictions fall below the prior's fixed
    cost, and the endpoint holding the prompt must still score above the cold ones (a floor at the
    prior's overhead would tie them all, leaving the choice to the tie-break)."""
    clock = Clock()
    eps = pool(3)
    index = PrefixIndex(100_000)
    system = b"C" * 384  # 96 tokens: 10 + 9.6 ms at the prior, ~2 ms calibrated, ~1 ms cached
    index.record(eps[1].key, request(system).block_hashes)
    s = scheduler(clock, index)
    for ep in eps:
        ttft_scorer(s).model.work(ep, clock.now).slowdown = 0.1
    for i in range(6):
        d = s.schedule(request(system + b"%02d" % i, f"r{i}"), eps)
        assert d.primary is eps[1]
        s.finished(d, d.primary)  # one at a time: bounded reuse (reuse.py) is not what this tests


def test_a_follow_up_turn_about_an_image_keeps_the_endpoint_that_holds_it() -> None:
    """A conversation about an image: its text is a few dozen tokens, the image hundreds on the
    engine. The warm endpoint's saving is the image's weight (extproc/request/media.py), which
    outweighs another endpoint measured a little faster."""
    image = base64.b64encode(bytes(range(256)) * 64).decode()

    def turn(n: int) -> SchedulingRequest:
        messages: list[dict[str, object]] = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": "describe the picture"}]}]
        for t in range(n):
            messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"more {t}"}]
        parsed = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": messages}))
        hashes = block_hashes(parsed.segments, "m", block_size=PrefixConfig().block_size_bytes, max_blocks=4096)
        return SchedulingRequest(request_id=f"r{n}", model="m", block_hashes=hashes,
                                 prompt_bytes=sum(map(len, parsed.segments)))

    clock = Clock()
    eps = pool(3)
    index = PrefixIndex(100_000)
    index.record(eps[1].key, turn(0).block_hashes)
    s = scheduler(clock, index)
    ttft_scorer(s).model.work(eps[0], clock.now).slowdown = 0.8  # 20% faster than the others
    d = s.schedule(turn(1), eps)
    assert d.primary is eps[1] and d.request is not None
    saving = d.request.predictions[eps[2].key][1] - d.request.predictions[eps[1].key][1]
    assert saving >= MEDIA_TOKENS
