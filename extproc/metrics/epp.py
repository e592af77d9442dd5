"""The picker's own Prometheus metrics, served on --metrics-port at /metrics.

Names follow the Go EPP where a metric has an equivalent there; our own use the `prefix_epp_` prefix.

| metric | type | labels |
|---|---|---|
| inference_objective_request_total | counter | model_name, target_model_name |
| inference_objective_request_error_total | counter | model_name, target_model_name, error_code |
| prefix_epp_requests_total | counter | outcome (routed, error), status (HTTP status) |
| inference_extension_scheduler_e2e_duration_seconds | histogram | - (decision latency: body complete -> decision) |
| inference_extension_prefix_indexer_hit_ratio | histogram | - (matched / total blocks of the chosen endpoint) |
| inference_extension_prefix_indexer_size | gauge | - ((endpoint, block) entries) |
| prefix_epp_prefix_index_bytes | gauge | - (estimated memory of the index) |
| prefix_epp_inflight_requests | gauge | endpoint |
| inference_pool_ready_pods | gauge | name |

Gauges that describe state are computed at scrape time by a collector, so the request path only
increments counters and observes two histograms. Label children are cached per key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.datastore import Datastore
from extproc.prefix.index import PrefixIndex

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _StateCollector(Collector):
    def __init__(self, datastore: Datastore, index: PrefixIndex | None, pool_name: str) -> None:
        self._ds = datastore
        self._index = index
        self._pool = pool_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "prefix_epp_inflight_requests", "Requests routed to an endpoint and not yet completed",
            labels=["endpoint"],
        )
        for ep in self._ds.snapshot():
            inflight.add_metric([ep.key], ep.inflight)
        yield inflight
        ready = GaugeMetricFamily("inference_pool_ready_pods", "Endpoints the picker may route to",
                                  labels=["name"])
        ready.add_metric([self._pool], len(self._ds))
        yield ready
        if self._index is not None:
            yield GaugeMetricFamily("inference_extension_prefix_indexer_size",
                                    "Entries (endpoint, block) in the prefix index", value=self._index.entries)
            yield GaugeMetricFamily("prefix_epp_prefix_index_bytes",
                                    "Estimated memory held by the prefix index", value=self._index.approx_bytes())


class EppMetrics:
    def __init__(self, datastore: Datastore, index: PrefixIndex | None, pool_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._objective_requests = Counter(
            "inference_objective_request", "Requests by model", ["model_name", "target_model_name"], registry=r)
        self._objective_errors = Counter(
            "inference_objective_request_error", "Request errors by model",
            ["model_name", "target_model_name", "error_code"], registry=r)
        self._requests = Counter("prefix_epp_requests", "Requests by outcome and HTTP status",
                                 ["outcome", "status"], registry=r)
        self._decision = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds", "Decision latency of the picker",
            buckets=DECISION_BUCKETS, registry=r)
        self._hit_ratio = Histogram(
            "inference_extension_prefix_indexer_hit_ratio", "Matched share of prompt blocks on the chosen endpoint",
            buckets=RATIO_BUCKETS, registry=r)
        r.register(_StateCollector(datastore, index, pool_name))
        self._children: dict[tuple[object, ...], Any] = {}
        self.observe_decision: Callable[[float], None] = self._decision.observe
        self.observe_hit_ratio: Callable[[float], None] = self._hit_ratio.observe

    def _child(self, metric: Any, key: tuple[str, ...]) -> Any:
        full = (id(metric), *key)
        child = self._children.get(full)
        if child is None:
            child = metric.labels(*key)
            self._children[full] = child
        return child

    def routed(self, model: str, target_model: str) -> None:
        self._child(self._objective_requests, (model, target_model)).inc()
        self._child(self._requests, ("routed", "200")).inc()

    def error(self, model: str, target_model: str, code: str, status: int) -> None:
        self._child(self._objective_requests, (model, target_model)).inc()
        self._child(self._objective_errors, (model, target_model, code)).inc()
        self._child(self._requests, ("error", str(status))).inc()
