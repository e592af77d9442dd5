"""The predicted-TTFT model's gauges on the picker's /metrics registry."""

from __future__ import annotations

import orjson
from prometheus_client import generate_latest

from extproc.config.settings import EppConfig
from extproc.control.director import RequestContext
from extproc.core.datastore import EndpointSpec
from extproc.runtime.app import App
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
