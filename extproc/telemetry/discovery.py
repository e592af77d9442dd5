"""Prometheus view of Kubernetes discovery (read at scrape time).

| metric | type | labels |
|---|---|---|
| prefix_epp_discovery_refused_annotations_total | counter | annotation (the one refused) |

`annotation` is always `prefix-epp.io/kv-events-endpoint`: the value named another host than the pod
(extproc/discovery/pool.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from extproc.discovery.kubernetes import KubernetesDiscovery
from extproc.discovery.pool import KV_EVENTS_ANNOTATION


class DiscoveryCollector(Collector):
    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self._d = discovery

    def collect(self) -> Iterator[CounterMetricFamily]:
        refused = CounterMetricFamily("prefix_epp_discovery_refused_annotations",
                                      "Pod annotations refused (a KV-events address naming another host than the pod)",
                                      labels=["annotation"])
        refused.add_metric([KV_EVENTS_ANNOTATION], self._d.refused_annotations)
        yield refused
