"""The scraper at scale against real HTTP servers: only the families it reads are asked for (and
prometheus_client's own exposition honours that), a server that cannot filter still gets scraped,
the pool-wide budget bounds the scrape rate, an endpoint the picker routes to is refreshed first,
and every scrape carries the interval it was taken at."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily

from extproc.config.settings import EppConfig, MetricsSourceConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.scraping.scraper import FAMILIES, MetricsScraper
from testkit.procs import free_ports, python_module, running, until, wait_for_port
from testkit.vllm_stubs import serve_metrics
from testkit.vllm_text import exposition

# The engine-share floor off: these tests read the budget and the base interval alone (its own tests:
# test_engine_share.py, test_plan.py).
CFG = replace(EppConfig(), refresh_metrics_interval_s=0.05, scrape_timeout_s=1.0, scrape_engine_share=0.0)


async def run_scraper(scraper: MetricsScraper) -> asyncio.Task[None]:
    return asyncio.create_task(scraper.run())


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Recorder:
    """Model servers on 127.0.0.1 serving the whole vLLM page whatever the query, recording each query."""

    def __init__(self) -> None:
        self.queries: dict[int, list[list[str]]] = {}
        self.runners: list[web.AppRunner] = []

    async def start(self, ports: list[int]) -> None:
        page = exposition(2, 1, 0.3)
        for port in ports:
            self.queries[port] = []

            async def handle(request: web.Request, port: int = port) -> web.Response:
                self.queries[port].append(request.query.getall("name[]", []))
                return web.Response(body=page, content_type="text/plain")

            self.runners.append(await serve_metrics(port, handle))

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()
    yield rec
    await rec.close()


def specs(ports: list[int]) -> list[EndpointSpec]:
    return [EndpointSpec("127.0.0.1", p) for p in ports]


async def test_only_the_families_read_are_asked_for(recorder: Recorder) -> None:
    ports = free_ports(2)
    await recorder.start(ports)
    ds = Datastore()
    ds.set_endpoints(specs(ports))
    scraper = MetricsScraper(CFG, ds)
    task = await run_scraper(scraper)
    try:
        await until(lambda: all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot()))
    finally:
        await stop(task)
    wanted = sorted(f.decode() for f in FAMILIES)
    assert all(sorted(q) == wanted for qs in recorder.queries.values() for q in qs)
    # A server that ignores the filter answers the whole page, which parses the same.
    ep = ds.snapshot()[0]
    assert ep.metrics is not None and (ep.metrics.waiting, ep.metrics.running, ep.metrics.kv_usage) == (2, 1, 0.3)


async def test_the_filter_can_be_switched_off(recorder: Recorder) -> None:
    ports = free_ports(1)
    await recorder.start(ports)
    ds = Datastore()
    ds.set_endpoints(specs(ports))
    cfg = replace(CFG, metrics_source=MetricsSourceConfig(filter_families=False))
    task = await run_scraper(MetricsScraper(cfg, ds))
    try:
        await until(lambda: ds.snapshot()[0].metrics is not None)
    finally:
        await stop(task)
    assert recorder.queries[ports[0]] and all(q == [] for q in recorder.queries[ports[0]])


class UndescribedCollector:
    """Collects the load gauges but has no describe(), as prometheus_client's MultiProcessCollector
    (vLLM with several API server processes): a filtered scrape of its registry is empty."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("vllm:num_requests_waiting", "waiting", labels=["model_name"])
        g.add_metric(["m"], 7.0)
        yield g
        k = GaugeMetricFamily("vllm:kv_cache_usage_perc", "kv", labels=["model_name"])
        k.add_metric(["m"], 0.5)
        yield k


@pytest.fixture
def prometheus_servers() -> Iterator[list[int]]:
    """Two real prometheus_client exposition servers: [0] a plain registry, [1] an undescribed one."""
    ports = free_ports(2)
    plain = CollectorRegistry()
    Gauge("vllm:num_requests_waiting", "w", ["model_name"], registry=plain).labels("m").set(3)
    Gauge("vllm:num_requests_running", "r", ["model_name"], registry=plain).labels("m").set(4)
    Gauge("vllm:kv_cache_usage_perc", "k", ["model_name"], registry=plain).labels("m").set(0.25)
    Gauge("vllm:not_read_by_the_picker", "x", registry=plain).set(1)
    multi = CollectorRegistry()
    multi.register(UndescribedCollector())  # type: ignore[arg-type]
    servers = [start_http_server(ports[0], "127.0.0.1", plain), start_http_server(ports[1], "127.0.0.1", multi)]
    yield ports
    for httpd, thread in servers:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


async def test_prometheus_client_filters_and_an_empty_filtered_page_falls_back(
        prometheus_servers: list[int]) -> None:
    plain, multi = prometheus_servers
    ds = Datastore()
    ds.set_endpoints(specs([plain, multi]))
    scraper = MetricsScraper(CFG, ds)
    task = await run_scraper(scraper)
    try:
        await until(lambda: all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot()))
        a, b = ds.get(f"127.0.0.1:{plain}"), ds.get(f"127.0.0.1:{multi}")
        assert a is not None and b is not None and a.metrics is not None and b.metrics is not None
        assert (a.metrics.waiting, a.metrics.running, a.metrics.kv_usage) == (3, 4, 0.25)
        assert (b.metrics.waiting, b.metrics.kv_usage) == (7, 0.5)
        # The plain registry answered the filtered page; the undescribed one is scraped whole from now on.
        assert "?" in scraper._url(a) and "?" not in scraper._url(b)
        n = scraper.scrapes
        await until(lambda: scraper.scrapes >= n + 4)
        assert b.metrics.ok
    finally:
        await stop(task)


async def test_the_budget_bounds_the_pool_wide_rate(tmp_path: Path) -> None:
    """64 model servers in another process with a budget of 160 scrapes a second: each is scraped
    every 400 ms, never faster in total than the budget (how much CPU that takes is a benchmark
    figure, bench/results/scale.md, not a test)."""
    ports = free_ports(64)
    with running(python_module("testkit.vllm_stubs", *map(str, ports)), tmp_path / "ms.log",
                 wait_port=ports[-1]):
        for p in ports:
            wait_for_port(p)
        ds = Datastore()
        ds.set_endpoints(specs(ports))
        cfg = replace(CFG, scrape_budget_per_s=160.0)
        scraper = MetricsScraper(cfg, ds)
        task = await run_scraper(scraper)
        try:
            await until(lambda: all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot()), timeout=30)
            assert scraper.interval_s == pytest.approx(0.4)
            assert all(ep.metrics is not None and ep.metrics.interval_s == pytest.approx(0.4)
                       for ep in ds.snapshot())
            wall0, n0 = time.monotonic(), scraper.scrapes
            await until(lambda: scraper.scrapes >= n0 + 160, timeout=60)
            wall, n = time.monotonic() - wall0, scraper.scrapes - n0
        finally:
            await stop(task)
    assert n / wall <= 160 * 1.1


async def test_an_endpoint_routed_to_is_refreshed_first(recorder: Recorder) -> None:
    """20 endpoints, a budget of 20 scrapes a second (each endpoint every second, one start every
    50 ms): an endpoint that keeps getting requests takes about every other start."""
    ports = free_ports(20)
    await recorder.start(ports)
    ds = Datastore()
    ds.set_endpoints(specs(ports))
    scraper = MetricsScraper(replace(CFG, scrape_budget_per_s=20.0), ds)
    task = await run_scraper(scraper)
    hot = ports[0]
    try:
        await until(lambda: all(ep.metrics is not None for ep in ds.snapshot()), timeout=30)
        before = {p: len(q) for p, q in recorder.queries.items()}

        async def keep_routing() -> None:
            while True:
                ep = ds.acquire(f"127.0.0.1:{hot}")
                assert ep is not None
                ds.release(ep)
                await asyncio.sleep(0.005)

        router = asyncio.create_task(keep_routing())
        try:
            await until(lambda: len(recorder.queries[hot]) >= before[hot] + 6, timeout=30)
        finally:
            await stop(router)
        after = {p: len(q) - before[p] for p, q in recorder.queries.items()}
    finally:
        await stop(task)
    # 6 scrapes of the hot endpoint took ~12 starts, the 19 others sharing the other half; without
    # the refresh it would have waited a second between two, and each other endpoint been scraped ~6 times.
    assert sum(v for p, v in after.items() if p != hot) <= 2 * 19
    assert max(v for p, v in after.items() if p != hot) <= 3
