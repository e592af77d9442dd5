"""Bytes per token (extproc/scheduling/calibration.py), learned from the engines' prompt-token and
first-token counters, and what moves with it, against hand-computed sequences."""

from __future__ import annotations

import pytest

from extproc.config.settings import LatencyConfig
from extproc.core.datastore import Datastore, Endpoint, EndpointSpec, ModelServerMetrics
from extproc.scheduling.endpoint_work import ALPHA
from extproc.scheduling.latency import LatencyModel
from testkit.scheduling import Clock, one_endpoint

# Round numbers, as tests/scheduling/test_latency.py: 0.1 ms per token, overhead 10 ms.
CONFIG = LatencyConfig(prefill_ms_per_token=0.1, overhead_ms=10.0, decode_ms_per_seq=0.5, step_tokens=1000)


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
