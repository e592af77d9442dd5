"""Metrics of the endpoints' rotation (extproc/control/health.py), read when /metrics is collected.

| metric | type | labels |
|---|---|---|
| prefix_epp_endpoint_in_rotation | gauge | endpoint (1: a candidate; 0: its scrapes fail or it is ejected) |
| prefix_epp_endpoint_ejections_total | counter | - (ejections after failed responses) |
| prefix_epp_fail_open_decisions_total | counter | - (decisions made among all endpoints, none being in rotation) |
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.control.health import Rotation
from extproc.core.datastore import Datastore


class RotationCollector(Collector):
    def __init__(self, rotation: Rotation, datastore: Datastore) -> None:
        self._rotation = rotation
        self._ds = datastore

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rotation = self._rotation
        in_rotation = GaugeMetricFamily("prefix_epp_endpoint_in_rotation",
                                        "1 when the endpoint is a candidate; 0 while its scrapes fail or it is ejected",
                                        labels=["endpoint"])
        for ep in self._ds.snapshot():
            in_rotation.add_metric([ep.key], 1 if rotation.in_rotation(ep) else 0)
        yield in_rotation
        yield CounterMetricFamily("prefix_epp_endpoint_ejections",
                                  "Ejections of endpoints whose routed requests failed in a row",
                                  value=rotation.ejections_total)
        yield CounterMetricFamily("prefix_epp_fail_open_decisions",
                                  "Decisions made among all endpoints because none was in rotation",
                                  value=rotation.fail_open_decisions)
