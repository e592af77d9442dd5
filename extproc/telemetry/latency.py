"""Gauges of the predicted-TTFT model (extproc/scheduling/latency.py), computed at scrape time.

| metric | type | labels |
|---|---|---|
| prefix_epp_endpoint_prefill_backlog_tokens | gauge | endpoint (prompt tokens routed there, not prefilled yet) |
| prefix_epp_endpoint_ttft_slowdown | gauge | endpoint (observed / predicted TTFT, learned from the engine) |
| prefix_epp_bytes_per_token | gauge | - (prompt bytes per engine token, learned from the engines) |

Endpoints are those the model holds state for: the pool's, so the label set is bounded by it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.scheduling.latency import LatencyModel


class LatencyCollector(Collector):
    def __init__(self, model: LatencyModel, clock: Callable[[], float] = time.monotonic) -> None:
        self._model = model
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        backlog = GaugeMetricFamily("prefix_epp_endpoint_prefill_backlog_tokens",
                                    "Prompt tokens routed to an endpoint and not yet prefilled (estimate)",
                                    labels=["endpoint"])
        slowdown = GaugeMetricFamily("prefix_epp_endpoint_ttft_slowdown",
                                     "Observed over predicted time to first token, learned per endpoint",
                                     labels=["endpoint"])
        for key, tokens, factor in self._model.snapshot(self._clock()):
            backlog.add_metric([key], tokens)
            slowdown.add_metric([key], factor)
        yield backlog
        yield slowdown
        yield GaugeMetricFamily("prefix_epp_bytes_per_token", "Prompt bytes per engine token, learned",
                                value=self._model.bytes_per_token)
