"""Gauges of the predicted-TTFT model (extproc/scheduling/latency.py), computed at scrape time.

| metric | type | labels |
|---|---|---|
| prefix_epp_endpoint_prefill_backlog_tokens | gauge | endpoint (prompt tokens routed there, not prefilled yet) |
| prefix_epp_endpoint_ttft_slowdown | gauge | endpoint (observed / predicted TTFT, learned from the engine) |
| prefix_epp_bytes_per_token | gauge | - (prompt bytes per engine token, learned from the engines) |
| prefix_epp_endpoint_slot_limit | gauge | endpoint (running sequences at which it stopped admitting) |
| prefix_epp_endpoint_occupancy_seconds | gauge | endpoint (time a request holds it, routing to response end) |
| prefix_epp_endpoint_queue_regime | gauge | endpoint, regime ("capacity" or "prefill": 1 for the last seen) |

The slot limit and occupancy appear once learned (unknown until then, never 0). The regime is
"capacity" when the endpoint's last scrape showed requests waiting for a sequence slot or KV
blocks (extproc/scheduling/slots.py), else "prefill"; it is what the prediction follows: where
requests wait for capacity the expected slot wait outweighs the prefill backlog.

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
        limit = GaugeMetricFamily("prefix_epp_endpoint_slot_limit",
                                  "Running sequences at which the endpoint stopped admitting (learned)",
                                  labels=["endpoint"])
        occupancy = GaugeMetricFamily("prefix_epp_endpoint_occupancy_seconds",
                                      "How long a request holds the endpoint, routing to response end (smoothed)",
                                      labels=["endpoint"])
        regime = GaugeMetricFamily("prefix_epp_endpoint_queue_regime",
                                   "1 for what the endpoint's requests last waited for: capacity or prefill",
                                   labels=["endpoint", "regime"])
        for key, tokens, factor, slots in self._model.snapshot(self._clock()):
            backlog.add_metric([key], tokens)
            slowdown.add_metric([key], factor)
            if slots.limit > 0:
                limit.add_metric([key], slots.limit)
            if slots.occupancy_ms >= 0:
                occupancy.add_metric([key], slots.occupancy_ms / 1000.0)
            regime.add_metric([key, "capacity"], 1.0 if slots.saturated else 0.0)
            regime.add_metric([key, "prefill"], 0.0 if slots.saturated else 1.0)
        yield backlog
        yield slowdown
        yield limit
        yield occupancy
        yield regime
        yield GaugeMetricFamily("prefix_epp_bytes_per_token", "Prompt bytes per engine token, learned",
                                value=self._model.bytes_per_token)
