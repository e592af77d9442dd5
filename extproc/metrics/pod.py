"""One /metrics endpoint for a pod of several workers (`--workers N`, extproc/workers.py).

Worker 0 serves the pod's metrics port from this collector: its own families plus every sibling's,
each sample labelled `worker="<index>"`. Siblings serve their registry on a loopback port that
only worker 0 reads; the read happens in the metrics HTTP server's thread at scrape time (1 s
timeout per sibling; a sibling that does not answer is left out of that scrape and counted in
`prefix_epp_worker_scrape_failures_total`), never on the event loop.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class PodMetrics(Collector):
    def __init__(self, local: CollectorRegistry, siblings: Sequence[tuple[int, str]], timeout_s: float = 1.0) -> None:
        self._local = local
        self._siblings = list(siblings)  # (worker index, http://127.0.0.1:port/metrics)
        self._timeout = timeout_s
        self.failures = 0

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        self._merge(merged, self._local.collect(), "0")
        for index, url in self._siblings:
            try:
                with urllib.request.urlopen(url, timeout=self._timeout) as r:
                    text = r.read().decode()
            except OSError:
                self.failures += 1
                continue
            self._merge(merged, text_string_to_metric_families(text), str(index))
        yield from merged.values()
        yield CounterMetricFamily("prefix_epp_worker_scrape_failures", "Sibling workers that did not answer a scrape",
                                  value=self.failures)

    @staticmethod
    def _merge(merged: dict[str, Metric], families: Iterable[Metric], worker: str) -> None:
        for fam in families:
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples.extend(Sample(s.name, {**s.labels, "worker": worker}, s.value, s.timestamp, s.exemplar)
                               for s in fam.samples)


def pod_registry(local: CollectorRegistry, siblings: Sequence[tuple[int, str]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PodMetrics(local, siblings))
    return registry
