"""The token-aware load estimate (extproc/scheduling/latency.py) against hand-computed sequences."""

from __future__ import annotations

import pytest

from extproc.config.settings import LatencyConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.scheduling.endpoint_work import CHURN_HALF_LIFE_S
from extproc.scheduling.interfaces import Routing
from extproc.scheduling.latency import LatencyModel
from testkit.scheduling import Clock, one_endpoint

# Round numbers: 0.1 ms per token (10 tokens per ms), overhead 10 ms, 0.5 ms per running sequence
# per step, 1,000 tokens per step.
CONFIG = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.5, step_tokens=1000)


def scrape(ds: Datastore, ep: Endpoint, at: float, *, waiting: float = 0, running: float = 0,
           ttft: tuple[float, float] = (0.0, -1.0)) -> None:
    ds.set_metrics(ep.key, ModelServerMetrics(waiting=waiting, running=running, ttft_sum_s=ttft[0],
                                              ttft_count=ttft[1], updated_at=at, ok=True))


def test_backlog_grows_with_routed_work_and_drains_at_the_prefill_rate() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    model.routed(ep, 3000, 310.0, clock.now)
    model.routed(ep, 1000, 410.0, clock.now)
    assert model.work(ep, clock.now).backlog == 4000
    clock.now += 0.1  # 100 ms at 10 tokens/ms
    assert model.work(ep, clock.now).backlog == pytest.approx(3000)
    clock.now += 1.0  # 1,000 ms: more than what is left
    assert model.work(ep, clock.now).backlog == 0.0
    model.routed(ep, 500, 60.0, clock.now)
    w = model.work(ep, clock.now)
    # ttft = overhead + (backlog + uncached) x ms/token + ceil(work / step) x decode x running (load 0 here)
    assert model.base_ttft_ms(ep, w, 2000) == pytest.approx(10 + 2500 * 0.1)
    ds.acquire(ep.key)
    ds.acquire(ep.key)  # two sequences in flight, three steps of 1,000 tokens
    assert model.base_ttft_ms(ep, w, 2000) == pytest.approx(10 + 250 + 3 * 0.5 * 2)


def test_churn_counts_routed_uncached_tokens_and_halves_every_half_life() -> None:
    clock = Clock()
    _, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    model.routed(ep, 3000, None, clock.now)
    model.routed(ep, 1000, None, clock.now)
    assert model.work(ep, clock.now).churn == 4000
    clock.now += CHURN_HALF_LIFE_S
    assert model.work(ep, clock.now).churn == pytest.approx(2000)
    model.routed(ep, 500, None, clock.now)
    clock.now += CHURN_HALF_LIFE_S / 2
    assert model.work(ep, clock.now).churn == pytest.approx(2500 / 2 ** 0.5)


def test_scrapes_bound_the_backlog_both_ways() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    model.routed(ep, 5000, 0.0, clock.now)
    scrape(ds, ep, clock.now, waiting=0, running=0)  # idle engine: only what was routed since counts
    assert model.work(ep, clock.now).backlog == 5000  # routed since the previous scrape: kept
    model.routed(ep, 200, 0.0, clock.now)
    clock.now += 0.001
    scrape(ds, ep, clock.now, waiting=0, running=0)
    # The 5,000 tokens were routed before the previous scrape landed: they may be in flight still.
    assert model.work(ep, clock.now).backlog == pytest.approx(5190)
    clock.now += 0.001
    scrape(ds, ep, clock.now, waiting=0, running=0)
    assert model.work(ep, clock.now).backlog == pytest.approx(200)  # 5,190 believed, idle says <= 200
    # Waiting requests the model thought done: at least waiting x mean uncached of the routed ones.
    clock.now += 10.0
    assert model.work(ep, clock.now).backlog == 0.0
    mean = model.work(ep, clock.now).mean_uncached  # 0.2 x 5000 -> 1000, then + 0.2 x (200 - 1000) = 840
    assert mean == pytest.approx(840)
    scrape(ds, ep, clock.now, waiting=3, running=1)
    assert model.work(ep, clock.now).backlog == pytest.approx(3 * 840)


def window_of_four() -> tuple[Clock, Datastore, Endpoint, LatencyModel]:
    """An endpoint seen once (its TTFT window opened at 10 first tokens) and 4 requests routed
    there, each predicted at 100 ms (base), 50 ms ago."""
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    scrape(ds, ep, clock.now, ttft=(1.0, 10))  # first sight: the window starts here
    model.work(ep, clock.now)
    for _ in range(4):
        model.routed(ep, 0, 100.0, clock.now)
    clock.now += 0.05
    return clock, ds, ep, model


def test_slowdown_is_learned_from_the_engine_ttft_histogram() -> None:
    clock, ds, ep, model = window_of_four()
    scrape(ds, ep, clock.now, ttft=(1.0 + 8 * 0.3, 18))  # 8 first tokens at 300 ms: 3x slower
    assert model.work(ep, clock.now).slowdown == pytest.approx(3.0)  # the first window replaces the prior
    # Too few first tokens: no update, the window stays open.
    for _ in range(4):
        model.routed(ep, 0, 100.0, clock.now)
    clock.now += 0.05
    scrape(ds, ep, clock.now, ttft=(3.4 + 2 * 0.3, 20))
    assert model.work(ep, clock.now).slowdown == pytest.approx(3.0)
    # An engine restart (counter reset) starts a new window instead of a negative ratio.
    clock.now += 0.05
    scrape(ds, ep, clock.now, ttft=(0.1, 1))
    assert model.work(ep, clock.now).slowdown == pytest.approx(3.0)
    # The second window weighs 1/2: 8 first tokens at 100 ms against the 100 ms predicted.
    for _ in range(4):
        model.routed(ep, 0, 100.0, clock.now)
    clock.now += 0.05
    scrape(ds, ep, clock.now, ttft=(0.1 + 8 * 0.1, 9))
    assert model.work(ep, clock.now).slowdown == pytest.approx(3.0 + 0.5 * (1.0 - 3.0))  # 2.0
    # A slower endpoint drains its backlog more slowly: 1 / (0.1 x 2) tokens per ms.
    model.routed(ep, 1400, None, clock.now)
    clock.now += 0.07
    assert model.work(ep, clock.now).backlog == pytest.approx(1400 - 70 / 0.2)


def test_slowdown_is_clamped() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(LatencyConfig(min_slowdown=0.5, max_slowdown=2.0), bytes_per_token=4, clock=clock)
    scrape(ds, ep, clock.now, ttft=(0.0, 0))
    model.work(ep, clock.now)
    for _ in range(20):
        for _ in range(4):
            model.routed(ep, 0, 1.0, clock.now)
        clock.now += 0.05
        m = ep.metrics
        assert m is not None
        scrape(ds, ep, clock.now, ttft=(m.ttft_sum_s + 8 * 10.0, m.ttft_count + 8))  # 10 s each
        model.work(ep, clock.now)
    assert model.work(ep, clock.now).slowdown == 2.0


def test_state_is_bounded_by_the_pool() -> None:
    clock = Clock()
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000 + i) for i in range(10)])
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    eps = ds.snapshot()
    for ep in eps:
        model.work(ep, clock.now)
    model.forget_others(eps[:3])
    assert len(model) == 3


def test_invalid_priors_are_refused() -> None:
    with pytest.raises(ValueError):
        LatencyModel(LatencyConfig(prefill_ms_per_token=0), 4, Clock())
    with pytest.raises(ValueError):
        LatencyModel(LatencyConfig(min_slowdown=2.0), 4, Clock())


def test_an_answered_request_clears_what_was_queued_before_it() -> None:
    clock = Clock()
    _ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    marks = []
    for tokens in (4000, 3000, 2000):
        model.routed(ep, tokens, None, clock.now)
        marks.append(model.mark(ep))
    assert marks == [4000, 7000, 9000]
    model.finished(ep, marks[1], clock.now)  # the second answered: the first two are prefilled
    assert model.work(ep, clock.now).backlog == 2000
    model.finished(ep, marks[0], clock.now)  # an earlier one ending later changes nothing
    assert model.work(ep, clock.now).backlog == 2000
    model.finished(ep, marks[2], clock.now)
    assert model.work(ep, clock.now).backlog == 0


def test_slowdown_is_learned_from_response_ends_without_a_ttft_histogram() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    scrape(ds, ep, clock.now)  # running and waiting only: no TTFT histogram (ttft_count -1)
    w = model.work(ep, clock.now)
    # Each request: base 100 ms, 20 output tokens at decode_step_ms 8 and no one running: 160 ms.
    decode = model.decode_ms(ep, 20)
    assert decode == pytest.approx(20 * 8.0)
    assert model.decode_ms(ep, 0) == -1.0  # output length unknown
    started = clock.now

    def end(elapsed_s: float, wait_ms: float = 0.0, decode_ms: float = decode) -> None:
        clock.now = started + elapsed_s
        model.response_ended(ep, Routing(ep.key, started, 100.0, wait_ms, decode_ms), clock.now)

    for _ in range(7):
        end(2.6)  # observed 2,600 ms against 260 predicted: 10x
    end(0.5, decode_ms=-1.0)  # no output length: not a sample
    assert w.slowdown == 1.0 and w.calibration_source == "prior"
    end(2.7, wait_ms=100.0)  # the 8th: its charged slot wait is not the engine's slowness
    # The first window replaces the prior: 8 x 2,600 / (8 x 260) = 10.
    assert w.slowdown == pytest.approx(10.0)
    assert w.calibration_source == "response-ends"
    for _ in range(8):
        end(0.26 * 40)  # 40x: the mean of two windows
    assert w.slowdown == pytest.approx(10 + 0.5 * (40 - 10))  # 25
    for _ in range(8):
        end(0.26 * 200)  # 200x: one window of three, the median is the 40x one's
    assert w.slowdown == pytest.approx(40.0)
    for _ in range(8):
        end(0.26 * 200)  # a second 200x window: the median (120) is clamped at max_slowdown (50)
    assert w.slowdown == 50.0
    # Where the engine exports its TTFT histogram, that calibrates instead.
    scrape(ds, ep, clock.now, ttft=(0.0, 0.0))
    model.work(ep, clock.now)
    for _ in range(8):
        end(0.026)
    assert w.slowdown == 50.0


def test_one_slow_response_end_does_not_move_the_slowdown() -> None:
    """A window's ratio is the median of its samples: one response that ended 40x late (a client
    reading its stream slowly, a pause of the host) among eight at 2x reads as 2x, where the ratio
    of the sums would read ~6.8x and spare a fast endpoint until its next eight answers, which
    being spared it would not get."""
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    scrape(ds, ep, clock.now)
    w = model.work(ep, clock.now)
    started = clock.now
    for ratio in (2.0, 2.0, 40.0, 2.0, 2.0, 2.0, 2.0, 2.0):
        clock.now = started + 0.26 * ratio
        model.response_ended(ep, Routing(ep.key, started, 100.0, 0.0, 160.0), clock.now)
    assert w.slowdown == pytest.approx(2.0) and w.calibration_source == "response-ends"
    for ratio in (3.0, 40.0, 40.0, 3.0, 5.0, 40.0, 3.0, 40.0):  # half of them late: the median moves
        clock.now = started + 0.26 * ratio
        model.response_ended(ep, Routing(ep.key, started, 100.0, 0.0, 160.0), clock.now)
    assert w.slowdown == pytest.approx(2.0 + 0.5 * ((5.0 + 40.0) / 2 - 2.0))


def test_the_default_slowdown_range_covers_a_cpu_engine_and_a_fast_one() -> None:
    c = LatencyConfig()
    assert (c.min_slowdown, c.max_slowdown) == (0.1, 50.0)


def test_an_endpoint_not_yet_calibrated_takes_the_pools_calibration() -> None:
    """One endpoint measured 10x slower than the prior; another measured 2.5x: the third, with no
    samples of its own, predicts at their geometric mean (5x), not at the prior, and an endpoint
    discovered later starts there too; its own first window then replaces it."""
    clock = Clock()
    ds = Datastore()
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in (1, 2, 3)])
    a, b, c = ds.snapshot()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    for ep in (a, b, c):
        scrape(ds, ep, clock.now)  # no TTFT histogram: calibrated from response ends
    wc = model.work(c, clock.now)
    started = clock.now

    def window(ep: Endpoint, ratio: float) -> None:  # 8 ends at `ratio` x the 260 ms predicted
        for _ in range(8):
            clock.now = started + 0.26 * ratio
            model.response_ended(ep, Routing(ep.key, started, 100.0, 0.0, 160.0), clock.now)

    window(a, 10.0)
    assert wc.slowdown == pytest.approx(10.0) and wc.calibration_source == "pool"
    window(b, 2.5)
    assert wc.slowdown == pytest.approx(5.0) and model.work(a, clock.now).slowdown == pytest.approx(10.0)
    ds.set_endpoints([EndpointSpec(f"10.0.0.{i}", 8000) for i in (1, 2, 3, 4)])
    d = ds.snapshot()[3]
    assert model.work(d, clock.now).slowdown == pytest.approx(5.0)
    window(c, 1.0)
    assert wc.slowdown == pytest.approx(1.0) and wc.calibration_source == "response-ends"


def capacity_scrape(ds: Datastore, ep: Endpoint, at: float, ttft: tuple[float, float], *,
                    waiting_capacity: float, kv_usage: float) -> None:
    """A scrape of an engine with 2 running and 3 waiting, `waiting_capacity` of them for KV blocks
    (-1: the gauge is not exported)."""
    ds.set_metrics(ep.key, ModelServerMetrics(waiting=3, running=2, waiting_capacity=waiting_capacity,
                                              kv_usage=kv_usage, ttft_sum_s=ttft[0], ttft_count=ttft[1],
                                              updated_at=at, ok=True))


@pytest.mark.parametrize(("waiting_capacity", "kv_usage", "observed_s", "expected"), [
    (0, 0.5, 0.3, 3.0),  # a queue for prefill, the engine says: the window's 3x stands
    (3, 0.5, 0.3, 1.0),  # a queue for KV blocks: 300 ms may be waiting for them, not 3x slower prefill
    (3, 0.5, 0.05, 0.5),  # faster than predicted even with the waits: that much it proves
    (-1, 0.97, 0.3, 1.0),  # no such gauge, but a full cache behind the queue
    (-1, 0.5, 0.3, 3.0),  # no gauge and room in the cache: nothing says the queue is for capacity
])
def test_a_window_with_a_capacity_queue_may_lower_the_slowdown_but_not_raise_it(
        waiting_capacity: float, kv_usage: float, observed_s: float, expected: float) -> None:
    clock, ds, ep, model = window_of_four()
    capacity_scrape(ds, ep, clock.now, (1.0, 10), waiting_capacity=waiting_capacity, kv_usage=kv_usage)
    model.work(ep, clock.now)
    clock.now += 0.05
    scrape(ds, ep, clock.now, running=2, ttft=(1.0 + 8 * observed_s, 18))  # the window closes
    w = model.work(ep, clock.now)
    assert w.slowdown == pytest.approx(expected) and w.calibration_source == "ttft-histogram"
    # The next window has no capacity queue in it: it moves the slowdown as any window does.
    for _ in range(4):
        model.routed(ep, 0, 100.0, clock.now)
    clock.now += 0.05
    m = ep.metrics
    assert m is not None
    scrape(ds, ep, clock.now, running=2, ttft=(m.ttft_sum_s + 8 * 0.2, m.ttft_count + 8))  # 2x
    assert model.work(ep, clock.now).slowdown == pytest.approx(expected + 0.5 * (2.0 - expected))
