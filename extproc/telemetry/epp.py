"""The picker's own Prometheus metrics, served on --metrics-port at /metrics.

Names follow the Go EPP where a metric has an equivalent there, except the per-decision hit ratio, which
is named as the prediction it is; our own use the `prefix_epp_` prefix. Every family is in docs/metrics.md
(tests/telemetry/test_metrics_doc.py).

| metric | type | labels |
|---|---|---|
| inference_objective_request_total | counter | model_name, target_model_name |
| inference_objective_request_error_total | counter | model_name, target_model_name, error_code |

`model_name` is bounded (extproc/telemetry/labels.py): names the picker knows from `--model-names` or
the engines' own metrics keep their value, any other client-chosen name is counted as `other`.
`target_model_name` equals `model_name`: the picker never rewrites the model (it is kept for the Go
EPP's dashboards).
| prefix_epp_requests_total | counter | outcome (routed, error), status (the HTTP status the client got: |
| | | upstream's or Envoy's for routed requests, counted at the response's end; none: no response) |
| prefix_epp_request_shapes_total | counter | api (completions, chat, messages, responses, embeddings, other: |
| | | an unknown path, routed by load alone; bodiless) -- routed requests by request shape |
| prefix_epp_affinity_requests_total | counter | source (previous_response_id, prompt_cache_key, session_header), |
| | | hit (true: the chosen endpoint had recorded the request's affinity key; false) -- never the key |
| prefix_epp_extproc_messages_total | counter | kind (request_headers, request_body, ..., response_trailers) |
| inference_extension_scheduler_e2e_duration_seconds | histogram | - (decision latency: body complete -> decision) |
| prefix_epp_predicted_prefix_hit_ratio | histogram | - (prediction: matched / total index blocks, chosen endpoint) |
| inference_extension_prefix_indexer_size | gauge | - ((endpoint, block) entries) |
| prefix_epp_prefix_index_bytes | gauge | - (estimated memory of the index) |
| prefix_epp_inflight_requests | gauge | endpoint (a disaggregated request counts on its prefill endpoint too) |
| prefix_epp_pd_decisions_total | counter | decision (disaggregated, decode-only): P/D profile handler only |
| prefix_epp_open_streams | gauge | - (ext_proc streams open now) |
| prefix_epp_extproc_streams_total | counter | end (complete, reset, error), closed_by (proxy, picker): |
| | | extproc/transport/stream_end.py |
| prefix_epp_ignored_headers_total | counter | header (test-epp-endpoint-selection without its flag) |
| inference_pool_ready_pods | gauge | name |
| inference_pool_average_kv_cache_utilization | gauge | name (fresh scrapes only, as the Go EPP) |
| inference_pool_average_queue_size | gauge | name (vllm:num_requests_waiting, fresh scrapes only) |
| inference_pool_average_running_requests | gauge | name (fresh scrapes only) |
| inference_pool_per_pod_queue_size | gauge | model_server_pod (endpoint name), name |
| prefix_epp_endpoint_metrics_stale | gauge | endpoint (1: no successful scrape within --metrics-staleness-threshold) |
| prefix_epp_endpoint_scrape_interval_seconds | gauge | endpoint (its scrapes' interval, or engine-share floor) |
| prefix_epp_cached_tokens_prediction_error_tokens | histogram | scorer (approximate, precise): abs error, tokens |
| prefix_epp_cached_tokens_predicted_within_one_block_total | counter | scorer (abs error <= engine block size) |
| prefix_epp_cached_tokens_predictions_total | counter | scorer (responses that reported cached_tokens) |
| prefix_epp_served_prompt_tokens_total | counter | - (sampled responses: the engine's prompt_tokens) |
| prefix_epp_served_cached_prompt_tokens_total | counter | - (sampled responses: the engine's cached_tokens) |
| prefix_epp_predicted_cached_prompt_tokens_total | counter | scorer (sampled responses: the prediction for them) |
| prefix_epp_kv_events_* | | KV-event subscriptions and precise index (extproc/telemetry/kv_events.py) |
| prefix_epp_endpoint_prefill_backlog_tokens, prefix_epp_endpoint_ttft_slowdown, prefix_epp_bytes_per_token | gauge | |
| | | the predicted-TTFT model, when its scorer runs (extproc/telemetry/latency.py) |

Gauges that describe state are computed at scrape time by a collector, so the request path only
increments counters and observes two histograms. Label children are cached per key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.config.settings import EppConfig
from extproc.control.affinity import SOURCES
from extproc.control.usage import Usage
from extproc.core.datastore import Datastore
from extproc.prefix.index import PrefixIndex
from extproc.request.openai import Api
from extproc.scheduling.disagg import DECODE_ONLY, DISAGGREGATED
from extproc.scheduling.load import usable_metrics
from extproc.telemetry.labels import ModelLabels

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
STREAM_ENDS = ("complete", "reset", "error")  # prefix_epp_extproc_streams_total{end}
STREAM_CLOSERS = ("proxy", "picker")  # ...{closed_by}
MESSAGE_KINDS = ("request_headers", "request_body", "request_trailers", "response_headers", "response_body",
                 "response_trailers")
ERROR_TOKEN_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536)
PD_DECISIONS = (DISAGGREGATED, DECODE_ONLY)  # prefix_epp_pd_decisions_total{decision}
SHAPES = (*(api.value for api in Api), "bodiless")  # prefix_epp_request_shapes_total{api}: a bounded label


_STALENESS_S = EppConfig().metrics_staleness_threshold_s


class _StateCollector(Collector):
    def __init__(self, datastore: Datastore, index: PrefixIndex | None, pool_name: str,
                 staleness_s: float = _STALENESS_S, open_streams: Callable[[], int] = lambda: 0) -> None:
        self._open_streams = open_streams
        self._ds = datastore
        self._index = index
        self._pool = pool_name
        self._staleness_s = staleness_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "prefix_epp_inflight_requests", "Requests routed to an endpoint and not yet completed",
            labels=["endpoint"],
        )
        for ep in self._ds.snapshot():
            inflight.add_metric([ep.key], ep.inflight)
        yield inflight
        yield GaugeMetricFamily("prefix_epp_open_streams", "ext_proc streams open now", value=self._open_streams())
        ready = GaugeMetricFamily("inference_pool_ready_pods", "Endpoints the picker may route to",
                                  labels=["name"])
        ready.add_metric([self._pool], len(self._ds))
        yield ready
        yield from self._pool_load()
        if self._index is not None:
            yield GaugeMetricFamily("inference_extension_prefix_indexer_size",
                                    "Entries (endpoint, block) in the prefix index", value=self._index.entries)
            yield GaugeMetricFamily("prefix_epp_prefix_index_bytes",
                                    "Estimated memory held by the prefix index", value=self._index.approx_bytes())

    def _pool_load(self) -> Iterator[GaugeMetricFamily]:
        now = time.monotonic()
        per_pod = GaugeMetricFamily("inference_pool_per_pod_queue_size", "Waiting queue per model server",
                                    labels=["model_server_pod", "name"])
        stale = GaugeMetricFamily("prefix_epp_endpoint_metrics_stale",
                                  "1 when an endpoint has no successful scrape within the staleness threshold",
                                  labels=["endpoint"])
        interval = GaugeMetricFamily("prefix_epp_endpoint_scrape_interval_seconds",
                                     "Seconds between two scrapes of the endpoint, as its last scrape was planned",
                                     labels=["endpoint"])
        fresh = []
        for ep in self._ds.snapshot():
            m = usable_metrics(ep, now, self._staleness_s)
            stale.add_metric([ep.key], 0 if m is not None else 1)
            if ep.metrics is not None and ep.metrics.interval_s > 0:
                interval.add_metric([ep.key], ep.metrics.interval_s)
            if m is not None:
                fresh.append(m)
                per_pod.add_metric([ep.spec.name or ep.key, self._pool], m.waiting)
        n = len(fresh)
        for name, doc, value in (
            ("inference_pool_average_kv_cache_utilization", "Average KV cache utilization (0..1)",
             sum(m.kv_usage for m in fresh) / n if n else 0.0),
            ("inference_pool_average_queue_size", "Average waiting queue per model server",
             sum(m.waiting for m in fresh) / n if n else 0.0),
            ("inference_pool_average_running_requests", "Average running requests per model server",
             sum(m.running for m in fresh) / n if n else 0.0),
        ):
            g = GaugeMetricFamily(name, doc, labels=["name"])
            g.add_metric([self._pool], value)
            yield g
        yield per_pod
        yield stale
        yield interval


class EppMetrics:
    def __init__(self, datastore: Datastore, index: PrefixIndex | None, pool_name: str = "",
                 metrics_staleness_s: float = _STALENESS_S, model_names: tuple[str, ...] = ()) -> None:
        self.models = ModelLabels(model_names)
        self.registry = CollectorRegistry()
        r = self.registry
        self._objective_requests = Counter(
            "inference_objective_request", "Requests by model", ["model_name", "target_model_name"], registry=r)
        self._objective_errors = Counter(
            "inference_objective_request_error", "Request errors by model",
            ["model_name", "target_model_name", "error_code"], registry=r)
        self._requests = Counter("prefix_epp_requests", "Requests by outcome and HTTP status",
                                 ["outcome", "status"], registry=r)
        shapes = Counter("prefix_epp_request_shapes", "Routed requests by request shape (API); other: an "
                         "unknown path, routed by load alone", ["api"], registry=r)
        self._shapes = {api: shapes.labels(api) for api in SHAPES}
        self._decision = Histogram(
            "inference_extension_scheduler_e2e_duration_seconds", "Decision latency of the picker",
            buckets=DECISION_BUCKETS, registry=r)
        self._hit_ratio = Histogram(
            "prefix_epp_predicted_prefix_hit_ratio", "Predicted at decision time: the share of the prompt's "
            "prefix-index blocks (--prefix-block-size bytes) the chosen endpoint holds",
            buckets=RATIO_BUCKETS, registry=r)
        self.open_streams = 0  # ext_proc streams open now (extproc/transport/grpc_server.py)
        r.register(_StateCollector(datastore, index, pool_name, metrics_staleness_s, lambda: self.open_streams))
        self._prediction_error = Histogram(
            "prefix_epp_cached_tokens_prediction_error_tokens",
            "Absolute error of the predicted cached prompt tokens on the chosen endpoint (closed loop)",
            ["scorer"], buckets=ERROR_TOKEN_BUCKETS, registry=r)
        self._predicted_within = Counter(
            "prefix_epp_cached_tokens_predicted_within_one_block",
            "Predictions of cached tokens within one engine block of the reported value", ["scorer"], registry=r)
        self._predictions = Counter(
            "prefix_epp_cached_tokens_predictions", "Cached-token predictions compared with the response usage",
            ["scorer"], registry=r)
        # The served hit rate, sampled responses only (--usage-sample-rate), and the prediction for them.
        self._served_prompt = Counter("prefix_epp_served_prompt_tokens", "Prompt tokens the engines reported in "
                                      "the usage of sampled responses", registry=r)
        self._served_cached = Counter("prefix_epp_served_cached_prompt_tokens", "Cached prompt tokens the engines "
                                      "reported in the usage of sampled responses", registry=r)
        self._predicted_cached = Counter(
            "prefix_epp_predicted_cached_prompt_tokens", "Cached prompt tokens the picker predicted for the "
            "sampled responses, by scorer", ["scorer"], registry=r)
        self._messages = Counter("prefix_epp_extproc_messages", "ext_proc messages received from the proxy",
                                 ["kind"], registry=r)
        self._message_children = {kind: self._messages.labels(kind) for kind in MESSAGE_KINDS}
        affinity = Counter("prefix_epp_affinity_requests", "Requests with an affinity hint, by source and "
                           "whether the chosen endpoint had recorded the key", ["source", "hit"], registry=r)
        self._affinity = {(source, hit): affinity.labels(source, str(hit).lower())
                          for source in SOURCES for hit in (False, True)}
        streams = Counter("prefix_epp_extproc_streams", "ext_proc streams by what became of the exchange (end) and "
                          "who closed the call (closed_by)", ["end", "closed_by"], registry=r)
        self._ignored_headers = Counter("prefix_epp_ignored_headers", "Requests carrying a control header the "
                                        "picker is configured to ignore", ["header"], registry=r)
        self._stream_ends = {(end, by): streams.labels(end, by) for end in STREAM_ENDS for by in STREAM_CLOSERS}
        self._pd = Counter("prefix_epp_pd_decisions", "Requests under a prefill/decode profile handler by the "
                           "decider's outcome (disaggregated: a prefill endpoint named in x-prefiller-host-port; "
                           "decode-only)", ["decision"], registry=r)
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

    def stream_ended(self, end: str, closed_by: str) -> None:
        """One ext_proc stream ended (`end` in STREAM_ENDS, `closed_by` in STREAM_CLOSERS)."""
        self._stream_ends[end, closed_by].inc()

    def ignored_header(self, name: str) -> None:
        """A request sent `name`, which the picker ignores (one of a fixed few: a bounded label)."""
        self._child(self._ignored_headers, (name,)).inc()

    def count_message(self, kind: str | None) -> None:
        """One ext_proc message from the proxy (per message: a dict lookup and an increment)."""
        child = self._message_children.get(kind or "")
        if child is not None:
            child.inc()

    def routed(self, model: str, target_model: str, api: str = "") -> None:
        """One routed request; `api` is its shape (one of SHAPES; anything else is not counted)."""
        model, target_model = self.models.label(model), self.models.label(target_model)
        self._child(self._objective_requests, (model, target_model)).inc()
        shape = self._shapes.get(api)
        if shape is not None:
            shape.inc()

    def pd_decision(self, decision: str) -> None:
        """One routed request under a P/D profile handler: `decision` in PD_DECISIONS (others not counted)."""
        if decision in PD_DECISIONS:
            self._child(self._pd, (decision,)).inc()

    def responded(self, status: int) -> None:
        """A routed request ended with the HTTP `status` its client got (0: it ended before any
        response, e.g. the client went away): prefix_epp_requests_total{outcome="routed"}."""
        label = str(status) if 100 <= status <= 599 else "none"
        self._child(self._requests, ("routed", label)).inc()

    def affinity(self, source: str, hit: bool) -> None:
        """One routed request with an affinity hint from `source` (one of affinity.SOURCES)."""
        child = self._affinity.get((source, hit))
        if child is not None:
            child.inc()

    def observe_usage(self, usage: Usage, predicted: Mapping[str, int], block_size: int) -> None:
        """Closed loop (extproc/control/usage.py): one sampled response's usage and the cached tokens
        each scorer predicted for it; an error within one engine block counts as within."""
        self._served_prompt.inc(usage.prompt_tokens)
        self._served_cached.inc(usage.cached_tokens)
        for scorer, tokens in predicted.items():
            error = abs(tokens - usage.cached_tokens)
            self._child(self._predicted_cached, (scorer,)).inc(tokens)
            self._child(self._prediction_error, (scorer,)).observe(error)
            self._child(self._predictions, (scorer,)).inc()
            within = self._child(self._predicted_within, (scorer,))  # exported from the first prediction on
            if error <= block_size:
                within.inc()

    def error(self, model: str, target_model: str, code: str, status: int) -> None:
        model, target_model = self.models.label(model), self.models.label(target_model)
        self._child(self._objective_requests, (model, target_model)).inc()
        self._child(self._objective_errors, (model, target_model, code)).inc()
        self._child(self._requests, ("error", str(status))).inc()
