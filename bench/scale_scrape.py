"""Scraping as the pool grows: the fixed-interval design against the budgeted, filtered one.

For each pool size (4, 16, 64, 256 endpoints), `MetricsScraper` scrapes that many model-server
stubs (testkit/vllm_stubs.py in another process: vLLM's ~125 KB page, and only the samples asked
for when the URL carries `?name[]=`, as prometheus_client answers) for `seconds`, in two designs:
- `fixed`: every endpoint every 50 ms, whole page (`--scrape-budget 0`, `--scrape-engine-share 0`,
  `filter_families` off): the design before the scrape plan (which also had aiohttp's client,
  dearer per GET: `client_costs`);
- `budgeted`: the defaults (`--scrape-budget` 500/s shared by the pool, only the families read, and
  the engine-share floor; bench/results/scale.md's rows predate the floor).
Figures: this process's CPU over the wall time (the share of one core scraping takes: HTTP client,
reading, parsing, the datastore update), scrapes per second kept against planned, CPU per scrape,
and freshness: the age of each endpoint's last successful scrape, sampled every 20 ms over the
run (mean and p99 over endpoints and samples).

`client_costs`: CPU per GET of the filtered page (~1.5 KB), one after another over kept-alive
connections to 4 stubs: aiohttp's client session against extproc/scraping/http.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib.stats import percentile
from extproc.config.settings import EppConfig, MetricsSourceConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.scraping.http import MetricsHttp
from extproc.scraping.scraper import MetricsScraper, family_query
from testkit.procs import free_ports, python_module, running, wait_for_port

DESIGNS: dict[str, EppConfig] = {
    "fixed": replace(EppConfig(), scrape_budget_per_s=0.0, scrape_engine_share=0.0,
                     metrics_source=MetricsSourceConfig(filter_families=False)),
    "budgeted": EppConfig(),
}


async def _scrape(cfg: EppConfig, ports: Sequence[int], seconds: float) -> dict[str, Any]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("127.0.0.1", p) for p in ports])
    scraper = MetricsScraper(cfg, ds)
    task = asyncio.create_task(scraper.run())
    try:
        deadline = time.monotonic() + 60
        while not all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot()):
            if time.monotonic() > deadline:
                raise TimeoutError("not every endpoint was scraped within 60 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # past the first round
        ages: list[float] = []
        cpu0, wall0, n0 = time.process_time(), time.monotonic(), scraper.scrapes
        end = wall0 + seconds
        while time.monotonic() < end:
            now = time.monotonic()
            ages.extend(now - ep.metrics.updated_at for ep in ds.snapshot() if ep.metrics is not None)
            await asyncio.sleep(0.02)
        cpu, wall, n = time.process_time() - cpu0, time.monotonic() - wall0, scraper.scrapes - n0
        interval = scraper.interval_s
        ok = sum(1 for ep in ds.snapshot() if ep.metrics is not None and ep.metrics.ok)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return {"interval_ms": interval * 1000, "planned_per_s": len(ports) / interval,
            "scrapes_per_s": n / wall, "core_share": cpu / wall, "cpu_ms_per_scrape": cpu / max(n, 1) * 1000,
            "age_mean_ms": sum(ages) / len(ages) * 1000, "age_p99_ms": percentile(ages, 99) * 1000,
            "ok_endpoints": ok}


def scrape_costs(sizes: Sequence[int], seconds: float, log_dir: Path) -> list[dict[str, Any]]:
    """Every design at every size, side by side against one stub process serving the largest pool."""
    ports = free_ports(max(sizes))
    rows: list[dict[str, Any]] = []
    with running(python_module("testkit.vllm_stubs", *map(str, ports)), log_dir / "stubs.log",
                 wait_port=ports[-1]):
        for p in ports:
            wait_for_port(p)
        for n in sizes:
            for design, cfg in DESIGNS.items():
                row = {"endpoints": n, "design": design, **asyncio.run(_scrape(cfg, ports[:n], seconds))}
                print(f"scrape {design} {n}: {row['core_share']:.3f} core, {row['scrapes_per_s']:.0f}/s "
                      f"(planned {row['planned_per_s']:.0f}), age mean {row['age_mean_ms']:.0f} ms", flush=True)
                rows.append(row)
    return rows


async def _clients(ports: Sequence[int], n: int) -> dict[str, float]:
    target = "/metrics" + family_query()
    out: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                                     timeout=aiohttp.ClientTimeout(total=1.0),
                                     headers={"Accept-Encoding": "identity"}) as session:
        for i in range(20):
            async with session.get(f"http://127.0.0.1:{ports[i % len(ports)]}{target}") as resp:
                await resp.read()
        cpu0 = time.process_time()
        for i in range(n):
            async with session.get(f"http://127.0.0.1:{ports[i % len(ports)]}{target}",
                                   allow_redirects=False) as resp:
                await resp.read()
        out["aiohttp_us_per_get"] = (time.process_time() - cpu0) / n * 1e6
    http = MetricsHttp("http", True, 1.0, 1 << 22)
    try:
        for i in range(20):
            p = ports[i % len(ports)]
            await http.get(str(p), "127.0.0.1", p, f"127.0.0.1:{p}", target)
        cpu0 = time.process_time()
        for i in range(n):
            p = ports[i % len(ports)]
            await http.get(str(p), "127.0.0.1", p, f"127.0.0.1:{p}", target)
        out["narrow_us_per_get"] = (time.process_time() - cpu0) / n * 1e6
    finally:
        await http.close()
    return out


def client_costs(log_dir: Path, n: int = 3000) -> dict[str, Any]:
    ports = free_ports(4)
    with running(python_module("testkit.vllm_stubs", *map(str, ports)), log_dir / "clients.log",
                 wait_port=ports[-1]):
        for p in ports:
            wait_for_port(p)
        row: dict[str, Any] = {"endpoints": 4, "design": "client", **asyncio.run(_clients(ports, n))}
    print(f"clients: aiohttp {row['aiohttp_us_per_get']:.0f} us, narrow {row['narrow_us_per_get']:.0f} us per GET",
          flush=True)
    return row
