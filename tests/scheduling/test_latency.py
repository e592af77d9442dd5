"""The token-aware load estimate (extproc/scheduling/latency.py) against hand-computed sequences."""

from __future__ import annotations

import pytest

from extproc.config.settings import LatencyConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.scheduling.endpoint_work import ALPHA, CHURN_HALF_LIFE_S
from extproc.scheduling.interfaces import Routing
from extproc.scheduling.latency import LatencyModel

# Round numbers: 0.1 ms per token (10 tokens per ms), overhead 10 ms, 0.5 ms per running sequence
# per step, 1,000 tokens per step.
CONFIG = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.5, step_tokens=1000)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def one_endpoint() -> tuple[Datastore, Endpoint]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    return ds, ds.snapshot()[0]


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


def test_slowdown_is_learned_from_the_engine_ttft_histogram() -> None:
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    scrape(ds, ep, clock.now, ttft=(1.0, 10))  # first sight: the window starts here
    model.work(ep, clock.now)
    for _ in range(4):
        model.routed(ep, 0, 100.0, clock.now)  # predicted 100 ms each (base)
    clock.now += 0.05
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


def test_bytes_per_token_is_measured_from_the_first_window_then_averaged() -> None:
    """The prior (4) stands until a scrape window pairs the prompt bytes routed with the engine's
    prompt tokens per first token; that window replaces it, the next ones average in (1/n)."""
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)

    def window(requests: int, bytes_each: int, tokens_each: int, counters: list[float],
               counted: int | None = None) -> float:
        for _ in range(requests):
            model.routed(ep, 0, None, clock.now, prompt_bytes=bytes_each)
        counted = requests if counted is None else counted
        counters[0] += counted
        counters[1] += counted * tokens_each
        clock.now += 1.0
        ds.set_metrics(ep.key, ModelServerMetrics(ttft_count=counters[0], prompt_tokens=counters[1],
                                                  updated_at=clock.now, ok=True))
        model.work(ep, clock.now)
        return model.bytes_per_token

    counters = [0.0, 0.0]
    assert window(0, 0, 0, counters) == 4  # the first scrape only opens the window
    assert window(3, 6400, 1000, counters, counted=2) == 4  # too few requests to measure
    assert window(5, 6400, 1000, counters, counted=6) == pytest.approx(6.4)  # 8 requests: measured
    assert window(8, 8000, 1000, counters) == pytest.approx(7.2)  # (6.4 + 8.0) / 2
    assert window(8, 7200, 1000, counters) == pytest.approx(7.2)  # the mean of three
    assert window(8, 4800, 1000, counters) == pytest.approx(6.6)  # (7.2 x 3 + 4.8) / 4
    assert window(8, 6600, 1000, counters) == pytest.approx(6.6)  # the fifth: weight 1/5 = ALPHA
    assert window(8, 7600, 1000, counters) == pytest.approx(6.8)  # from now on, ALPHA
    assert window(8, 64_000, 1000, counters) == 16.0  # clamped
    assert model.prompt_tokens(0, 32_000) == 2000  # prompts the picker did not tokenize


def test_on_the_prior_one_counted_prompt_measures_bytes_per_token() -> None:
    """While bytes per token is the prior, a window whose first tokens are exactly the requests
    routed in it measures it from one prompt; a mismatched or short window does not, and once
    measured the window's minimum holds again."""
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    counters = [0.0, 0.0]

    def scrape_counters(requests: int, tokens: int) -> float:
        counters[0] += requests
        counters[1] += tokens
        clock.now += 1.0
        ds.set_metrics(ep.key, ModelServerMetrics(ttft_count=counters[0], prompt_tokens=counters[1],
                                                  updated_at=clock.now, ok=True))
        model.work(ep, clock.now)
        return model.bytes_per_token

    assert scrape_counters(0, 0) == 4  # first sight: the window opens
    model.routed(ep, 0, None, clock.now, prompt_bytes=40)
    assert scrape_counters(1, 10) == 4  # a probe: too few tokens to read the template's share
    model.routed(ep, 0, None, clock.now, prompt_bytes=6400)
    model.routed(ep, 0, None, clock.now, prompt_bytes=6400)
    assert scrape_counters(0, 0) == 4  # the window (40 + 12,800 bytes) counted one of three
    assert scrape_counters(1, 1000) == 4  # two of three: not exact, too few for a window
    assert scrape_counters(1, 1000) == pytest.approx(12840 / 2010)  # all three counted: exact
    measured = model.bytes_per_token
    model.routed(ep, 0, None, clock.now, prompt_bytes=8000)
    assert scrape_counters(1, 1000) == measured  # measured: a window needs MIN_FIRST_TOKENS again


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
        end(0.26 * 40)  # 40x: the second window weighs 1/2
    assert w.slowdown == pytest.approx(10 + 0.5 * (40 - 10))  # 25
    for _ in range(8):
        end(0.26 * 200)  # 200x: clamped at max_slowdown (50)
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


def _window(model: LatencyModel, ds: Datastore, ep: Endpoint, clock: Clock, routed: int, ttft_ms: float,
            *, prompt_bytes: int = 0, tokens_each: int = -1, estimated: bool = True) -> None:
    """`routed` requests predicted at a 100 ms base each, then a scrape that shows 8 more first
    tokens at `ttft_ms` each (and, with `tokens_each` >= 0, their prompt tokens)."""
    for _ in range(routed):
        model.routed(ep, 1000, 100.0, clock.now, prompt_bytes=prompt_bytes, estimated=estimated)
    m = ep.metrics
    count, total = (m.ttft_count, m.ttft_sum_s) if m is not None and m.ttft_count >= 0 else (0.0, 0.0)
    tokens = m.prompt_tokens if m is not None and m.prompt_tokens >= 0 else 0.0
    clock.now += 0.05
    ds.set_metrics(ep.key, ModelServerMetrics(
        ttft_count=count + 8, ttft_sum_s=total + 8 * ttft_ms / 1000,
        prompt_tokens=tokens + 8 * tokens_each if tokens_each >= 0 else -1.0, updated_at=clock.now, ok=True))
    model.work(ep, clock.now)


def test_the_window_that_measures_bytes_per_token_reads_its_predictions_in_the_measured_units() -> None:
    """Predictions from bytes at the prior's 4 bytes per token; the scrape that measures 6.4 bytes
    per token closes a slowdown window too: bytes per token is learned first, so the window's
    predictions are read rescaled to it: 60 ms observed against 100 x 4 / 6.4 = 62.5 predicted,
    not against the 100 made with the prior's error (0.6)."""
    clock = Clock()
    ds, ep = one_endpoint()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    _window(model, ds, ep, clock, 0, 0.0, tokens_each=0)  # first sight: the windows open
    _window(model, ds, ep, clock, 8, 60.0, prompt_bytes=6400, tokens_each=1000)
    w = model.work(ep, clock.now)
    assert model.bytes_per_token == pytest.approx(6.4)
    assert w.slowdown == pytest.approx(60 / 62.5) and w.calibration_source == "ttft-histogram"
    # 8 estimates of 1,000 tokens (exponentially weighted from 0), then in the measured units:
    assert w.mean_uncached == pytest.approx(1000 * (1 - (1 - ALPHA) ** 8) * 4 / 6.4)


def test_a_slowdown_learned_on_estimates_is_rescaled_when_bytes_per_token_moves() -> None:
    """An engine without a prompt-token counter was calibrated on estimated prompts (0.5) and a
    tokenized one on counted prompts (0.5); another engine measures 8 bytes per token against
    the prior's 4: the estimated prompts held half the tokens they were taken for, so the first
    engine's slowdown doubles and its mean uncached request halves; the tokenized one's stand
    (but for the share of its requests that were estimated: w.estimated)."""
    clock = Clock()
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000 + i) for i in range(3)])
    est, exact, meter = ds.snapshot()
    model = LatencyModel(CONFIG, bytes_per_token=4, clock=clock)
    for ep in (est, exact):
        _window(model, ds, ep, clock, 0, 0.0)
    for _ in range(16):
        model.routed(exact, 1000, None, clock.now, estimated=False)  # tokenized: not in bytes' units
    _window(model, ds, est, clock, 4, 50.0)
    _window(model, ds, exact, clock, 4, 50.0, estimated=False)
    w_est, w_exact = model.work(est, clock.now), model.work(exact, clock.now)
    assert w_est.slowdown == pytest.approx(0.5) and w_exact.slowdown == pytest.approx(0.5)
    assert w_est.estimated == 1.0 and w_exact.estimated < 0.02
    mean_est, mean_exact = w_est.mean_uncached, w_exact.mean_uncached
    _window(model, ds, meter, clock, 0, 0.0, tokens_each=0)
    _window(model, ds, meter, clock, 8, 100.0, prompt_bytes=8000, tokens_each=1000)
    assert model.bytes_per_token == pytest.approx(8.0)
    assert w_est.slowdown == pytest.approx(1.0)
    assert w_est.mean_uncached == pytest.approx(mean_est / 2)
    f = 1 - w_exact.estimated / 2
    assert w_exact.slowdown == pytest.approx(0.5 / f, rel=1e-3) and w_exact.slowdown < 0.51
    assert w_exact.mean_uncached == pytest.approx(mean_exact * f)
