"""Late first tokens bound the slowdown from below (extproc/scheduling/first_token.py)."""

from __future__ import annotations

import pytest

from extproc.config.settings import LatencyConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.scheduling.first_token import MARGIN, FirstTokenWait
from extproc.scheduling.latency import LatencyModel


def observe1(f: FirstTokenWait, count: float, at: float, slowdown: float) -> float | None:
    return f.observe(count, at, slowdown)[0]


def test_an_overdue_first_token_bounds_the_slowdown_from_below() -> None:
    f = FirstTokenWait(twice=False)
    f.add(1, 0.0, 100.0, 0.0, 1000.0)  # before the engine's count was seen
    assert observe1(f, 10, 0.0, 1.0) is None  # first sight: counting begins; 10 served, which unknown
    assert len(f) == 0
    f.add(1, 0.0, 100.0, 0.0, 1000.0)  # predicted 100 ms
    assert observe1(f, 10, 0.1, 1.0) is None  # 100 ms without a first token: as predicted
    # 500 ms without it: at least 500 / 100 = 5x slower than the prior.
    assert observe1(f, 10, 0.5, 1.0) == pytest.approx(500 / MARGIN / 100)
    assert observe1(f, 10, 0.5, 6.0) is None  # no more than the slowdown already known
    assert observe1(f, 11, 0.6, 1.0) is None  # its first token came: nothing is late


def test_whichever_request_got_the_first_token_the_bound_holds() -> None:
    """A (100 ms predicted) and B (10 ms) routed; one first token came, A's or B's. One of the two
    is late either way: the bound is the smaller of the two implied slowdowns."""
    f = FirstTokenWait(twice=False)
    observe1(f, 0, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 0.0, 1000.0)
    f.add(2, 0.1, 10.0, 0.0, 1000.0)
    assert observe1(f, 1, 0.5, 1.0) == pytest.approx(min(500 / MARGIN / 100, 400 / MARGIN / 10))
    # A's response ended (it had the first token): B is the late one.
    f.remove(1)
    assert observe1(f, 1, 0.5, 1.0) == pytest.approx(400 / MARGIN / 10)


def test_a_charged_slot_wait_is_not_read_as_slowness() -> None:
    f = FirstTokenWait(twice=False)
    observe1(f, 0, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 900.0, 1000.0)  # charged 900 ms waiting for a slot, then 100 ms of prefill
    assert observe1(f, 0, 0.95, 1.0) is None  # (950 - 900) / 100 < 1
    assert observe1(f, 0, 2.0, 1.0) == pytest.approx((2000 / MARGIN - 900) / 100)


def test_an_engine_restart_starts_counting_again() -> None:
    f = FirstTokenWait(twice=False)
    observe1(f, 50, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 0.0, 1000.0)
    assert observe1(f, 3, 1.0, 1.0) is None and len(f) == 0  # the count went down: a new engine


def test_requests_without_a_first_token_are_still_to_prefill() -> None:
    f = FirstTokenWait(twice=False)
    f.observe(0, 0.0, 1.0)  # a fresh engine: nothing served before
    for token, uncached in ((1, 7000.0), (2, 500.0), (3, 3000.0)):
        f.add(token, 0.0, 400.0, 0.0, uncached)
    # No first token yet: all three wait; one may be part-way, the two smallest are whole.
    assert f.observe(0, 0.1, 1.0)[1] == 500.0 + 3000.0
    assert f.observe(1, 0.2, 1.0)[1] == 500.0  # one served: one of the other two is whole
    assert f.observe(3, 0.3, 1.0)[1] == 0.0


def test_the_model_raises_a_slow_endpoints_slowdown_before_its_first_window() -> None:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    ep = ds.snapshot()[0]
    model = LatencyModel(LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0),
                         bytes_per_token=4, clock=lambda: 0.0)

    def scrape(at: float, count: float, waiting: float = 0) -> None:
        ds.set_metrics(ep.key, ModelServerMetrics(waiting=waiting, running=1, ttft_sum_s=0.0, ttft_count=count,
                                                  updated_at=at, ok=True))
        model.work(ep, at)

    scrape(0.0, 0)
    base = model.base_ttft_ms(ep, model.work(ep, 0.0), 4000)  # 410 ms
    model.routed(ep, 4000, base, 0.0)
    model.admit(ep, 0.0, base, 0.0)
    scrape(0.3, 0)
    assert model.work(ep, 0.3).calibration_source == "prior"
    scrape(1.0, 0, waiting=2)  # a queue there: the wait may be for a slot, not slowness
    assert model.work(ep, 1.0).calibration_source == "prior"
    scrape(2.0, 0)  # 2 s and no first token: at least 2000 / 410 = 4.9x, if the next scrape agrees
    assert model.work(ep, 2.0).calibration_source == "prior"
    scrape(3.0, 0)  # still none at the next scrape: 2.0's bound, the smaller, is taken
    w = model.work(ep, 3.0)
    assert w.calibration_source == "first-token-wait"
    assert w.slowdown == pytest.approx(2000 / MARGIN / base)


def test_a_queued_scrape_bounds_only_requests_admitted_on_arrival() -> None:
    """Behind a queue, a late first token is slowness only for a request admitted on arrival; one
    that may have queued for a slot proves nothing."""
    f = FirstTokenWait(twice=False)
    f.observe(0, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 0.0, 1000.0, queued=False)
    assert f.observe(0, 0.5, 1.0, queue=True)[0] == pytest.approx(500 / MARGIN / 100)
    g = FirstTokenWait(twice=False)
    g.observe(0, 0.0, 1.0)
    g.add(1, 0.0, 100.0, 0.0, 1000.0, queued=True)
    assert g.observe(0, 0.5, 1.0, queue=True)[0] is None
    assert g.observe(0, 0.5, 1.0, queue=False)[0] == pytest.approx(500 / MARGIN / 100)  # no queue: admitted
    # One of the two oldest may have queued: which of them lacks its first token is unknown.
    h = FirstTokenWait(twice=False)
    h.observe(0, 0.0, 1.0)
    h.add(1, 0.0, 100.0, 0.0, 1000.0, queued=False)
    h.add(2, 0.0, 100.0, 0.0, 1000.0, queued=True)
    assert h.observe(1, 0.5, 1.0, queue=True)[0] is None


def test_a_slow_replica_is_raised_behind_its_prefill_queue_and_a_faster_one_keeps_its_prior() -> None:
    """One replica of three is 4x slow. Another ran 4 requests at once; the slow one got a request
    while idle and a second behind it, so it shows a queue. 2 s without a first token raises the
    slow one (its first request was admitted on arrival: fewer than 4 there). The replica whose
    first tokens so far came at its predictions keeps the prior; the one with none of its own
    takes the pool's calibration (the slow one's bound) as before."""
    ds = Datastore()
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in (1, 2, 3)])
    slow, fast, unseen = ds.snapshot()
    model = LatencyModel(LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0),
                         bytes_per_token=4, clock=lambda: 0.0)

    def scrape(ep: Endpoint, at: float, running: float, waiting: float = 0, count: float = 0,
               ttft_s: float = 0.0) -> None:
        ds.set_metrics(ep.key, ModelServerMetrics(waiting=waiting, running=running, ttft_sum_s=ttft_s,
                                                  ttft_count=count, updated_at=at, ok=True))
        model.work(ep, at)

    for ep in (slow, fast, unseen):
        scrape(ep, 0.0, running=0)
    base = model.base_ttft_ms(fast, model.work(fast, 0.0), 1000)  # 110 ms
    for _ in range(4):
        model.routed(fast, 1000, base, 0.0)
    scrape(fast, 0.2, running=4, count=2, ttft_s=2 * 0.11)  # two first tokens, at the prediction
    assert model.pool_peak_running == 4
    base = model.base_ttft_ms(slow, model.work(slow, 0.0), 4000)  # 410 ms
    model.routed(slow, 4000, base, 0.0)
    model.admit(slow, 0.0, base, 0.0)  # idle: admitted on arrival
    scrape(slow, 2.0, running=1, waiting=1)
    scrape(slow, 3.0, running=1, waiting=1)  # still late: 2.0's bound is taken
    w = model.work(slow, 3.0)
    assert w.calibration_source == "first-token-wait"
    assert w.slowdown == pytest.approx(2000 / MARGIN / base)
    assert model.work(fast, 3.0).calibration_source == "prior" and model.work(fast, 3.0).slowdown == 1.0
    assert model.work(unseen, 3.0).calibration_source == "pool"
    assert model.work(unseen, 3.0).slowdown == pytest.approx(w.slowdown)


def test_a_late_first_token_of_a_prompt_predicted_mostly_fixed_cost_proves_no_slow_prefill() -> None:
    """A warm prompt predicted at 13 ms, 10 of them the fixed overhead, still without its first
    token 100 ms on: the engine's per-request cost may be higher than the prior's, not its
    prefill slower, so no bound; a cold prompt as late is a bound as before."""
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    ep = ds.snapshot()[0]
    model = LatencyModel(LatencyConfig(prefill_ms_per_token=0.06, overhead_ms=10.0, decode_ms_per_seq=0.0),
                         bytes_per_token=4, clock=lambda: 0.0)

    def scrape(at: float, count: float) -> None:
        ds.set_metrics(ep.key, ModelServerMetrics(waiting=0, running=1, ttft_sum_s=0.0, ttft_count=count,
                                                  updated_at=at, ok=True))
        model.work(ep, at)

    scrape(0.0, 0)
    warm = model.base_ttft_ms(ep, model.work(ep, 0.0), 50)  # 13 ms: 10 of overhead
    model.routed(ep, 50, warm, 0.0)
    token = model.admit(ep, 0.0, warm, 0.0, 50)
    scrape(0.1, 0)  # 100 ms, 7.7x its prediction, and no first token
    scrape(0.2, 0)  # and 200 ms, at a second scrape: it would be taken, were it a bound
    assert model.work(ep, 0.2).calibration_source == "prior"
    assert model.work(ep, 0.2).slowdown == 1.0
    model.leave(ep, token)
    scrape(0.25, 1)
    cold = model.base_ttft_ms(ep, model.work(ep, 0.25), 1000)  # 70 ms: mostly prefill
    model.routed(ep, 1000, cold, 0.25)
    model.admit(ep, 0.25, cold, 0.0, 1000)
    scrape(0.75, 1)  # 500 ms without it: at least 500 / 70, if the next scrape agrees
    scrape(1.1, 1)
    w = model.work(ep, 1.1)
    assert w.calibration_source == "first-token-wait"
    assert w.slowdown == pytest.approx(500 / MARGIN / cold)


def test_an_unreadable_request_among_the_oldest_draws_no_bound() -> None:
    f = FirstTokenWait(twice=False)
    f.observe(0, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 0.0, 1000.0, readable=False)
    f.add(2, 0.0, 100.0, 0.0, 1000.0)
    assert f.observe(1, 0.5, 1.0)[0] is None  # which of the two lacks its first token is unknown
    f.remove(1)
    assert f.observe(1, 0.5, 1.0)[0] == pytest.approx(500 / MARGIN / 100)


def test_requests_routed_after_one_may_share_the_step_that_finishes_its_prefill() -> None:
    """A (1,000 uncached tokens, 0.1 ms each, behind 300 ms of work: predicted 400 ms), then B
    (7,000) routed before A's step began: with 8,192 prefill tokens a step, that step may carry up
    to 7,192 more tokens, B's 7,000: A late by B's prefill is no proof of a slower engine. Without
    B's tokens the same lateness read 2.5x."""
    f = FirstTokenWait(twice=False)
    f.observe(0, 0.0, 1.0)
    f.add(1, 0.0, 400.0, 0.0, 1000.0)
    f.add(2, 0.05, 1100.0, 0.0, 7000.0)
    assert f.observe(0, 1.0, 1.0)[0] == pytest.approx(1000 / 400)  # B unpriced
    assert f.observe(0, 1.0, 1.0, step_tokens=8192, ms_per_token=0.1)[0] is None  # 1000 / (400 + 700)
    assert f.observe(0, 2.0, 1.0, step_tokens=8192, ms_per_token=0.1)[0] == pytest.approx(2000 / 1100)
    # Nothing ahead of A: its step began at its routing, and B, routed after, waits for the next.
    g = FirstTokenWait(twice=False)
    g.observe(0, 0.0, 1.0)
    g.add(1, 0.0, 100.0, 0.0, 1000.0)
    g.add(2, 0.05, 800.0, 0.0, 7000.0)
    assert g.observe(0, 0.7, 1.0, step_tokens=8192, ms_per_token=0.1)[0] == pytest.approx(700 / 100)
    # One step's budget at most: 7,000 tokens after a 7,000-token prompt add 1,192 of them.
    h = FirstTokenWait(twice=False)
    h.observe(0, 0.0, 1.0)
    h.add(1, 0.0, 1000.0, 0.0, 7000.0)
    h.add(2, 0.1, 1700.0, 0.0, 7000.0)
    assert h.observe(0, 2.0, 1.0, step_tokens=8192, ms_per_token=0.1)[0] == pytest.approx(2000 / (1000 + 119.2))


def test_a_move_of_bytes_per_token_rescales_the_requests_awaiting_a_first_token() -> None:
    """Predicted at 4 bytes per token, measured at 6.4 (f = 0.625): a request predicted at 100 ms
    holds 62.5 ms of prefill, so 500 ms without a first token reads 8x, not 5x."""
    f = FirstTokenWait(twice=False)
    f.observe(0, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 0.0, 1000.0)
    f.add(2, 0.0, 100.0, 0.0, 1000.0)
    f.rescale(0.625)
    late, unfinished = f.observe(0, 0.5, 1.0)
    assert late == pytest.approx(500 / MARGIN / 62.5)
    assert unfinished == pytest.approx(625.0)  # the smaller of the two, in the measured units
    # A bound awaiting its second scrape is in the old units too: 400 ms late read 4x, taken as 6.4x.
    g = FirstTokenWait()
    g.observe(0, 0.0, 1.0)
    g.add(1, 0.0, 100.0, 0.0, 1000.0)
    assert g.observe(0, 0.4, 1.0)[0] is None
    g.rescale(0.625)
    assert g.observe(0, 0.65, 1.0)[0] == pytest.approx(400 / MARGIN / 62.5)


def test_a_capacity_queue_draws_no_bound_and_marks_later_requests_queued() -> None:
    """An engine queueing for KV blocks (vllm:num_requests_waiting_by_reason{reason="capacity"})
    delays first tokens by the wait for blocks: no bound from such a scrape, even for requests
    admitted on arrival; and a request routed after it may wait for blocks with fewer sequences
    running than the pool was seen to run, so a later queue draws none from it either, nor does the
    scrape after that queue, once the limit is known and was full."""
    f = FirstTokenWait(twice=False)
    f.observe(0, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 0.0, 1000.0, queued=False)
    assert f.observe(0, 0.5, 1.0, queue=True, capacity=True)[0] is None
    assert f.observe(0, 0.5, 1.0, queue=True)[0] == pytest.approx(500 / MARGIN / 100)

    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    ep = ds.snapshot()[0]
    model = LatencyModel(LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0),
                         bytes_per_token=4, clock=lambda: 0.0)

    def scrape(at: float, waiting: float, capacity: float) -> None:
        ds.set_metrics(ep.key, ModelServerMetrics(waiting=waiting, running=4, waiting_capacity=capacity,
                                                  ttft_sum_s=0.0, ttft_count=0, updated_at=at, ok=True))
        model.work(ep, at)

    scrape(0.0, 0, 0)  # 4 running, no queue: the pool was seen to run 4
    scrape(0.1, 2, 2)  # then 2 wait for KV blocks
    base = model.base_ttft_ms(ep, model.work(ep, 0.1), 4000)
    model.routed(ep, 4000, base, 0.1)
    model.admit(ep, 0.1, base, 0.0)  # 1 request there by the picker's count, fewer than 4: yet queued
    scrape(3.0, 2, 0)  # 3 s on, no first token, a queue (for prefill now)
    assert model.work(ep, 3.0).calibration_source == "prior"
    # No queue at all: admitted by now, but the queue at 3.0 had every slot taken (4 running, the
    # limit the capacity queue showed), so it may have waited for one until then.
    scrape(3.5, 0, 0)
    scrape(4.0, 0, 0)  # a second scrape: 3.5's bound would be taken, were it drawn
    assert model.work(ep, 4.0).calibration_source == "prior"


def test_a_request_that_may_have_waited_for_a_slot_proves_nothing_after_the_queue_drains() -> None:
    """A decode-bound endpoint: 8 slots, each held ~3 s. A request routed while all 8 were taken
    (queued) waits for a slot; a scrape shows the queue with 8 running, the next one none (it was
    admitted meanwhile). Its lateness is the slot it waited for, not slow prefill: no bound. (A
    queue with slots free or unknown still leaves the bound to a later scrape without one:
    test_a_queued_scrape_bounds_only_requests_admitted_on_arrival.)"""
    f = FirstTokenWait(twice=False)
    f.observe(0, 0.0, 1.0)
    f.add(1, 0.0, 100.0, 0.0, 1000.0, queued=True)
    assert f.observe(0, 1.0, 1.0, queue=True, slot_queue=True)[0] is None
    assert f.observe(0, 2.0, 1.0)[0] is None  # admitted by now; 2 s late, but after a slot queue
    f.add(2, 2.5, 100.0, 0.0, 1000.0, queued=True)  # routed after that queue, none since
    assert f.observe(0, 3.0, 1.0)[0] is None  # request 1 is still among the oldest: no proof
    f.remove(1)
    assert f.observe(0, 3.5, 1.0)[0] == pytest.approx(1000 / MARGIN / 100)

    # Through the model: a limit of 8 learned at a full KV cache, then a queue with all 8 taken.
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    ep = ds.snapshot()[0]
    model = LatencyModel(LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.0),
                         bytes_per_token=4, clock=lambda: 0.0)

    def scrape(at: float, running: float, waiting: float, kv: float = 0.5) -> None:
        ds.set_metrics(ep.key, ModelServerMetrics(waiting=waiting, running=running, kv_usage=kv,
                                                  ttft_sum_s=0.0, ttft_count=0, updated_at=at, ok=True))
        model.work(ep, at)

    scrape(0.0, 8, 0)
    scrape(0.05, 8, 1, kv=0.99)  # saturated: the admission limit is 8
    assert model.work(ep, 0.05).slots.limit == 8
    base = model.base_ttft_ms(ep, model.work(ep, 0.05), 4000)
    model.routed(ep, 4000, base, 0.1)
    model.admit(ep, 0.1, base, 0.0)  # 8 running there: queued
    scrape(1.0, 8, 1)  # still waiting, every slot taken
    scrape(2.5, 8, 0)  # admitted meanwhile; no first token 2.4 s on
    scrape(3.0, 8, 0)  # a second scrape: 2.5's bound would be taken, were it drawn
    assert model.work(ep, 3.0).calibration_source == "prior"


def test_a_lateness_is_believed_once_two_scrapes_in_a_row_show_it() -> None:
    """One first token held by a pause of the host reads as slowness at the scrape that finds it
    late; if its first token has come by the next scrape, nothing is raised. A slower engine's
    request is still late there: the slowdown is raised to the smaller of the two bounds."""
    paused = FirstTokenWait()
    paused.observe(0, 0.0, 1.0)
    paused.add(1, 0.0, 50.0, 0.0, 1000.0)
    assert observe1(paused, 0, 0.4, 1.0) is None  # 8x, if the next scrape agrees
    assert observe1(paused, 1, 0.45, 1.0) is None  # its first token came: it does not
    paused.add(2, 0.45, 50.0, 0.0, 1000.0)
    assert observe1(paused, 1, 0.6, 1.0) is None  # 3x: a new lateness, not the old one's 8x
    assert observe1(paused, 1, 0.65, 1.0) == pytest.approx(150 / MARGIN / 50)
    slow = FirstTokenWait()
    slow.observe(0, 0.0, 1.0)
    slow.add(1, 0.0, 50.0, 0.0, 1000.0)
    assert observe1(slow, 0, 0.4, 1.0) is None
    assert observe1(slow, 0, 0.45, 1.0) == pytest.approx(400 / MARGIN / 50)
    assert observe1(slow, 0, 0.5, 8.0) == pytest.approx(450 / MARGIN / 50)
    # A scrape that finds nothing later than the slowdown ends the pair: a bound before it is not
    # the first of a pair with one after it.
    ended = FirstTokenWait()
    ended.observe(0, 0.0, 1.0)
    ended.add(1, 0.0, 50.0, 0.0, 1000.0)
    assert observe1(ended, 0, 0.4, 1.0) is None
    assert observe1(ended, 0, 0.5, 20.0) is None  # 10x, under what is known
    assert observe1(ended, 0, 0.55, 1.0) is None  # 11x, the first of a new pair
    assert observe1(ended, 0, 0.6, 1.0) == pytest.approx(550 / MARGIN / 50)
