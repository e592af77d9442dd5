"""What the picker's parts off the request path cost (`python -m bench.components`, ~1 min).

Side by side in one run, `--reps` repetitions (3; mean and min-max are reported):
1. parse: one vLLM /metrics page (testkit/vllm_text.py: real Prometheus text under vLLM's
   names, with vLLM's latency histograms per engine, ~125 KB) read by the picker's line reader
   (`extproc.scraping.scraper.parse_vllm_metrics`) and by prometheus_client's parser
   (`text_string_to_metric_families`, the reference): the median of `--parses` reads each.
2. scraper: `MetricsScraper` polling `--endpoints` (8) model-server stubs
   (testkit/vllm_stubs.py, in another process, serving that page) every
   `--refresh-metrics-interval` (the default, 50 ms) for `--seconds` (10): this process's CPU
   time over the wall time, i.e. the share of one core the scraping takes (HTTP client, reading,
   parsing, the datastore update), and the scrapes per second it kept.
3. kv-events: 500 vLLM-like KV-event batches (a 64-block prompt stored per batch, msgpack as
   `prefix_epp_sim.kv_publisher` publishes it) decoded (`extproc.kvevents.wire`) and applied to a
   `PreciseIndex` holding 8,192 blocks for the endpoint, so every batch also evicts: stored
   blocks per second.
4. tokenizer: `extproc.tokenization.builtin.encode` on 32 KB of English prose (what `--kv-events` does to
   every prompt on the request path): the median ms of `--parses` / 20 calls.

Writes bench/results/components.json and components.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from extproc.config.settings import EppConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.kvevents.index import PreciseIndex
from extproc.kvevents.wire import decode_batch
from extproc.scraping.scraper import MetricsScraper, parse_vllm_metrics
from extproc.tokenization.builtin import encode
from testkit.kvevents import kv_event_batches
from testkit.procs import free_ports, python_module, running, wait_for_port
from testkit.vllm_text import exposition


def parse_ms(parses: int) -> dict[str, float]:
    """Median ms per page read: the picker's reader and prometheus_client's parser."""
    page = exposition(3, 2, 0.25, loras=[("a", "", 4, 1.0)])
    ours, theirs = [], []
    for _ in range(parses):
        t0 = time.perf_counter()
        parse_vllm_metrics(page, 0.0)
        ours.append(time.perf_counter() - t0)
    for _ in range(max(3, parses // 20)):  # ~100x slower: fewer reads give as steady a median
        t0 = time.perf_counter()
        list(text_string_to_metric_families(page.decode()))
        theirs.append(time.perf_counter() - t0)
    return {"page_kb": round(len(page) / 1000, 1), "reader_ms": round(statistics.median(ours) * 1000, 3),
            "prometheus_client_ms": round(statistics.median(theirs) * 1000, 2)}


async def _scrape(ports: Sequence[int], seconds: float) -> dict[str, float]:
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("127.0.0.1", p) for p in ports])
    cfg = EppConfig()
    scraper = MetricsScraper(cfg, ds)
    task = asyncio.create_task(scraper.run())
    try:
        while not all(ep.metrics is not None and ep.metrics.ok for ep in ds.snapshot()):
            await asyncio.sleep(0.05)
        cpu0, wall0, n0 = time.process_time(), time.monotonic(), scraper.scrapes
        await asyncio.sleep(seconds)
        cpu, wall, n = time.process_time() - cpu0, time.monotonic() - wall0, scraper.scrapes - n0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return {"interval_ms": cfg.refresh_metrics_interval_s * 1000, "scrapes_per_s": round(n / wall, 1),
            "core_share": round(cpu / wall, 4), "cpu_ms_per_scrape": round(cpu / n * 1000, 3)}


def scraper_cost(endpoints: int, seconds: float, log_dir: Path) -> dict[str, float]:
    ports = free_ports(endpoints)
    with running(python_module("testkit.vllm_stubs", *map(str, ports)), log_dir / "stubs.log",
                 wait_port=ports[-1]):
        for p in ports:
            wait_for_port(p)
        return asyncio.run(_scrape(ports, seconds))


def kv_event_rate(batches: int = 500, blocks: int = 64, block_size: int = 16) -> dict[str, float]:
    """Stored blocks per second, decoded and applied, on an index that evicts as it goes."""
    payloads = kv_event_batches(batches, blocks, block_size)
    idx = PreciseIndex(default_capacity=8192)
    t0 = time.perf_counter()
    for payload in payloads:
        for ev in decode_batch(payload).events:
            idx.apply(("10.0.0.9:8000", 0), ev)
    elapsed = time.perf_counter() - t0
    if idx.stored != batches * blocks:
        raise RuntimeError(f"the index stored {idx.stored} blocks, not {batches * blocks}")
    return {"blocks_per_s": round(batches * blocks / elapsed)}


PROSE = ("Routing quality can only be measured against model servers whose KV cache behaves like the real "
         "thing. A request that shares a long prefix with earlier ones should land where that prefix is "
         "cached, unless the queue there costs more than computing it again elsewhere. ")


def tokenizer_ms(calls: int) -> dict[str, float]:
    text = (PROSE * (32 * 1024 // len(PROSE) + 1))[:32 * 1024]
    encode(text)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        encode(text)
        times.append(time.perf_counter() - t0)
    return {"ms_per_32kb": round(statistics.median(times) * 1000, 2)}


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def render(doc: dict[str, Any]) -> str:
    p, s, k, t = doc["parse"], doc["scraper"], doc["kv_events"], doc["tokenizer"]
    n = doc["config"]["endpoints"]

    def row(name: str, d: dict[str, float], scale: float = 1.0, digits: int = 3) -> str:
        return (f"| {name} | {d['mean'] * scale:.{digits}f} | {d['min'] * scale:.{digits}f}-"
                f"{d['max'] * scale:.{digits}f} |")

    lines = [
        "# Component costs (`python -m bench.components`)",
        "",
        f"{doc['config']['reps']} repetitions; mean and min-max. Page: {p['page_kb']['mean']:.0f} KB of vLLM "
        "exposition (load gauges, cache config, LoRA info, latency histograms).",
        "",
        "| figure | mean | min-max |",
        "|---|---:|---:|",
        row("line reader, ms per page", p["reader_ms"]),
        row("prometheus_client parser, ms per page", p["prometheus_client_ms"], digits=1),
        row(f"scraper, {n} endpoints every {s['interval_ms']['mean']:.0f} ms: % of one core",
            s["core_share"], scale=100.0, digits=1),
        row("scraper: CPU ms per scrape", s["cpu_ms_per_scrape"]),
        row("scraper: scrapes per second", s["scrapes_per_s"], digits=1),
        row("KV events: stored blocks decoded and applied per second (thousands)", k["blocks_per_s"],
            scale=0.001, digits=0),
        row("tokenizer: ms per 32 KB of prose", t["ms_per_32kb"], digits=2),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parses", type=int, default=400)
    ap.add_argument("--endpoints", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    parses, scrapes, events, tokens = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="components-") as tmp:
        for k in range(args.reps):
            parses.append(parse_ms(args.parses))
            scrapes.append(scraper_cost(args.endpoints, args.seconds, Path(tmp)))
            events.append(kv_event_rate())
            tokens.append(tokenizer_ms(max(5, args.parses // 20)))
            print(f"repetition {k + 1}: {parses[-1]} {scrapes[-1]} {events[-1]} {tokens[-1]}", flush=True)
    doc: dict[str, Any] = {
        "config": {"reps": args.reps, "parses": args.parses, "endpoints": args.endpoints, "seconds": args.seconds},
        "parse": {k: _spread([p[k] for p in parses]) for k in parses[0]},
        "scraper": {k: _spread([s[k] for s in scrapes]) for k in scrapes[0]},
        "kv_events": {k: _spread([e[k] for e in events]) for k in events[0]},
        "tokenizer": {k: _spread([t[k] for t in tokens]) for k in tokens[0]},
        "repetitions": [{"parse": p, "scraper": s, "kv_events": e, "tokenizer": t}
                        for p, s, e, t in zip(parses, scrapes, events, tokens, strict=True)],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "components.json").write_text(json.dumps(doc, indent=2) + "\n")
    md = render(doc)
    (args.out_dir / "components.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
