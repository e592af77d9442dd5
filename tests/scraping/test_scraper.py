"""The background scraper against real HTTP model servers, and the pool gauges it feeds."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from extproc.config.settings import EppConfig, PrefixConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.prefix.index import PrefixIndex
from extproc.scraping.scraper import MetricsScraper
from extproc.telemetry.epp import EppMetrics
from testkit.procs import free_port, free_ports, python_module, running, wait_for_port
from testkit.vllm_stubs import FakeEngine
from testkit.vllm_text import exposition


def specs(ports: list[int]) -> list[EndpointSpec]:
    return [EndpointSpec("127.0.0.1", p, name=f"pod{i}-rank-0") for i, p in enumerate(ports)]


async def wait_for(cond: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("condition not met")


CFG = replace(EppConfig(), refresh_metrics_interval_s=0.05, scrape_timeout_s=0.3, scrape_engine_share=0.0)


async def test_scrapes_update_the_datastore_and_tune_the_index(engines: dict[int, FakeEngine]) -> None:
    ports = list(engines)
    engines[ports[0]].body = exposition(4, 2, 0.5, num_gpu_blocks=2000)
    ds, index = Datastore(), PrefixIndex(31250)
    ds.set_endpoints(specs(ports))
    scraper = MetricsScraper(CFG, ds, index)
    task = asyncio.create_task(scraper.run())
    try:
        ep = ds.get(f"127.0.0.1:{ports[0]}")
        assert ep is not None
        await wait_for(lambda: ep.metrics is not None and ep.metrics.ok)
        assert ep.metrics is not None
        assert (ep.metrics.waiting, ep.metrics.running, ep.metrics.kv_usage) == (4, 2, 0.5)
        assert time.monotonic() - ep.metrics.updated_at < 5.0  # a recent scrape (the loop may lag)
        assert index.capacity(ep.key) == 2000 * 16 * 4 // 64  # auto-tuned
        engines[ports[0]].body = exposition(9, 1, 0.9, num_gpu_blocks=500)
        await wait_for(lambda: ep.metrics is not None and ep.metrics.waiting == 9)
        assert index.capacity(ep.key) == 500
        # The interval holds: 6 more scrapes of one endpoint take at least 5 intervals (a loaded
        # machine may take longer, never shorter).
        before = engines[ports[1]].hits
        start = time.monotonic()
        await wait_for(lambda: engines[ports[1]].hits >= before + 6)
        assert time.monotonic() - start >= 5 * CFG.refresh_metrics_interval_s * 0.9
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_auto_tune_can_be_switched_off(engines: dict[int, FakeEngine]) -> None:
    port = next(iter(engines))
    engines[port].body = exposition(1, 1, 0.1, num_gpu_blocks=100)
    ds, index = Datastore(), PrefixIndex(777)
    ds.set_endpoints(specs([port]))
    cfg = replace(CFG, prefix=PrefixConfig(auto_tune=False))
    task = asyncio.create_task(MetricsScraper(cfg, ds, index).run())
    try:
        ep = ds.snapshot()[0]
        await wait_for(lambda: ep.metrics is not None and ep.metrics.ok)
        assert index.capacity(ep.key) == 777
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_scrape_is_stamped_when_it_was_asked_for_not_when_its_answer_came(
        engines: dict[int, FakeEngine]) -> None:
    """The page is rendered when the GET arrives and answered 150 ms later (a busy engine): the
    sample describes the engine no later than that arrival, so requests routed while the answer
    travelled must not read as routed before it (the first-token bound would call them late)."""
    port = next(iter(engines))
    engines[port].delay = 0.15
    ds = Datastore()
    ds.set_endpoints(specs([port]))
    cfg = replace(CFG, refresh_metrics_interval_s=30.0, scrape_timeout_s=5.0)  # one scrape in the test
    task = asyncio.create_task(MetricsScraper(cfg, ds, PrefixIndex(100)).run())
    try:
        ep = ds.snapshot()[0]
        await wait_for(lambda: ep.metrics is not None and ep.metrics.ok)
        assert ep.metrics is not None and len(engines[port].arrivals) == 1
        assert ep.metrics.updated_at <= engines[port].arrivals[0]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("fault", ["http500", "no_vllm_metrics", "timeout", "refused"])
async def test_a_failing_endpoint_keeps_its_values_but_is_marked_failed(
        engines: dict[int, FakeEngine], fault: str) -> None:
    port = next(iter(engines))
    engine = engines[port]
    engine.body = exposition(3, 1, 0.4)
    ds = Datastore()
    ds.set_endpoints(specs([port]))
    task = asyncio.create_task(MetricsScraper(CFG, ds).run())
    try:
        ep = ds.snapshot()[0]
        await wait_for(lambda: ep.metrics is not None and ep.metrics.ok)
        assert ep.metrics is not None
        good_at = ep.metrics.updated_at
        if fault == "http500":
            engine.status = 500
        elif fault == "no_vllm_metrics":
            engine.body = b'{"served_by": "an echo server"}'
        elif fault == "timeout":
            engine.delay = 1.0
        else:
            ds.remove(ep.key)
            dead = free_port()
            ds.set_endpoints(specs([dead]))
            ep = ds.snapshot()[0]
        await wait_for(lambda: ep.metrics is not None and not ep.metrics.ok)
        assert ep.metrics is not None
        if fault != "refused":
            assert (ep.metrics.waiting, ep.metrics.kv_usage) == (3, 0.4)  # last values kept...
            assert ep.metrics.updated_at <= good_at + 0.2  # ...with the time of the last success
            engine.status, engine.body, engine.delay = 200, exposition(5, 0, 0.1), 0.0
            await wait_for(lambda: ep.metrics is not None and ep.metrics.ok and ep.metrics.waiting == 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_removed_endpoints_are_no_longer_scraped_and_new_ones_are(engines: dict[int, FakeEngine]) -> None:
    a, b, c = list(engines)
    ds = Datastore()
    ds.set_endpoints(specs([a, b]))
    task = asyncio.create_task(MetricsScraper(CFG, ds).run())
    try:
        await wait_for(lambda: engines[a].hits > 2 and engines[b].hits > 2)
        ds.remove(f"127.0.0.1:{a}")
        ds.upsert(EndpointSpec("127.0.0.1", c))
        await wait_for(lambda: engines[c].hits > 3)  # a scrape of `a` already in flight has landed by now
        hits_a, hits_c = engines[a].hits, engines[c].hits
        await wait_for(lambda: engines[c].hits > hits_c + 3)
        assert engines[a].hits == hits_a
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    hits = [e.hits for e in engines.values()]
    await asyncio.sleep(0.15)  # three intervals: a scraper still running would have scraped again
    assert [e.hits for e in engines.values()] == hits  # cancelled: nothing scrapes any more


async def test_pool_gauges_average_fresh_endpoints_and_flag_stale_ones(engines: dict[int, FakeEngine]) -> None:
    a, b, c = list(engines)
    engines[a].body = exposition(1, 2, 0.2)
    engines[b].body = exposition(3, 4, 0.6)
    engines[c].status = 503
    ds = Datastore()
    ds.set_endpoints(specs([a, b, c]))
    metrics = EppMetrics(ds, None, "pool-x", metrics_staleness_s=2.0)
    task = asyncio.create_task(MetricsScraper(CFG, ds).run())
    try:
        await wait_for(lambda: all(ep.metrics is not None for ep in ds.snapshot()))
        await asyncio.sleep(0.1)
        text = generate_latest(metrics.registry).decode()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert 'inference_pool_average_kv_cache_utilization{name="pool-x"} 0.4' in text
    assert 'inference_pool_average_queue_size{name="pool-x"} 2.0' in text
    assert 'inference_pool_average_running_requests{name="pool-x"} 3.0' in text
    assert 'inference_pool_per_pod_queue_size{model_server_pod="pod1-rank-0",name="pool-x"} 3.0' in text
    assert "pod2-rank-0" not in text  # never scraped successfully: no per-pod queue
    assert f'prefix_epp_endpoint_metrics_stale{{endpoint="127.0.0.1:{c}"}} 1.0' in text
    assert f'prefix_epp_endpoint_metrics_stale{{endpoint="127.0.0.1:{a}"}} 0.0' in text


async def test_scraping_8_endpoints_at_the_default_interval(tmp_path: Path) -> None:
    """Model servers in another process: every endpoint is scraped, never faster than the interval.
    (How much CPU it costs is a benchmark figure, not a test: a loaded machine must not fail it.)"""
    ports = free_ports(8)
    with running(python_module("testkit.vllm_stubs", *map(str, ports)), tmp_path / "ms.log",
                 wait_port=ports[-1]):
        for p in ports:
            wait_for_port(p)
        ds = Datastore()
        ds.set_endpoints(specs(ports))
        cfg = EppConfig()
        scraper = MetricsScraper(cfg, ds)
        task = asyncio.create_task(scraper.run())
        try:
            await wait_for(lambda: all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot()))
            wall0, n0 = time.monotonic(), scraper.scrapes
            await wait_for(lambda: scraper.scrapes >= n0 + 8 * 10)
            wall, n = time.monotonic() - wall0, scraper.scrapes - n0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot())
    assert n / wall <= 8 / cfg.refresh_metrics_interval_s * 1.2  # the interval is kept
