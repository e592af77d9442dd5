"""Prometheus exposition of one replica's engine state, under vLLM V1's metric names.

Each replica owns a `CollectorRegistry` holding one `SimCollector`, which reads the engine and
cache at scrape time: nothing is updated per request except plain integers and the small
`Histogram` below, so the request path never touches prometheus_client locks.

Exposed (labels `model_name=<first served name>` unless noted):
  gauges      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0..1)
  info        vllm:cache_config_info{block_size, num_gpu_blocks, enable_prefix_caching} = 1
              vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
                = scrape time (unix seconds; GIE reads the newest series)
  counters    vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens),
              vllm:external_prefix_cache_queries_total, vllm:external_prefix_cache_hits_total (tokens;
              with a KV connector only, `prefix_epp_sim.kv_transfer`),
              vllm:prompt_tokens_total, vllm:generation_tokens_total,
              vllm:request_success_total{finished_reason="length"}, vllm:num_preemptions_total
  histograms  vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds,
              vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds (model time,
              vLLM's bucket bounds)
  process    process_start_time_seconds (no labels): when the replica started serving, unix
              seconds, as prometheus_client's process collector exports it for vLLM's API server;
              the picker reads a new value as an engine restart (extproc/scraping/scraper.py)
With `metrics_surface` "minimal" only the three gauges and vllm:cache_config_info are exported
(no histograms, counters or LoRA info), as many engines that are not vLLM.
Counters carry no `_created` series, as vLLM's exposition does not. As in vLLM V1, a request's
prompt tokens are counted with its first token (when its TTFT is observed), not when it ends.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from prefix_epp_sim.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Cumulative-on-read bucket counts; `observe` is one bisect and three additions."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", self.count))
        return out


class SimCollector:
    def __init__(self, engine: Engine, model_name: str, surface: str = "vllm",
                 started_at: Callable[[], float] | None = None) -> None:
        self._engine = engine
        self._model = model_name
        self._minimal = surface == "minimal"
        self._started_at = started_at

    def collect(self) -> Iterator[Metric]:
        engine, labels, values = self._engine, ["model_name"], [self._model]
        cfg, cache, stats = engine.config, engine.cache, engine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            metric = GaugeMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            metric = CounterMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        def histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
            metric = HistogramMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, hist.cumulative(), hist.total)
            return metric

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    len(engine.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    len(engine.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", cache.usage)

        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([str(cache.block_size), str(cache.num_blocks), "True"], 1.0)
        yield info
        if self._minimal:
            return
        if self._started_at is not None:
            yield GaugeMetricFamily("process_start_time_seconds",
                                    "Start time of the process since unix epoch in seconds.", self._started_at())

        running, waiting = engine.lora_adapters()
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        lora.add_metric([",".join(running), ",".join(waiting), str(cfg.max_loras)], time.time())
        yield lora

        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.prefix_hits)
        if cfg.kv_connector:  # vLLM's connector counters (prefix_epp_sim.kv_transfer)
            yield counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                          "cross-instance cache sharing, in terms of number of queried tokens.",
                          stats.external_queries)
            yield counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                          "cross-instance cache sharing, in terms of number of cached tokens.", stats.external_hits)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", 0)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        success.add_metric([*values, "length"], stats.requests_success)
        yield success

        yield histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        stats.ttft)
        yield histogram("vllm:time_per_output_token_seconds",
                        "Histogram of time per output token in seconds.", stats.tpot)
        yield histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        stats.e2e)
        yield histogram("vllm:request_queue_time_seconds",
                        "Histogram of time spent in WAITING phase for request.", stats.queue)


def build_registry(engine: Engine, model_name: str, surface: str = "vllm",
                   started_at: Callable[[], float] | None = None) -> CollectorRegistry:
    """A fresh registry for one replica (never the process-global one); `started_at`: the
    replica's start (unix seconds) for process_start_time_seconds."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SimCollector(engine, model_name, surface, started_at))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return bytes(generate_latest(registry))
