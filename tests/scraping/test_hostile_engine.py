"""A model server that misbehaves on /metrics, served by a real HTTP server: absurd cache configs,
huge bodies, redirects to another host. Memory stays bounded and only the endpoint's own address
is read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from aiohttp import web

from extproc.config.settings import EppConfig, KVEventsConfig, MetricsSourceConfig
from extproc.core.datastore import Datastore, EndpointSpec, ModelServerMetrics
from extproc.kvevents.manager import KVEventsManager
from extproc.kvevents.wire import Stored
from extproc.prefix.index import PrefixIndex
from extproc.scraping.scraper import MetricsScraper
from testkit.procs import free_port, until
from testkit.vllm_text import exposition

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CFG = replace(EppConfig(), refresh_metrics_interval_s=0.02, scrape_timeout_s=2.0)


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[int, list[int]]]:
    """An HTTP server on 127.0.0.1 answering GET /metrics with `handler`; yields (port, hits)."""
    hits: list[int] = []

    async def counted(request: web.Request) -> web.StreamResponse:
        hits.append(1)
        return await handler(request)

    app = web.Application()
    app.router.add_get("/metrics", counted)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port, hits
    finally:
        await runner.cleanup()


def page(body: bytes) -> Handler:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")
    return handle


@contextlib.asynccontextmanager
async def scraping(cfg: EppConfig, port: int, index: PrefixIndex | None = None) -> AsyncIterator[MetricsScraper]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("127.0.0.1", port)])
    scraper = MetricsScraper(cfg, ds, index)
    task = asyncio.create_task(scraper.run())
    try:
        yield scraper
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)



def scraped_ok(scraper: MetricsScraper) -> bool:
    m = scraper.datastore.snapshot()[0].metrics
    return m is not None and m.ok


def metrics_of(scraper: MetricsScraper) -> ModelServerMetrics:
    m = scraper.datastore.snapshot()[0].metrics
    assert m is not None
    return m


async def test_an_absurd_cache_config_is_capped_and_both_indexes_stay_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    limit = 1000
    cfg = replace(CFG, metrics_source=MetricsSourceConfig(max_num_gpu_blocks=limit))
    index = PrefixIndex(cfg.prefix.lru_capacity_per_server)
    async with serving(page(exposition(1, 1, 0.1, num_gpu_blocks=10**15))) as (port, _):
        with caplog.at_level(logging.WARNING, logger="prefix_epp.scrape"):
            async with scraping(cfg, port, index) as scraper:
                await until(lambda: scraper.scrapes >= 3 and scraped_ok(scraper))
                ep = scraper.datastore.snapshot()[0]
                assert (metrics_of(scraper).num_gpu_blocks, metrics_of(scraper).block_size) == (limit, 16)
                precise = KVEventsManager(KVEventsConfig(), scraper.datastore)
                precise.maintain()  # sizes the precise index from the scraped (capped) num_gpu_blocks
        assert sum("beyond the picker's limits" in r.getMessage() for r in caplog.records) == 1  # once
    # Filling both indexes with three times the cap keeps them at the cap.
    hashes = list(range(1, 3 * limit + 1))
    index.record(ep.key, hashes)
    precise.index.apply((ep.key, 0), Stored(hashes, None, list(range(16)) * len(hashes), 16))
    assert index.held_by(ep.key) == index.capacity(ep.key) == limit * 16 * 4 // 64
    assert precise.index.held(ep.key) == precise.index.capacity(ep.key) == limit


async def test_a_block_size_beyond_the_cap_makes_the_cache_config_unknown() -> None:
    index = PrefixIndex(CFG.prefix.lru_capacity_per_server)
    async with serving(page(exposition(1, 1, 0.1, block_size=10**9, num_gpu_blocks=10**6))) as (port, _), \
            scraping(CFG, port, index) as scraper:
        await until(lambda: scraped_ok(scraper))
        assert (metrics_of(scraper).num_gpu_blocks, metrics_of(scraper).block_size) == (0, 0)
        assert index.capacity(f"127.0.0.1:{port}") == CFG.prefix.lru_capacity_per_server  # untouched


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_limit_is_a_failed_scrape(declared: bool) -> None:
    body = exposition(3, 1, 0.2) + b"# padding\n" * 400_000  # ~4 MB, a valid page otherwise
    cfg = replace(CFG, metrics_source=MetricsSourceConfig(max_body_bytes=1024 * 1024))

    async def handle(request: web.Request) -> web.StreamResponse:
        if declared:
            return web.Response(body=body, content_type="text/plain")
        resp = web.StreamResponse()  # chunked: no content-length to refuse up front
        resp.content_type = "text/plain"
        await resp.prepare(request)
        for i in range(0, len(body), 64 * 1024):
            await resp.write(body[i:i + 64 * 1024])
        await resp.write_eof()
        return resp

    async with serving(handle) as (port, _), scraping(cfg, port) as scraper:
        await until(lambda: scraper.scrapes >= 2 and scraper.datastore.snapshot()[0].metrics is not None)
        assert not metrics_of(scraper).ok and metrics_of(scraper).waiting == 0


async def test_a_redirect_to_another_host_is_not_followed() -> None:
    async with serving(page(exposition(7, 1, 0.3))) as (other, other_hits):
        async def redirect(_: web.Request) -> web.Response:
            raise web.HTTPFound(f"http://127.0.0.1:{other}/metrics")

        async with serving(redirect) as (port, hits), scraping(CFG, port) as scraper:
            await until(lambda: len(hits) >= 3 and scraper.datastore.snapshot()[0].metrics is not None)
            assert not metrics_of(scraper).ok and metrics_of(scraper).waiting == 0
            assert other_hits == []  # the picker never read the other host
