"""Flow control's metrics (extproc/flowcontrol/), named as llm-d's router names them, under the
picker's prefix.

| metric | type | labels |
|---|---|---|
| prefix_epp_flow_control_queue_size | gauge | fairness_id, priority (requests held now) |
| prefix_epp_flow_control_queue_bytes | gauge | fairness_id, priority (their body bytes) |
| prefix_epp_flow_control_request_queue_duration_seconds | histogram | fairness_id, priority, outcome |
| prefix_epp_flow_control_requests_total | counter | outcome, priority |
| prefix_epp_flow_control_pool_saturation | gauge | - (the detector's reading; dispatch stops at 1) |

`outcome` is one of extproc/flowcontrol/outcomes.py's OUTCOMES (Dispatched, RejectedCapacity,
EvictedTTL, ...). `priority` is an InferenceObjective's priority (a handful, set by whoever
manages the objectives). `fairness_id` comes from a request header, so its values are bounded
(`FairnessLabels`): the first `max_fairness_labels` (1,000) ids keep their own value, every later
one is counted under `overflow`. A queue gauge, once exported for a (fairness_id, priority), stays
exported (at 0 when its queue is empty), so a graph falls to zero instead of ending.
Gauges are computed at scrape time from the controller's queues; the request path only counts
outcomes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.flowcontrol.controller import FlowController

OVERFLOW = "overflow"
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PREFIX = "prefix_epp_flow_control_"


class FairnessLabels:
    """Label values for fairness ids: their own for the first `limit` seen, then OVERFLOW."""

    __slots__ = ("_known", "_limit")

    def __init__(self, limit: int) -> None:
        self._known: set[str] = set()
        self._limit = limit

    def label(self, fairness_id: str) -> str:
        if fairness_id in self._known:
            return fairness_id
        if len(self._known) < self._limit:
            self._known.add(fairness_id)
            return fairness_id
        return OVERFLOW


class _QueueCollector(Collector):
    def __init__(self, controller: FlowController, labels: FairnessLabels) -> None:
        self._controller = controller
        self._labels = labels
        self._seen: set[tuple[str, str]] = set()  # (fairness_id label, priority) exported so far

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily(PREFIX + "queue_size", "Requests held by flow control",
                                 labels=["fairness_id", "priority"])
        held = GaugeMetricFamily(PREFIX + "queue_bytes", "Body bytes of the requests held by flow control",
                                 labels=["fairness_id", "priority"])
        totals: dict[tuple[str, str], list[int]] = {key: [0, 0] for key in self._seen}
        for fairness_id, priority, count, nbytes in self._controller.flows():
            key = (self._labels.label(fairness_id), str(priority))
            t = totals.setdefault(key, [0, 0])
            t[0] += count
            t[1] += nbytes
        self._seen.update(totals)
        for key, (count, nbytes) in sorted(totals.items()):
            size.add_metric(list(key), count)
            held.add_metric(list(key), nbytes)
        yield size
        yield held
        yield GaugeMetricFamily(PREFIX + "pool_saturation", "Pool saturation seen by flow control's detector "
                                "(dispatch stops at 1)", value=self._controller.saturation())


class FlowControlMetrics:
    """The controller's observer: counts each request's outcome and time under flow control."""

    def __init__(self, registry: CollectorRegistry, controller: FlowController) -> None:
        self._labels = FairnessLabels(controller.config.max_fairness_labels)
        self._duration = Histogram(PREFIX + "request_queue_duration_seconds",
                                   "Time a request spent under flow control, by how it ended",
                                   ["fairness_id", "priority", "outcome"], buckets=QUEUE_BUCKETS, registry=registry)
        self._requests = Counter(PREFIX + "requests", "Requests through flow control, by outcome",
                                 ["outcome", "priority"], registry=registry)
        registry.register(_QueueCollector(controller, self._labels))

    def finished(self, fairness_id: str, priority: int, outcome: str, waited_s: float) -> None:
        p = str(priority)
        self._duration.labels(self._labels.label(fairness_id), p, outcome).observe(waited_s)
        self._requests.labels(outcome, p).inc()
