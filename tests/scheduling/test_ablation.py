"""--ablate (benchmark only): every switch is known and reaches its mechanism.

For each name of ABLATIONS a constructed case whose decision or model state the mechanism
decides: run with the default (nothing ablated) and with that one switch off, the observable
differs, and it is the one docs/ablation.md says the simplest behaviour gives. A few guards of
the first-token bound overlap (one of them alone already draws no bound): their case turns the
overlapping guard off in both arms, which the case's `base` names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from extproc.config.flags import FLAGS
from extproc.config.settings import ABLATIONS, EppConfig, LatencyConfig, PrefixConfig
from extproc.config.validate import check
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.prefix.hashing import block_hashes
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler
from extproc.scheduling.interfaces import Routing, SchedulingRequest
from extproc.scheduling.latency import LatencyModel
from extproc.scheduling.scheduler import Scheduler
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from testkit.scheduling import Clock

Off = tuple[str, ...]
MODEL = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.5, step_tokens=1000)
SCORER = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0, step_tokens=1000,
                       calibrate=False)


def pool(n: int) -> tuple[Datastore, list[Endpoint]]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i + 1}", 8000) for i in range(n)])
    return ds, list(ds.snapshot())


def model_of(off: Off, clock: Callable[[], float] = lambda: 0.0, **latency: object) -> LatencyModel:
    return LatencyModel(replace(MODEL, ablate=off, **latency), bytes_per_token=4, clock=clock)  # type: ignore[arg-type]


def scrape(ds: Datastore, model: LatencyModel, ep: Endpoint, at: float, **values: float) -> None:
    ds.set_metrics(ep.key, ModelServerMetrics(updated_at=at, ok=True, **values))  # type: ignore[arg-type]
    model.work(ep, at)


def request(text: bytes, rid: str = "r", max_blocks: int = 4096) -> SchedulingRequest:
    hashes = block_hashes([text], "m", block_size=PrefixConfig().block_size_bytes, max_blocks=max_blocks)
    return SchedulingRequest(request_id=rid, model="m", block_hashes=hashes, prompt_bytes=len(text))


def scheduler(off: Off, clock: Clock, index: PrefixIndex | None = None, prefix: PrefixConfig | None = None,
              **latency: object) -> Scheduler:
    cfg = EppConfig(seed=1, prefix=prefix or PrefixConfig(), latency=replace(SCORER, ablate=off, **latency))  # type: ignore[arg-type]
    return build_scheduler(cfg, index or PrefixIndex(100_000), clock=clock)


def ttft(s: Scheduler) -> PredictedTtftScorer:
    scorer = s.scorers[0].scorer
    assert isinstance(scorer, PredictedTtftScorer)
    return scorer


# -- the backlog (latency.py) ------------------------------------------------------------------
def idle_bound(off: Off) -> object:
    """Three idle scrapes with nothing routed since the first: the engine is done (0), or the
    backlog only drains (4,980 of 5,000 after 2 ms)."""
    ds, (ep,) = pool(1)
    model = model_of(off)
    model.routed(ep, 5000, 0.0, 0.0)
    for at in (0.0, 0.001, 0.002):
        scrape(ds, model, ep, at)
    return round(model.work(ep, 0.002).backlog)


def waiting_floor(off: Off) -> object:
    """10 requests wait there, of 20 tokens each on average: the backlog is at least 200."""
    ds, (ep,) = pool(1)
    model = model_of(off)
    model.routed(ep, 100, 0.0, 0.0)
    scrape(ds, model, ep, 0.0, waiting=10, running=1)
    return round(model.work(ep, 0.0).backlog)


def finish_drain(off: Off) -> object:
    """The request answered: its prefill and all before it are done (0), or still 1,000 queued."""
    _, (ep,) = pool(1)
    model = model_of(off)
    model.routed(ep, 1000, 0.0, 0.0)
    model.finished(ep, model.mark(ep), 0.0)
    return model.work(ep, 0.0).backlog


def decode_contention(off: Off) -> object:
    ds, (ep,) = pool(1)
    model = model_of(off)
    ds.acquire(ep.key)
    ds.acquire(ep.key)  # two running sequences, three steps of 1,000 tokens: + 3 x 0.5 x 2 ms
    return model.predict_ttfts([ep], [model.work(ep, 0.0)], [2500.0])[0]


# -- calibration.py ------------------------------------------------------------------------------
def bytes_per_token_case(off: Off) -> tuple[float, float]:
    """One 8,000-byte prompt the engine counted as 1,600 tokens: 5 bytes per token, learned (and
    the estimated backlog, 4,000 tokens after 100 ms of drain, rescaled by 4 / 5) or not."""
    ds, (ep,) = pool(1)
    model = model_of(off)
    scrape(ds, model, ep, 0.0, prompt_tokens=0, ttft_count=0)
    model.routed(ep, 5000, 100.0, 0.0, prompt_bytes=8000)
    scrape(ds, model, ep, 0.1, prompt_tokens=1600, ttft_count=1, ttft_sum_s=0.1)
    return model.bytes_per_token, round(model.work(ep, 0.0).backlog)


def bytes_per_token(off: Off) -> object:
    return bytes_per_token_case(off)[0]


def bpt_rescale(off: Off) -> object:
    return bytes_per_token_case(off)[1]


def calibration_median(off: Off) -> object:
    """Windows of 1, 1 and 10: the median (1), or the last window alone."""
    _, (ep,) = pool(1)
    model = model_of(off)
    w = model.work(ep, 0.0)
    for ratio in (1.0, 1.0, 10.0):
        model._move_slowdown(w, ratio, "ttft-histogram")
    return w.slowdown


def capacity_window_guard(off: Off) -> object:
    """A window that saw a capacity queue read 5x: it may not raise the slowdown (1), or it does."""
    _, (ep,) = pool(1)
    model = model_of(off)
    w = model.work(ep, 0.0)
    w.saturated_window = True
    return model._window_ratio(w, 5.0)


def pool_calibration(off: Off) -> object:
    """One endpoint measured 3x: the other, not measured yet, takes the pool's 3x, or keeps 1."""
    _, (a, b) = pool(2)
    model = model_of(off)
    wa, wb = model.works([a, b], 0.0)
    model._move_slowdown(wa, 3.0, "ttft-histogram")
    return round(wb.slowdown, 6)


def response_end_calibration(off: Off) -> object:
    """No TTFT histogram: eight responses ending at 10x their prediction calibrate the endpoint."""
    _, (ep,) = pool(1)
    clock = Clock(0.0)
    model = model_of(off, clock)
    for i in range(8):
        model.response_ended(ep, Routing(ep.key, clock.now, 50.0, 0.0, 50.0, i), clock.now + 1.0)
    return model.work(ep, clock.now).slowdown


# -- first_token.py -----------------------------------------------------------------------------
def late(off: Off, *, base_tokens: float = 4000, scrapes: tuple[float, ...] = (2.0, 3.0),
         **at_scrape: float) -> tuple[str, float, float]:
    """A request routed to an idle endpoint, without its first token at each of `scrapes`:
    (calibration source, slowdown, backlog) after the last one."""
    ds, (ep,) = pool(1)
    model = model_of(off, decode_ms_per_seq=0.0)
    scrape(ds, model, ep, 0.0, running=1, ttft_count=0)
    base = model.base_ttft_ms(ep, model.work(ep, 0.0), base_tokens)
    model.routed(ep, base_tokens, base, 0.0)
    model.admit(ep, 0.0, base, 0.0, base_tokens)
    for at in scrapes:
        scrape(ds, model, ep, at, running=1, ttft_count=0, **at_scrape)
    w = model.work(ep, scrapes[-1])
    return w.calibration_source, round(w.slowdown, 3), round(w.backlog)


def first_token_bound(off: Off) -> object:
    return late(off)[:2]


def first_token_twice(off: Off) -> object:
    return late(off, scrapes=(2.0,))[:2]  # one scrape: believed only with the switch off


def first_token_slot_guard(off: Off) -> object:
    return late(off, waiting=1)[:2]  # a queue there: the late request may have waited for a slot


def first_token_capacity_guard(off: Off) -> object:
    return late(off, waiting=1, waiting_capacity=1)[:2]  # the engine says it queues for capacity


def first_token_readable(off: Off) -> object:
    return late(off, base_tokens=30, scrapes=(0.1, 0.2))[:2]  # 13 ms predicted, 10 of them overhead


def first_token_floor(off: Off) -> object:
    """Two requests of 4,000 tokens, neither with its first token 3 s on: one of them is still to
    prefill whole, though the drain at the prior counted both done."""
    ds, (ep,) = pool(1)
    model = model_of(off, decode_ms_per_seq=0.0)
    scrape(ds, model, ep, 0.0, running=1, ttft_count=0)
    for _ in range(2):
        model.routed(ep, 4000, 410.0, 0.0)
        model.admit(ep, 0.0, 410.0, 0.0, 4000)
    scrape(ds, model, ep, 3.0, running=2, ttft_count=0)
    return round(model.work(ep, 3.0).backlog)


def first_token_step_share(off: Off) -> object:
    """A (1,000 tokens, 110 ms predicted), then B (7,000) routed before A's step began: A late by
    1 s is 1,000 / (110 + 700) slow with B priced in its step, 1,000 / 110 without."""
    ds, (ep,) = pool(1)
    model = model_of(off, decode_ms_per_seq=0.0, step_tokens=8192)
    scrape(ds, model, ep, 0.0, running=1, ttft_count=0)
    for uncached, base in ((1000, 110.0), (7000, 810.0)):
        model.routed(ep, uncached, base, 0.0)
        model.admit(ep, 0.0, base, 0.0, uncached)
    for at in (1.0, 1.1):
        scrape(ds, model, ep, at, running=1, ttft_count=0)
    return round(model.work(ep, 1.1).slowdown, 3)


# -- slots.py ------------------------------------------------------------------------------------
def slot_wait(off: Off) -> object:
    _, (ep,) = pool(1)
    slots = model_of(off).work(ep, 0.0).slots
    slots.limit, slots.occupancy_ms = 4.0, 1000.0
    return slots.wait_ms(8.0)  # 5th beyond 4 slots freeing one every 250 ms, or no wait charged


def slot_ages(off: Off) -> object:
    """Two slots, both taken 100 ms ago by a burst, held ~1 s: the next frees in 900 ms, not the
    average 500."""
    _, (ep,) = pool(1)
    slots = model_of(off).work(ep, 0.0).slots
    slots.limit, slots.occupancy_ms = 2.0, 1000.0
    slots.admit(1, 0.0)
    slots.admit(2, 0.0)
    return slots.wait_ms(2.0, 0.1)


def slot_ceiling(off: Off) -> object:
    """A queue at the most running ever seen, twice, prefill explaining none of it: a ceiling."""
    ds, (ep,) = pool(1)
    model = model_of(off)
    for at in (0.0, 0.1):
        scrape(ds, model, ep, at, waiting=3, running=4)
    return model.work(ep, 0.1).slots.limit


def pool_limit(off: Off) -> object:
    """One endpoint showed its limit (4, the engine's capacity reason): the pool's limit, or none."""
    ds, (a, b) = pool(2)
    model = model_of(off)
    model.works([a, b], 0.0)
    scrape(ds, model, a, 0.0, waiting=2, running=4, waiting_capacity=2)
    return model.pool_limit


# -- scorers/predicted_ttft.py ------------------------------------------------------------------
def family_memory(off: Off) -> object:
    """The index forgot a family's prefix; its home, 100 ms busier, keeps it (a copy elsewhere
    would evict 2,000 tokens), or the idle replica takes it."""
    clock = Clock()
    _, (a, b) = pool(2)
    index = PrefixIndex(130)
    s = scheduler(off, clock, index, eviction_weight=2.0)
    system = b"H" * 8000
    first = s.schedule(request(system + b"a" * 40, "h0"), [a, b]).primary
    clock.now += 10.0
    s.schedule(request(system + b"b" * 40, "h1"), [a, b])
    other = b if first is a else a
    index.remove_endpoint(first.key)
    index.record(first.key, list(range(130)))
    index.record(other.key, list(range(1000, 1130)))
    clock.now += 10.0
    ttft(s).model.routed(first, 1000, None, clock.now)
    return s.schedule(request(system + b"c" * 40, "h2"), [a, b]).primary is first


def homes_placement(off: Off) -> object:
    """Full caches; a is home to three families: a fourth new one goes to b, 10 ms busier, or to a."""
    clock = Clock()
    _, (a, b) = pool(2)
    index = PrefixIndex(130)
    s = scheduler(off, clock, index, eviction_weight=1.0)
    index.record(a.key, request(b"F" * 8000).block_hashes)
    index.record(b.key, request(b"G" * 8000).block_hashes)
    ttft(s).model.routed(b, 100_000, None, clock.now)
    for i in range(3):
        s.schedule(request(bytes([65 + i]) * 4000, f"f{i}"), [a, b])
    clock.now += 100.0
    ttft(s).model.routed(b, 100, None, clock.now)
    return s.schedule(request(b"N" * 4000, "new"), [a, b]).primary.key


def fresh_tail_placement(off: Off) -> object:
    """Both hold a system prompt of 500 tokens; a prompt of 1,000 is half fresh: placed where
    fewer tokens were inserted lately (a, 10 ms busier), or by the queue alone (b)."""
    clock = Clock()
    _, (a, b) = pool(2)
    index = PrefixIndex(130)
    s = scheduler(off, clock, index, eviction_weight=1.0)
    prefix = b"S" * 2000
    for ep, other in ((a, b"F"), (b, b"G")):
        index.record(ep.key, request(other * 8000).block_hashes)
        index.record(ep.key, request(prefix).block_hashes)
    ttft(s).model.routed(a, 300, None, clock.now)
    ttft(s).model.routed(b, 100_000, None, clock.now)
    clock.now += 100.0
    ttft(s).model.routed(a, 100, None, clock.now)
    return s.schedule(request(prefix + b"q" * 2000, "q"), [a, b]).primary.key


def bounded_reuse(off: Off) -> object:
    """Four requests of one system prompt in flight on its holder: the fifth is over the bound
    there (3 reusing > slack 2, load 4 + 1 > ceil(1.25 x 5 / 2)) and goes to the idle replica,
    or keeps its warm hit."""
    clock = Clock()
    ds, (a, b) = pool(2)
    s = scheduler(off, clock, decode_ms_per_seq=0.5)
    system = b"R" * 4096
    holder = None
    for i in range(4):
        holder = s.schedule(request(system + bytes([48 + i]) * 40, f"h{i}"), [a, b]).primary
        ds.acquire(holder.key)
        clock.now += 10.0  # its prefill done; the request still decoding
    assert holder is not None
    return s.schedule(request(system + b"z" * 40, "h4"), [a, b]).primary is holder


def new_prompt_bound(off: Off) -> object:
    """A prompt nobody holds; a is cheaper but holds 3 requests, over its share of the bound
    (ceil(1.25 x 4 / 2) = 3): b takes it, or a does."""
    clock = Clock()
    ds, (a, b) = pool(2)
    s = scheduler(off, clock)
    for _ in range(3):
        ds.acquire(a.key)
    ttft(s).model.routed(b, 500, None, clock.now)
    return s.schedule(request(b"N" * 4000, "n"), [a, b]).primary.key


def whole_match(off: Off) -> object:
    """A 1,000-token document hashed only as far as 8 blocks, asked again: cached whole, or only
    its 128 hashed tokens."""
    clock = Clock()
    _, (a, b) = pool(2)
    s = scheduler(off, clock, prefix=PrefixConfig(max_prefix_blocks=8))
    doc = b"D" * 4000
    first = s.schedule(request(doc + b"q1" * 20, "d1", max_blocks=8), [a, b]).primary
    clock.now += 100.0
    d = s.schedule(request(doc + b"q2" * 20, "d2", max_blocks=8), [a, b])
    assert d.request is not None
    return round(d.request.predictions[first.key][1])


def kv_usage_fullness(off: Off) -> object:
    _, (ep,) = pool(1)
    scorer = ttft(scheduler(off, Clock()))
    ep.metrics = ModelServerMetrics(kv_usage=0.75, ok=True)  # the engine's blocks 75 % held; the index's none
    return scorer._fullness(ep)


def capacity_auto_tune(off: Off) -> object:
    """An engine of 100 blocks of 16 tokens: the index keeps 100 x 16 x 4 / 64 = 100 blocks for it."""
    _, (ep,) = pool(1)
    index = PrefixIndex(100_000)
    s = scheduler(off, Clock(), index)
    ep.metrics = ModelServerMetrics(num_gpu_blocks=100, block_size=16, ok=True)
    s.schedule(request(b"C" * 400), [ep])
    return index.capacity(ep.key)


# -- scheduler.py ------------------------------------------------------------------------------
def pins(off: Off) -> object:
    """A running request's blocks are pinned (out of the LRU order) until it ends."""
    _, (ep,) = pool(1)
    index = PrefixIndex(100_000)
    s = scheduler(off, Clock(), index)
    s.schedule(request(b"P" * 640), [ep])
    index.flush()
    return ep.key in index._pinned


CASES: dict[str, tuple[Callable[[Off], object], Off]] = {
    "idle-bound": (idle_bound, ()),
    "waiting-floor": (waiting_floor, ()),
    "finish-drain": (finish_drain, ()),
    "decode-contention": (decode_contention, ()),
    "bytes-per-token": (bytes_per_token, ()),
    "bpt-rescale": (bpt_rescale, ()),
    "calibration-median": (calibration_median, ()),
    "capacity-window-guard": (capacity_window_guard, ()),
    "pool-calibration": (pool_calibration, ()),
    "response-end-calibration": (response_end_calibration, ()),
    "first-token-bound": (first_token_bound, ()),
    "first-token-twice": (first_token_twice, ()),
    "first-token-slot-guard": (first_token_slot_guard, ()),
    # A capacity queue is a queue too: the slot guard alone already draws no bound.
    "first-token-capacity-guard": (first_token_capacity_guard, ("first-token-slot-guard",)),
    "first-token-readable": (first_token_readable, ()),
    "first-token-step-share": (first_token_step_share, ()),
    "first-token-floor": (first_token_floor, ()),
    "slot-wait": (slot_wait, ()),
    "slot-ages": (slot_ages, ()),
    "slot-ceiling": (slot_ceiling, ()),
    "pool-limit": (pool_limit, ()),
    "family-memory": (family_memory, ()),
    "homes-placement": (homes_placement, ()),
    "fresh-tail-placement": (fresh_tail_placement, ()),
    "bounded-reuse": (bounded_reuse, ()),
    "new-prompt-bound": (new_prompt_bound, ()),
    "whole-match": (whole_match, ()),
    "kv-usage-fullness": (kv_usage_fullness, ()),
    "capacity-auto-tune": (capacity_auto_tune, ()),
    "pins": (pins, ()),
}

# What each case gives with the mechanism on, and off (the simplest behaviour in its place).
EXPECTED: dict[str, tuple[object, object]] = {
    "idle-bound": (0, 4980),
    "waiting-floor": (200, 100),
    "finish-drain": (0.0, 1000.0),
    "decode-contention": (10 + 250 + 3 * 0.5 * 2, 10 + 250),
    "bytes-per-token": (5.0, 4),
    "bpt-rescale": (3200, 4000),
    "calibration-median": (1.0, 10.0),
    "capacity-window-guard": (1.0, 5.0),
    "pool-calibration": (3.0, 1.0),
    "response-end-calibration": (10.0, 1.0),
    "first-token-bound": (("first-token-wait", round(2000 / 410, 3)), ("prior", 1.0)),
    "first-token-twice": (("prior", 1.0), ("first-token-wait", round(2000 / 410, 3))),
    "first-token-slot-guard": (("prior", 1.0), ("first-token-wait", round(2000 / 410, 3))),
    "first-token-capacity-guard": (("prior", 1.0), ("first-token-wait", round(2000 / 410, 3))),
    "first-token-readable": (("prior", 1.0), ("first-token-wait", round(100 / 13, 3))),
    "first-token-step-share": (round(1000 / 810, 3), round(1000 / 110, 3)),
    "first-token-floor": (4000, 0),
    "slot-wait": (1250.0, 0.0),
    "slot-ages": (900.0, 500.0),
    "slot-ceiling": (4.0, -1.0),
    "pool-limit": (4.0, -1.0),
    "family-memory": (True, False),
    "homes-placement": ("10.0.0.2:8000", "10.0.0.1:8000"),
    "fresh-tail-placement": ("10.0.0.1:8000", "10.0.0.2:8000"),
    "bounded-reuse": (False, True),
    "new-prompt-bound": ("10.0.0.2:8000", "10.0.0.1:8000"),
    "whole-match": (0, 1010 - 128),
    "kv-usage-fullness": (0.75, 0.0),
    "capacity-auto-tune": (100, 100_000),
    "pins": (True, False),
}


def test_every_switch_has_a_case() -> None:
    assert set(CASES) == set(ABLATIONS) == set(EXPECTED)


@pytest.mark.parametrize("name", ABLATIONS)
def test_each_switch_reaches_its_mechanism(name: str) -> None:
    case, base = CASES[name]
    on, off = EXPECTED[name]
    assert case(base) == on
    assert case((*base, name)) == off


def test_unknown_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown ablation calibraton; known: idle-bound, "):
        model_of(("calibraton",))
    problems = check(replace(EppConfig(), latency=LatencyConfig(ablate=("pins", "homes"))))
    assert problems == [f"--ablate: unknown mechanism homes; known: {', '.join(ABLATIONS)}"]
    assert check(replace(EppConfig(), latency=LatencyConfig(ablate=ABLATIONS))) == []


def test_one_flag_row_sets_the_switches_and_says_benchmark_only() -> None:
    (row,) = [f for f in FLAGS if f.path == "latency.ablate"]
    assert row.name == "--ablate" and row.help.startswith("benchmark only") and not row.first
    assert row.kind.parse("pins, slot-wait") == ("pins", "slot-wait")
    assert EppConfig().latency.ablate == ()
