"""One /metrics endpoint for a pod of several workers (`--workers N`, extproc/runtime/workers.py).

Worker 0 serves the pod's metrics port: its own families plus every sibling's, each sample
labelled `worker="<index>"`. Siblings serve their registry on a loopback port that only worker 0
reads. At scrape time worker 0 renders its own registry on the event loop (where every collector
reads a consistent state, extproc/telemetry/http.py), then reads the siblings and merges in a worker
thread (1 s timeout per sibling; a sibling that does not answer is left out of that scrape and
counted in `prefix_epp_worker_scrape_failures_total`), never blocking the loop.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample


class PodMetrics(Collector):
    """The pod's families, merged from worker 0's own scrape text and its siblings' at `render`."""

    def __init__(self, siblings: Sequence[tuple[int, str]], timeout_s: float = 1.0) -> None:
        self._siblings = list(siblings)  # (worker index, http://127.0.0.1:port/metrics)
        self._timeout = timeout_s
        self._local_text = ""
        self.failures = 0

    def render(self, local_text: str) -> bytes:
        """The pod's scrape body from worker 0's own text (blocking: call it off the event loop)."""
        self._local_text = local_text
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        self._merge(merged, text_string_to_metric_families(self._local_text), "0")
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


def pod_renderer(local: CollectorRegistry, siblings: Sequence[tuple[int, str]]) -> Callable[[], Awaitable[bytes]]:
    """The /metrics body of worker 0 of a multi-worker pod (see the module docstring)."""
    pod = PodMetrics(siblings)

    async def render() -> bytes:
        local_text = generate_latest(local).decode()  # on the loop: a consistent view
        return await asyncio.to_thread(pod.render, local_text)

    return render
