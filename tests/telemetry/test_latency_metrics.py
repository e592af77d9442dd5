"""The predicted-TTFT model's gauges on the picker's /metrics registry."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import generate_latest

from extproc.config.settings import EppConfig, LatencyConfig
from extproc.control.director import RequestContext, output_tokens
from extproc.core.datastore import EndpointSpec
from extproc.runtime.app import App
from extproc.scheduling.scorers.predicted_ttft import PredictedTtftScorer
from extproc.scraping.prom_text import samples


def test_backlog_slowdown_and_bytes_per_token_are_exported() -> None:
    app = App(EppConfig(seed=1))
    app.datastore.set_endpoints([EndpointSpec("10.0.0.1", 8000), EndpointSpec("10.0.0.2", 8000)])
    body = orjson.dumps({"model": "m", "prompt": "x" * 40_000})  # 10,000 tokens at 4 bytes per token
    decision = app.director.route(RequestContext(path="/v1/completions"), body)
    text = generate_latest(app.metrics.registry)
    gauge = b"prefix_epp_endpoint_prefill_backlog_tokens"
    backlog = {labels["endpoint"]: v for labels, v in samples(text, gauge)}
    assert backlog[decision.primary.key] > 9000  # just routed: nearly all of it still queued
    assert {labels["endpoint"] for labels, _ in samples(text, b"prefix_epp_endpoint_ttft_slowdown")} == set(backlog)
    assert samples(text, b"prefix_epp_bytes_per_token") == [({}, 4.0)]


def test_the_weighted_profile_exports_no_model_gauges() -> None:
    app = App(EppConfig(scheduler="weighted"))
    assert samples(generate_latest(app.metrics.registry), b"prefix_epp_bytes_per_token") == []


def test_a_response_end_teaches_occupancy_and_the_regime_is_exported() -> None:
    clock = [50.0]
    app = App(EppConfig(seed=1))
    app.datastore.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    ttft = next(ws.scorer for ws in app.director.scheduler.scorers if isinstance(ws.scorer, PredictedTtftScorer))
    ttft._clock = lambda: clock[0]  # the response ends 1.5 s after the pick
    body = orjson.dumps({"model": "m", "prompt": "hello " * 100, "max_tokens": 64})
    decision = app.director.route(RequestContext(path="/v1/completions"), body)
    assert decision.request is not None and decision.request.max_output_tokens == 64
    routing = decision.request.routing
    assert routing is not None and routing.wait_ms == 0.0
    assert routing.decode_ms == pytest.approx(64 * LatencyConfig().decode_step_ms)
    text = generate_latest(app.metrics.registry)
    assert samples(text, b"prefix_epp_endpoint_occupancy_seconds") == []  # unknown until a response ends
    assert samples(text, b"prefix_epp_endpoint_slot_limit") == []
    clock[0] += 1.5
    app.director.complete(decision.primary, decision)
    text = generate_latest(app.metrics.registry)
    key = decision.primary.key
    assert samples(text, b"prefix_epp_endpoint_occupancy_seconds") == [({"endpoint": key}, 1.5)]
    regimes = {labels["regime"]: v for labels, v in samples(text, b"prefix_epp_endpoint_queue_regime")}
    assert regimes == {"capacity": 0.0, "prefill": 1.0}


@pytest.mark.parametrize(("body", "tokens"), [
    ({"max_tokens": 300}, 300), ({"max_completion_tokens": 7}, 7), ({}, 0), ({"max_tokens": "9"}, 0),
    ({"max_tokens": True}, 0), ({"max_tokens": -1}, 0), ({"max_tokens": 1 << 40}, 0)])
def test_the_output_length_is_read_from_the_body_and_bounded(body: dict[str, object], tokens: int) -> None:
    assert output_tokens(body) == tokens
