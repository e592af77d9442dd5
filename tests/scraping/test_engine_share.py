"""The engine-share floor over real HTTP (extproc/scraping/plan.py): a model server whose page
takes longer to answer is scraped less often, in proportion, and the scrape says at what interval;
the process divides the share among the pickers and workers that scrape the same engines."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from prometheus_client import generate_latest

from extproc.config.settings import EppConfig, SyncConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.runtime.app import App
from extproc.scraping.scraper import MetricsScraper
from extproc.telemetry.epp import EppMetrics
from testkit.procs import free_ports, until
from testkit.vllm_stubs import FakeEngine

SHARE = 0.05  # a 10 ms page: at least 200 ms apart


async def test_a_page_that_takes_longer_is_scraped_less_often(engines: dict[int, FakeEngine]) -> None:
    """Of two model servers, `slow` answers 10 ms after each request, `fast` at once."""
    slow, fast = list(engines)[:2]
    engines[slow].delay = 0.010
    counts = {port: 0 for port in (slow, fast)}

    def count() -> None:
        for port in counts:
            counts[port] = engines[port].hits

    ds = Datastore()
    ds.set_endpoints([EndpointSpec("127.0.0.1", slow), EndpointSpec("127.0.0.1", fast)])
    scraper = MetricsScraper(replace(EppConfig(), scrape_engine_share=SHARE), ds)
    task = asyncio.create_task(scraper.run())
    try:
        await until(lambda: all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot()), timeout=30)
        await until(lambda: engines[slow].hits >= 3, timeout=30)
        count()
        before = dict(counts)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await until(lambda: engines[slow].hits >= before[slow] + 5, timeout=30)
        elapsed = loop.time() - t0
        count()
        slow_m = ds.get(f"127.0.0.1:{slow}").metrics  # type: ignore[union-attr]
        fast_m = ds.get(f"127.0.0.1:{fast}").metrics  # type: ignore[union-attr]
        text = generate_latest(EppMetrics(ds, None, "pool-x").registry).decode()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # Each slow GET takes >= 10 ms, so its floor is >= 200 ms: 5 more scrapes took >= 4 intervals.
    assert elapsed >= 4 * 0.010 / SHARE * 0.95
    assert slow_m is not None and slow_m.interval_s >= 0.010 / SHARE
    assert fast_m is not None and fast_m.interval_s < slow_m.interval_s
    assert counts[fast] - before[fast] > counts[slow] - before[slow]
    assert slow_m is not None and (f'prefix_epp_endpoint_scrape_interval_seconds{{endpoint="127.0.0.1:{slow}"}} '
                                   f'{slow_m.interval_s}') in text


async def test_the_process_shares_the_floor_among_pods_and_workers(tmp_path: Path) -> None:
    """With peer sync on, the scrapers are (this pod + the peers it is connected to) x its workers:
    two synced pickers each count two."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    ports = [free_ports(4) for _ in range(2)]
    apps = []
    for i, (grpc, health, metrics, sync) in enumerate(ports):
        peer = ports[1 - i][3]
        cfg = replace(EppConfig(), grpc_port=grpc, grpc_health_port=health, metrics_port=metrics,
                      bind_address="127.0.0.1", secure_serving=False, endpoints=("127.0.0.1:1",),
                      sync=replace(SyncConfig(), port=sync, peers=(f"127.0.0.1:{peer}",), secret_file=str(secret),
                                   warm_timeout_s=0.0))
        apps.append(App(cfg))
    assert App(replace(cfg, sync=SyncConfig())).scraper.scrapers is None  # type: ignore[union-attr]
    counts = [app.scraper.scrapers for app in apps if app.scraper is not None]
    assert len(counts) == 2 and all(c is not None for c in counts)
    for app in apps:
        await app.start()
    try:
        await until(lambda: all(c() == 2 for c in counts if c is not None), timeout=30)
    finally:
        for app in apps:
            await app.stop(grace=0)
