"""The wait for a sequence slot (extproc/scheduling/slots.py, latency.py) against hand-computed sequences."""

from __future__ import annotations

import pytest

from extproc.config.settings import LatencyConfig
from extproc.core.datastore import Datastore, EndpointSpec, ModelServerMetrics
from extproc.scheduling.interfaces import Routing
from extproc.scheduling.latency import LatencyModel
from extproc.scheduling.slots import SlotState
from testkit.scheduling import Clock, one_endpoint

# Round numbers: 0.1 ms per token, overhead 10 ms, no decode contention, 1,000 tokens per step.
CONFIG = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0, step_tokens=1000)


def metrics(waiting: float, running: float, *, kv: float = 0.3, capacity: float = -1.0,
            at: float = 0.0) -> ModelServerMetrics:
    return ModelServerMetrics(waiting=waiting, running=running, kv_usage=kv, waiting_capacity=capacity,
                              updated_at=at, ok=True)


def test_the_slot_wait_follows_the_queue_beyond_the_learned_limit() -> None:
    s = SlotState()
    assert s.wait_ms(50) == 0.0 and s.describe() == "slots=unknown occupancy=unknown"
    for running in (3, 6, 8):  # no queue: the limit is not seen yet
        s.observe(metrics(0, running))
    s.observe(metrics(2, 8))  # a queue at the peak, once: not yet a ceiling
    assert s.limit == -1.0
    s.observe(metrics(4, 8))  # again at the same level: the engine admits no more than 8
    assert (s.limit, s.limit_source, s.saturated) == (8, "ceiling", True)
    assert s.wait_ms(20) == 0.0  # the occupancy is still unknown: no wait charged, none assumed
    # Occupancy from response ends: 200 ms, then 400 ms of which 100 ms was the charged wait.
    s.finished(200.0, 0.0)
    s.finished(400.0, 100.0)
    assert s.occupancy_ms == pytest.approx(200 + 0.2 * (300 - 200))  # 220
    assert s.describe() == "slots=8(ceiling) occupancy=220ms"
    # ahead = load - 8 + 1; one slot frees every 220 / 8 = 27.5 ms.
    assert [s.wait_ms(load) for load in (0, 7, 8, 9, 12, 16)] == pytest.approx(
        [0.0, 0.0, 27.5, 55.0, 137.5, 247.5])
    s.observe(metrics(0, 10))  # 10 running without a queue: 8 was no limit
    assert s.limit == -1.0 and s.wait_ms(16) == 0.0 and not s.saturated


def test_after_a_burst_the_wait_is_read_from_the_running_requests_ages() -> None:
    """Four slots, 1,000 ms occupancy. Eight requests routed together: the four running free their
    slots together, ~900 ms after the 100 ms they have run, not one every 250 ms as the average
    assumes."""
    s = SlotState(occupancy_ms=1000.0, limit=4.0, limit_source="capacity-reason")
    for token in range(8):
        s.admit(token, 10.0)
    assert s.wait_ms(4) == pytest.approx(250.0)  # without the clock: the average
    assert s.wait_ms(4, 10.1) == pytest.approx(900.0)  # the first release, 900 ms away
    assert s.wait_ms(8, 10.1) == pytest.approx(900.0 + 1000.0)  # fifth in the queue: a second round
    assert s.wait_ms(9, 10.1) == pytest.approx(6 * 250.0)  # a ninth the picker did not route: the average
    # Staggered ages (0, 250, 500, 750 ms): the releases come every 250 ms, as the average says.
    s = SlotState(occupancy_ms=1000.0, limit=4.0, limit_source="capacity-reason")
    for token, at in enumerate((9.25, 9.5, 9.75, 10.0)):
        s.admit(token, at)
    assert s.wait_ms(4, 10.0) == pytest.approx(250.0)
    assert s.wait_ms(5, 10.0) == pytest.approx(500.0)
    # Requests the picker did not route there (another picker's) make the ages incomplete: the average.
    assert s.wait_ms(6, 10.0) == pytest.approx(750.0)
    s.leave(0)
    s.leave(1)
    assert s.wait_ms(4, 10.0) == pytest.approx(250.0) and len(s.admitted) == 2


def test_the_requests_still_holding_slots_bound_the_occupancy_from_below() -> None:
    """Four slots, no response ended yet: before this bound a full engine's slots read as free
    until the first end (~3 s into a decode-bound run), and a short first sample (a 1-token probe,
    15 ms) read them as turning over every 4 ms."""
    s = SlotState(limit=4.0, limit_source="capacity-reason")
    for token, at in enumerate((10.0, 10.5, 11.0, 11.5, 11.9, 11.95)):
        s.admit(token, at)
    assert s.wait_ms(6) == 0.0  # no clock, no occupancy: unknown, no wait
    # At 12.0 the 4 oldest (the holders) are 2,000, 1,500, 1,000 and 500 ms old; the 2nd oldest
    # bounds T: 1,500 ms. 7th in line: ahead = 7 - 4 + 1 = 4, the average 4 x 1,500 / 4 = 1,500 ms;
    # by the ages the holders free their slots in (0, 0, 500, 1,000) ms and the 4th release is at
    # 1,000 ms, so the average stands.
    assert s.wait_ms(6, 12.0) == pytest.approx(3 * 1500 / 4)  # 6 in flight: ahead 3
    s.admit(6, 11.99)
    assert s.wait_ms(7, 12.0) == pytest.approx(1500.0)
    # A 15 ms first sample does not undo it.
    s.finished(15.0, 0.0)
    assert s.occupancy_ms == 15.0 and s.wait_ms(7, 12.0) == pytest.approx(1500.0)
    # Staggered ages in steady state (T = 1,000 ms, holders 3,000, 400, 300 and 200 ms old): one
    # long request does not bind; the ages read the releases at (0, 600, 700, 800) ms.
    s = SlotState(occupancy_ms=1000.0, limit=4.0, limit_source="capacity-reason")
    for token, at in enumerate((9.0, 11.6, 11.7, 11.8, 11.9)):
        s.admit(token, at)
    assert s.wait_ms(5, 12.0) == pytest.approx(max(2 * 1000 / 4, 600.0))


def test_a_queue_of_prompts_waiting_for_prefill_is_no_slot_limit() -> None:
    s = SlotState()
    for _ in range(3):  # 6 waiting at the peak, but 4 requests' worth of prefill still queued there
        s.observe(metrics(6, 5), prefill_queued=4.0)
    assert s.limit == -1.0 and not s.saturated
    for _ in range(2):  # the prefill is done and the queue stays: it waits for slots
        s.observe(metrics(6, 5), prefill_queued=3.0)
    assert (s.limit, s.limit_source) == (5, "ceiling")


def test_the_limit_comes_from_the_capacity_reason_or_a_full_cache_at_once() -> None:
    s = SlotState()
    s.observe(metrics(3, 5, capacity=3))  # the engine says they wait for capacity
    assert (s.limit, s.limit_source) == (5, "capacity-reason")
    s = SlotState()
    s.observe(metrics(3, 5, capacity=0))  # it says they do not (prefill budget): nothing learned,
    s.observe(metrics(3, 5, capacity=0))  # even at the same level twice
    assert s.limit == -1.0 and not s.saturated
    s = SlotState()
    s.observe(metrics(0, 9))
    s.observe(metrics(2, 4, kv=0.97))  # below the peak, but the KV cache is full
    assert (s.limit, s.limit_source) == (4, "kv-full")


def test_a_saturated_endpoint_is_charged_the_slot_wait_not_its_prefill_backlog_twice() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    w = model.work(ep, clock.now)
    w.slots.limit, w.slots.occupancy_ms = 4.0, 400.0  # one slot frees every 100 ms
    for _ in range(6):
        ds.acquire(ep.key)  # 6 in flight: this request is 3rd beyond the 4 slots
    model.routed(ep, 500, None, clock.now)  # 500 tokens of prefill backlog: 50 ms
    ttft, base, wait = model.predict(ep, w, 1000)
    assert base == pytest.approx(10 + 1500 * 0.1)  # 160 ms: backlog + own prefill
    assert wait == pytest.approx(300.0)
    assert ttft == pytest.approx(max(160.0, 300 + 10 + 1000 * 0.1))  # 410 ms
    # Without a queue beyond the slots the backlog prediction stands.
    for _ in range(4):
        ds.release(ep)
    assert model.predict(ep, w, 1000) == pytest.approx((160.0, 160.0, 0.0))
    # A slower engine pays its slowdown on the prefill, not on the measured wait.
    w.slowdown = 2.0
    for _ in range(4):
        ds.acquire(ep.key)
    assert model.predict(ep, w, 1000)[0] == pytest.approx(300 + 2 * 110)


def test_occupancy_is_learned_from_response_ends_through_the_model() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    for _ in range(2):  # the engine queues at 2 running, twice: limit 2
        clock.now += 0.1
        ds.set_metrics(ep.key, metrics(3, 2, at=clock.now))
        model.work(ep, clock.now)
    start = clock.now
    clock.now += 0.5
    model.response_ended(ep, Routing(ep.key, start, 50.0, 0.0, -1.0), clock.now)
    w = model.work(ep, clock.now)
    assert w.slots.occupancy_ms == pytest.approx(500.0)
    assert w.slots.limit == 2
    # The scraped load is 2 running + 3 waiting: 4th beyond the 2 slots, one frees every 250 ms.
    assert model.predict(ep, w, 0)[2] == pytest.approx(4 * 250.0)
    assert model.describe(ep, w, 1000.0) == (
        "slots=2(ceiling) occupancy=500ms slot_wait=1000ms queue=scraped slowdown=1.00(prior)")


def test_the_queue_share_prefill_explains_is_the_routed_prefill_not_the_corrected_backlog() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    for _ in range(4):
        model.routed(ep, 1000, None, clock.now)  # 4 requests of 100 ms prefill each
    for _ in range(2):  # 8 waiting at 2 running, twice, while those 4 prefills are still queued
        clock.now += 0.01
        ds.set_metrics(ep.key, metrics(8, 2, at=clock.now))
        w = model.work(ep, clock.now)
    assert w.slots.limit == -1.0 and w.backlog >= 8 * w.mean_uncached  # the scrape raised the backlog
    clock.now += 0.5  # the routed prefill is done (each scrape still raises the corrected backlog)
    for _ in range(2):
        clock.now += 0.01
        ds.set_metrics(ep.key, metrics(8, 2, at=clock.now))
        w = model.work(ep, clock.now)
    assert (w.slots.limit, w.slots.limit_source) == (2, "ceiling")


def test_an_endpoint_that_never_queued_takes_the_pools_admission_limit() -> None:
    """A shows 8 slots (a capacity queue); B, never full yet, is charged the same limit: without
    it, B looks free until it queues, and the picker sends it what A would have taken."""
    clock = Clock()
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000), EndpointSpec("10.0.0.2", 8000)])
    a, b = ds.snapshot()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    ds.set_metrics(b.key, metrics(0, 9, at=clock.now))
    wb = model.work(b, clock.now)
    wb.slots.finished(800.0, 0.0)  # occupancy 800 ms
    assert model.predict(b, wb, 0)[2] == 0.0  # no limit known anywhere: no wait
    assert wb.slots.describe(model.pool_limit) == "slots=unknown occupancy=800ms"
    ds.set_metrics(a.key, metrics(3, 8, capacity=3, at=clock.now))
    model.work(a, clock.now)
    assert model.pool_limit == 8
    clock.now += 0.05
    ds.set_metrics(b.key, metrics(0, 8, at=clock.now))
    wb = model.work(b, clock.now)
    # 8 there (running, no queue): ahead = 8 - 8 + 1 = 1, one slot every 800 / 8 = 100 ms.
    assert model.predict(b, wb, 0)[2] == pytest.approx(100.0)
    assert wb.slots.describe(model.pool_limit) == "slots=8(pool) occupancy=800ms"


def test_the_batched_predictions_are_the_per_endpoint_ones_to_the_bit() -> None:
    """predict_ttfts (the scorer's one loop) and works() against predict()[0] and work() one by one,
    over endpoints with and without a scrape, a slot limit (their own or the pool's), a queue beyond
    it, an occupancy learned or only bounded by the ages of the requests there, and decode contention."""
    config = LatencyConfig(prefill_ms_per_token=0.137, overhead_ms=9.3, decode_ms_per_seq=0.71, step_tokens=512)
    ds = Datastore()
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, 9)])
    eps = list(ds.snapshot())
    for i, ep in enumerate(eps[:6]):
        ds.set_metrics(ep.key, metrics(i % 3, 1 + i, at=1.0))
    for i, ep in enumerate(eps):
        for _ in range(i):
            ds.acquire(ep.key)
    runs = []
    for batched in (False, True):
        clock = Clock()
        model = LatencyModel(config, bytes_per_token=4, clock=clock)
        for i, ep in enumerate(eps):
            model.routed(ep, 300.0 * i, None, clock.now)
            w = model.work(ep, clock.now)
            if i % 2:
                w.slots.limit, w.slots.occupancy_ms, w.slowdown = 2.0, 90.0 + i, 1.0 + i / 7
            elif i % 4 == 2:  # no limit of its own: the pool's stands for it
                w.slots.occupancy_ms = 50.0 + i
            elif i == 4:  # no occupancy yet: the ages of its requests bound it
                for _ in range(i):
                    model.admit(ep, clock.now - 0.5, 100.0, 0.0)
        model.pool_limit = 3.0
        clock.now += 0.0123
        works = model.works(eps, clock.now) if batched else [model.work(ep, clock.now) for ep in eps]
        uncached = [0.0, 1.0, 511.0, 512.0, 513.0, 4000.5, 77.0, 10000.0]
        if batched:
            ttfts = model.predict_ttfts(eps, works, uncached)
        else:
            ttfts = [model.predict(ep, w, u)[0] for ep, w, u in zip(eps, works, uncached, strict=True)]
        runs.append((ttfts, [(w.backlog, w.routed_backlog, w.churn, w.slots.limit) for w in works]))
    assert runs[0] == runs[1]  # exactly equal floats, not approximately
    assert any(model.predict(ep, w, 0.0)[2] > 0 for ep, w in zip(eps, works, strict=True))  # a wait was charged
