"""Background scraping of every endpoint's model-server /metrics (vLLM names), off the request path.

Loop: one task paces the whole pool (extproc/scraping/plan.py): each endpoint is scraped every
max(--refresh-metrics-interval, endpoints / --scrape-budget) seconds, earliest due first, the
starts spread evenly over the interval, an endpoint the picker just routed to ahead of the rest
(the datastore's acquired listener), and no endpoint more often than its engine-share floor
allows: each GET's duration is handed to the plan, which keeps the pickers' scrapes under
--scrape-engine-share of the engine's server time (`scrapers`, wired by the process: the pods
syncing with this one times its workers, share it). Endpoints join and leave the plan through the datastore's
added/removed listeners. Each scrape is a task of its own (a slow engine delays nobody else)
over extproc/scraping/http.py (a narrow GET client, one kept-alive connection per endpoint), with
a timeout of `scrape_timeout_s` (1 s), asking for an uncompressed body (decompressing would
cost more CPU than the loopback or pod network saves).
Every successful scrape carries the interval it was taken at (`ModelServerMetrics.interval_s`),
so staleness can be judged against it (extproc/scheduling/load.py).

Only the families read below are asked for (`MetricsSourceConfig.filter_families`, default on):
the URL carries `?name[]=<sample name>` for each of `FAMILIES`, which prometheus_client's
exposition (vLLM's /metrics) honours by collecting and rendering only those, ~2 KB instead of
~125 KB: less to read and parse here, less to render on the engine. A server that ignores the
parameter answers the whole page, which parses the same. One whose filtered answer has none of
the load families (prometheus_client in multiprocess mode, e.g. vLLM with several API server
processes, answers an empty page) is scraped once more without the filter; when that page
parses, the endpoint keeps the whole page from then on (logged once).

What a model server may answer (it is not trusted to behave; MetricsSourceConfig):
- only its own address is read: redirects are not followed (a 3xx is a failed scrape), so an
  engine cannot point the picker at another host;
- the body is read up to `max_body_bytes` (4 MiB; vLLM's is ~100 KB): a larger one is a failed
  scrape, never buffered whole;
- the cache config is capped before anything is sized from it: a block_size over
  `max_block_size` (4096) makes the cache config unknown; num_gpu_blocks is capped at
  `max_num_gpu_blocks` (2^20) and at `max_cache_tokens` (2^24) / block_size. The first capped
  report of an endpoint is logged (warning, with the reported values).

The body goes through extproc/scraping/prom_text.py, which only looks at the lines of these
families:

| field | metric | several series |
|---|---|---|
| waiting | vllm:num_requests_waiting | summed (e.g. one per data-parallel engine) |
| running | vllm:num_requests_running | summed |
| kv_usage | vllm:kv_cache_usage_perc (else vllm:gpu_cache_usage_perc) | the highest |
| block_size, num_gpu_blocks | vllm:cache_config_info labels | the first |
| running/waiting_loras, max_lora | vllm:lora_requests_info labels | the newest (highest value) |
| model_names | `model_name` labels of vllm:num_requests_running | all |
| ttft_sum_s, ttft_count | vllm:time_to_first_token_seconds_sum / _count | summed |
| prompt_tokens | vllm:prompt_tokens_total | summed |
| waiting_capacity | vllm:num_requests_waiting_by_reason{reason="capacity"} | summed |
| started_at | process_start_time_seconds (the engine's API server process) | the newest |

A changed `started_at` is an engine restart: `Datastore.set_metrics` tells its `on_restarted`
listeners, and the approximate index and the precise index forget what the endpoint held, before
the new engine has published a single event (its cache is empty; stale hits would follow).

Model names and LoRA adapters seen are handed to `on_models` (extproc/telemetry/labels.py: the
model names that keep their own metric label).

A scrape is successful when the status is 200 and at least one of the first three families is
present; its result goes to `Datastore.set_metrics` with `ok=True` and `updated_at` the time the
GET was sent: the engine rendered the page at some moment between sending and receiving, and a
busy engine's answer can take tens of milliseconds to arrive after it rendered. Stamped at
arrival, a request routed during the fetch (never in the page) would read as routed before the
sample, and as late for its first token by the whole fetch (the first-token bound,
extproc/scheduling/first_token.py, reads such lateness as a slow engine). A failed
scrape keeps the last values with `ok=False` and the old `updated_at`, so every metric-based
plugin scores the endpoint as saturated (extproc/scheduling/load.py: usable_metrics). Failures
are logged once per transition per endpoint.

Prefix-index auto-tune (PrefixConfig.auto_tune, `autoTune` of prefix-cache-scorer): an engine
holds num_gpu_blocks blocks of block_size tokens, i.e. num_gpu_blocks * block_size * bytes_per_token
prompt bytes (~4 bytes per token), and the index counts blocks of block_size_bytes, so

    capacity(e) = max(1, num_gpu_blocks * block_size * bytes_per_token // block_size_bytes)

e.g. 1000 GPU blocks of 16 tokens with 64-byte index blocks -> 1000 index blocks. It is applied
with PrefixIndex.set_capacity whenever the reported cache config changes; once the predicted-TTFT
scorer has learned the pool's bytes per token (extproc/scheduling/latency.py), it re-applies the
formula with that value instead of 4.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from urllib.parse import quote

from extproc.config.settings import EppConfig
from extproc.core.datastore import Datastore, Endpoint, ModelServerMetrics, join_host_port
from extproc.prefix.capacity import auto_tuned_capacity
from extproc.prefix.index import PrefixIndex
from extproc.scraping.http import MetricsHttp, ScrapeError
from extproc.scraping.plan import ScrapePlan
from extproc.scraping.prom_text import samples

log = logging.getLogger("prefix_epp.scrape")

WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
KV_USAGE = b"vllm:kv_cache_usage_perc"
KV_USAGE_V0 = b"vllm:gpu_cache_usage_perc"
CACHE_CONFIG = b"vllm:cache_config_info"
LORA_INFO = b"vllm:lora_requests_info"
TTFT_SUM = b"vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = b"vllm:time_to_first_token_seconds_count"
PROMPT_TOKENS = b"vllm:prompt_tokens_total"
WAITING_BY_REASON = b"vllm:num_requests_waiting_by_reason"
PROCESS_START = b"process_start_time_seconds"
# The sample names the filtered URL asks for: every name parse_vllm_metrics reads (a new family is
# one constant above, one entry here, and its lines in parse_vllm_metrics).
FAMILIES = (WAITING, RUNNING, KV_USAGE, KV_USAGE_V0, CACHE_CONFIG, LORA_INFO, TTFT_SUM, TTFT_COUNT,
            PROMPT_TOKENS, WAITING_BY_REASON, PROCESS_START)


__all__ = ["FAMILIES", "MetricsScraper", "ScrapeError", "family_query", "parse_vllm_metrics"]


def _split_names(value: str) -> frozenset[str]:
    return frozenset(v.strip() for v in value.split(",") if v.strip())


def _int_label(labels: dict[str, str], key: str) -> int:
    try:
        return int(float(labels.get(key, "0")))
    except ValueError:
        return 0


def family_query(families: tuple[bytes, ...] = FAMILIES) -> str:
    """`?name[]=...&name[]=...`: prometheus_client's exposition then renders only these samples."""
    return "?" + "&".join("name%5B%5D=" + quote(f.decode(), safe="") for f in families)


def parse_vllm_metrics(body: bytes, now: float) -> ModelServerMetrics:
    """Extract the vLLM load signals from one exposition, stamped `now` (when it was asked for);
    ScrapeError when none is there."""
    waiting = samples(body, WAITING, want_labels=False)
    running = samples(body, RUNNING)
    kv = samples(body, KV_USAGE, want_labels=False) or samples(body, KV_USAGE_V0, want_labels=False)
    if not (waiting or running or kv):
        raise ScrapeError("no vLLM load metrics in the exposition")
    m = ModelServerMetrics(
        waiting=sum(v for _, v in waiting),
        running=sum(v for _, v in running),
        kv_usage=max(v for _, v in kv) if kv else 0.0,
        model_names=frozenset(labels["model_name"] for labels, _ in running if labels.get("model_name")),
        updated_at=now, ok=True,
    )
    cache = samples(body, CACHE_CONFIG)
    if cache:
        m.block_size = _int_label(cache[0][0], "block_size")
        m.num_gpu_blocks = _int_label(cache[0][0], "num_gpu_blocks")
    ttft_count = samples(body, TTFT_COUNT, want_labels=False)
    if ttft_count:
        m.ttft_count = sum(v for _, v in ttft_count)
        m.ttft_sum_s = sum(v for _, v in samples(body, TTFT_SUM, want_labels=False))
    prompt_tokens = samples(body, PROMPT_TOKENS, want_labels=False)
    if prompt_tokens:
        m.prompt_tokens = sum(v for _, v in prompt_tokens)
    by_reason = samples(body, WAITING_BY_REASON)
    if by_reason:
        m.waiting_capacity = sum(v for labels, v in by_reason if labels.get("reason") == "capacity")
    started = samples(body, PROCESS_START, want_labels=False)
    if started:
        m.started_at = max(v for _, v in started)
    lora = samples(body, LORA_INFO)
    if lora:
        labels, _ = max(lora, key=lambda s: s[1])
        m.running_loras = _split_names(labels.get("running_lora_adapters", ""))
        m.waiting_loras = _split_names(labels.get("waiting_lora_adapters", ""))
        m.max_lora = _int_label(labels, "max_lora")
    return m


class MetricsScraper:
    def __init__(self, config: EppConfig, datastore: Datastore, index: PrefixIndex | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.datastore = datastore
        self.index = index
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}  # the scrapes in progress
        self._plan: ScrapePlan | None = None  # while run() is active
        self._full_page: set[str] = set()  # endpoints whose filtered page lacked the load families
        self._capacity: dict[str, int] = {}
        self._failing: set[str] = set()
        self._capped: set[str] = set()  # endpoints whose capped cache config was logged
        self._http: MetricsHttp | None = None  # while run() is active
        self.scrapes = 0  # attempts so far (tests, benchmarks)
        self.on_models: Callable[[frozenset[str]], None] | None = None  # engine-reported model names
        self.scrapers: Callable[[], int] | None = None  # picker processes scraping the same engines
        datastore.on_added(self._added)
        datastore.on_removed(self._removed)
        datastore.on_acquired(self._touched)
        self._query = family_query() if config.metrics_source.filter_families else ""

    def _target(self, ep: Endpoint, filtered: bool = True) -> str:
        query = self._query if filtered and ep.key not in self._full_page else ""
        return f"{self.config.metrics_source.path}{query}"

    def _url(self, ep: Endpoint, filtered: bool = True) -> str:
        host = join_host_port(ep.address, ep.port)
        return f"{self.config.metrics_source.scheme}://{host}{self._target(ep, filtered)}"

    @property
    def interval_s(self) -> float:
        """Seconds between two scrapes of one endpoint at the current pool size."""
        return self._plan.interval() if self._plan is not None else self.config.refresh_metrics_interval_s

    def interval_of(self, key: str) -> float:
        """Seconds between two scrapes of `key`: the pool's interval or its engine-share floor."""
        return self._plan.interval_of(key) if self._plan is not None else self.config.refresh_metrics_interval_s

    def _added(self, ep: Endpoint) -> None:
        if self._plan is not None:
            self._plan.add(ep.key, self._clock())

    def _touched(self, ep: Endpoint) -> None:
        if self._plan is not None:
            self._plan.touch(ep.key)

    def _removed(self, ep: Endpoint) -> None:
        if self._plan is not None:
            self._plan.remove(ep.key)
        task = self._tasks.pop(ep.key, None)
        if task is not None:
            task.cancel()
        self._capacity.pop(ep.key, None)
        self._failing.discard(ep.key)
        self._capped.discard(ep.key)
        self._full_page.discard(ep.key)

    async def run(self) -> None:
        """Scrape until cancelled."""
        src = self.config.metrics_source
        self._http = MetricsHttp(src.scheme, src.insecure_skip_verify, self.config.scrape_timeout_s,
                                 src.max_body_bytes)
        plan = self._plan = ScrapePlan(self.config.refresh_metrics_interval_s, self.config.scrape_budget_per_s,
                                       self.config.scrape_engine_share)
        try:
            for ep in self.datastore.snapshot():
                self._added(ep)
            while True:
                now = self._clock()
                if self.scrapers is not None:
                    plan.set_scrapers(self.scrapers())
                key = plan.start(now)
                if key is None:
                    # Sleep until the next start; at most one base interval, so an endpoint added or
                    # touched meanwhile waits no longer than that.
                    wait = plan.wait(now)
                    base = plan.base_interval_s
                    await asyncio.sleep(base if wait is None else min(wait, base))
                    continue
                target = self.datastore.get(key)
                if target is None:
                    plan.remove(key)
                    continue
                self._tasks[key] = asyncio.get_running_loop().create_task(self._scrape_planned(target))
        finally:
            self._plan = None
            tasks = list(self._tasks.values())
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            http, self._http = self._http, None
            await http.close()

    async def _scrape_planned(self, ep: Endpoint) -> None:
        try:
            await self.scrape_once(ep)
        except Exception:  # a fault in our own handling of a scrape: log it, keep scraping
            log.exception("metrics scrape handling failed", extra={"endpoint": ep.key})
        finally:
            if self._tasks.get(ep.key) is asyncio.current_task():
                del self._tasks[ep.key]
            if self._plan is not None:
                self._plan.done(ep.key, self._clock())

    async def _fetch(self, ep: Endpoint, target: str) -> bytes:
        """One GET; its duration goes to the plan (the engine's cost of a render, plan.py)."""
        assert self._http is not None
        sent = self._clock()
        body = await self._http.get(ep.key, ep.address, ep.port, join_host_port(ep.address, ep.port), target)
        if self._plan is not None:
            self._plan.observe(ep.key, self._clock() - sent)
        return body

    async def _fetch_and_parse(self, ep: Endpoint) -> ModelServerMetrics:
        target = self._target(ep)
        sent = self._clock()  # the stamp (module docstring): no later than the page's render
        body = await self._fetch(ep, target)
        try:
            return parse_vllm_metrics(body, sent)
        except ScrapeError:
            full = self._target(ep, filtered=False)
            if target == full:
                raise
        sent = self._clock()
        m = parse_vllm_metrics(await self._fetch(ep, full), sent)
        self._full_page.add(ep.key)
        log.info("the filtered metrics page lacks the load families; scraping the whole page",
                 extra={"endpoint": ep.key})
        return m

    async def scrape_once(self, ep: Endpoint) -> ModelServerMetrics:
        assert self._http is not None, "scrape_once needs run() to be active"
        self.scrapes += 1
        try:
            m = await self._fetch_and_parse(ep)
            m.interval_s = self.interval_of(ep.key)
            self._cap(ep.key, m)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            m = replace(ep.metrics, ok=False) if ep.metrics is not None else ModelServerMetrics(ok=False)
            if ep.key not in self._failing:
                self._failing.add(ep.key)
                log.warning("metrics scrape failed; endpoint counts as saturated",
                            extra={"endpoint": ep.key, "error": f"{type(exc).__name__}: {exc}"[:200]})
        else:
            if ep.key in self._failing:
                self._failing.discard(ep.key)
                log.info("metrics scrape recovered", extra={"endpoint": ep.key})
            self._tune(ep.key, m)
            if self.on_models is not None:
                self.on_models(m.model_names | m.running_loras | m.waiting_loras)
        self.datastore.set_metrics(ep.key, m)
        return m

    def _cap(self, key: str, m: ModelServerMetrics) -> None:
        """Cap the reported cache config in place (see the module docstring); log the first time."""
        src = self.config.metrics_source
        reported = (m.num_gpu_blocks, m.block_size)
        if m.block_size > src.max_block_size:
            m.block_size = m.num_gpu_blocks = 0
        elif m.block_size > 0:
            m.num_gpu_blocks = min(m.num_gpu_blocks, src.max_num_gpu_blocks, src.max_cache_tokens // m.block_size)
        if (m.num_gpu_blocks, m.block_size) != reported and key not in self._capped:
            self._capped.add(key)
            log.warning("engine reports a KV cache beyond the picker's limits; capped", extra={
                "endpoint": key, "num_gpu_blocks": reported[0], "block_size": reported[1],
                "capped_num_gpu_blocks": m.num_gpu_blocks, "capped_block_size": m.block_size,
                "max_num_gpu_blocks": src.max_num_gpu_blocks, "max_block_size": src.max_block_size,
                "max_cache_tokens": src.max_cache_tokens})

    def _tune(self, key: str, m: ModelServerMetrics) -> None:
        pcfg = self.config.prefix
        if self.index is None or not pcfg.auto_tune or "capacity-auto-tune" in self.config.latency.ablate:
            return
        capacity = auto_tuned_capacity(m, pcfg.block_size_bytes, pcfg.bytes_per_token)
        if capacity is not None and self._capacity.get(key) != capacity:
            self._capacity[key] = capacity
            with contextlib.suppress(ValueError):
                self.index.set_capacity(key, capacity)
            log.info("prefix index capacity tuned from vllm:cache_config_info",
                     extra={"endpoint": key, "capacity_blocks": capacity,
                            "num_gpu_blocks": m.num_gpu_blocks, "block_size": m.block_size})
