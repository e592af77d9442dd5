"""Several pickers and several workers: hit rate, sync bandwidth, snapshot cost, workers' throughput.

    python -m bench.replicas                  # everything, ~25 min on 2 cores (writes bench/results/replicas.*)
    python -m bench.replicas --parts workers --reps 5   # rerun one part; the others' results are kept

Parts (every figure side by side in one run, `--reps` repetitions (3), configurations interleaved
within each repetition, so a busy machine hits them alike):
1. hit-rate: 4 simulated replicas (`bench.lib.routers.sim_replicas`, KV cache sized as in `bench.run`)
   behind n gateways, each a real Envoy asking its own picker (SGLang's multi-gateway setup):
   "1", "2/4/8 synced" (--sync-port/--peers, a full mesh) and "2/4/8 unsynced". The client
   spreads the requests over the gateways (turn k of session i to gateway (i + k) mod n,
   `bench.lib.client.run`), so each gateway sees every prefix and a conversation's turns change
   gateway. Workloads `shared-prefix` and `multi-turn` (`bench.lib.workloads`, --quick sizes,
   seeds = repetition), replayed `--time-scale` (3) times faster than real time. Hit rate =
   cached / prompt tokens reported by the engines, for the pool and per gateway (the lowest
   gateway's is reported). The same runs give the sync traffic: bytes the pickers sent to their
   peers per routed request, per link and per picker (all its links), times 1,000 (= bytes/s at
   1,000 req/s through the pool), and the pickers' CPU per routed request (synced against
   unsynced at the same n: the CPU sync costs).
2. snapshot: a full index (`--prefix-lru-capacity` default, 31,250 blocks per endpoint, for 4 and
   16 endpoints) sent by one PeerSync and loaded by another over loopback gRPC (warm start):
   bytes on the wire and seconds until loaded.
3. workers: one pod (`--workers N` for each of `--worker-counts`, 1 and 2 by default) behind
   Envoy (`--concurrency max(2, N/2)`, 100 streams per connection to the picker so connections
   spread over the workers), trivial echo backends (one process each), closed loop at concurrency
   32 per client process (`max(1, N/2)` of them, so the client is not what saturates) with 4 KB
   shared-prefix prompts: requests/s over the window from the first client's start to the last
   one's end. 1 and 2 workers fit a 2-core machine; 4 and 8 need a machine with more cores
   (bench/results/replicas-16cores.md ran on 16).

`--configs` runs a subset of the hit-rate configurations (by label); `--out` names the results
file, so a run on another machine keeps its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib import client, loadgen
from bench.lib.oracle import workload_oracle
from bench.lib.routers import sim_replicas
from bench.lib.runner import process_cpu_s, sim_settings
from bench.lib.stats import hit_rate
from bench.lib.workloads import build
from extproc.commands.envoy_config import build_config, render
from extproc.config.settings import EppConfig, SyncConfig
from extproc.core.datastore import Datastore
from extproc.discovery.static import load_static
from extproc.prefix.index import PrefixIndex
from extproc.scraping.prom_text import samples
from extproc.sync.manager import PeerSync
from extproc.sync.wire import LOAD, SNAPSHOT
from testkit.envoy import envoy_binary
from testkit.procs import free_ports, prefix_epp, python_module, running, wait_for_port

RESULTS = Path(__file__).parent / "results"
CONFIGS = (("1", 1, False), ("2 synced", 2, True), ("4 synced", 4, True), ("8 synced", 8, True),
           ("2 unsynced", 2, False), ("4 unsynced", 4, False), ("8 unsynced", 8, False))
WORKLOADS = ("shared-prefix", "multi-turn")
SECRET = "bench-peer-sync-secret-0123456789abcdef"


def metric(text: bytes, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples(text, name.encode()) if lab == labels)


@contextlib.contextmanager
def envoy(tmp: Path, name: str, epp_ports: Sequence[int], backends: Sequence[str], *,
          concurrency: int = 1, per_connection: int = 0) -> Iterator[str]:
    listen, admin = free_ports(2)
    cfg = build_config(listen, f"127.0.0.1:{epp_ports[0]}", admin, epp_tls=False, endpoints=tuple(backends))
    epp = cfg["static_resources"]["clusters"][0]
    epp["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in epp_ports]
    epp["health_checks"][0].update(interval="0.5s", no_traffic_interval="0.5s", timeout="0.5s")
    if per_connection:
        opts = epp["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        opts["common_http_protocol_options"] = {"max_requests_per_connection": per_connection}
    path = tmp / f"{name}.yaml"
    path.write_text(render(cfg))
    args = [envoy_binary(), "-c", str(path), "--concurrency", str(concurrency), "--log-level", "error",
            "--base-id", str(listen)]
    with running(args, tmp / f"{name}.log", wait_port=listen):
        yield f"http://127.0.0.1:{listen}"


@contextlib.contextmanager
def pickers(tmp: Path, backends: Sequence[str], n: int, sync: bool, extra: Sequence[str] = ()) -> Iterator[
        list[tuple[int, int, int]]]:
    """n picker processes; yields [(grpc port, metrics port, pid)] once all listen."""
    secret = tmp / "secret"
    secret.write_text(SECRET)
    ports = [free_ports(4) for _ in range(n)]
    peers = ",".join(f"127.0.0.1:{p[3]}" for p in ports)
    with contextlib.ExitStack() as stack:
        pids = []
        for i, (grpc_port, health, metrics, sync_port) in enumerate(ports):
            args = prefix_epp("serve", "--endpoints", ",".join(backends), "--secure-serving=false",
                              "--grpc-port", str(grpc_port), "--grpc-health-port", str(health),
                              "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", "--log-level",
                              "warning", "--sync-warm-timeout", "1s", *extra)
            if sync:
                args += ["--sync-port", str(sync_port), "--peers", peers, "--sync-secret-file", str(secret)]
            pids.append(stack.enter_context(running(args, tmp / f"picker-{i}.log", wait_port=grpc_port)).popen.pid)
        for _, _, metrics, _ in ports:
            wait_for_port(metrics)
        yield [(p[0], p[2], pid) for p, pid in zip(ports, pids, strict=True)]


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        data: bytes = r.read()
        return data


def wait_peers(metrics_ports: Sequence[int], n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for port in metrics_ports:
        while metric(scrape(port), "prefix_epp_sync_peers_connected") < n:
            if time.monotonic() > deadline:
                raise RuntimeError("pickers did not connect to their peers")
            time.sleep(0.1)


def hit_rate_run(tmp: Path, workload_name: str, seed: int, label: str, n: int, sync: bool,
                 time_scale: float) -> dict[str, Any]:
    workload = build(workload_name, quick=True, seed=seed)
    sim = sim_settings(workload_oracle(workload), 4, time_scale, workload)
    tmp.mkdir(parents=True, exist_ok=True)
    with sim_replicas(tmp, sim) as pool, pickers(tmp, pool.addresses, n, sync) as procs, \
            contextlib.ExitStack() as gateways:
        urls = [gateways.enter_context(envoy(tmp, f"envoy-{i}", [port], pool.addresses))
                for i, (port, _, _) in enumerate(procs)]
        for url in urls:
            asyncio.run(client.probe(url))
        if sync:
            wait_peers([m for _, m, _ in procs], n - 1)
        texts = [scrape(m) for _, m, _ in procs]
        before = [metric(t, "prefix_epp_sync_bytes_sent_total") for t in texts]
        cpu0 = process_cpu_s([pid for _, _, pid in procs])
        result = asyncio.run(client.run(urls, workload, time_scale))
        cpu = process_cpu_s([pid for _, _, pid in procs]) - cpu0
        texts = [scrape(m) for _, m, _ in procs]
    sent = sum(metric(t, "prefix_epp_sync_bytes_sent_total") for t in texts) - sum(before)
    requests = len(result.requests)
    links = max(1, n - 1)
    per_gateway = [hit_rate([r for r in result.requests if r.gateway == g]) for g in range(n)]
    return {"config": label, "pickers": n, "sync": sync, "workload": workload_name, "seed": seed,
            "requests": requests, "errors": sum(1 for r in result.requests if not r.ok),
            "hit_rate": round(hit_rate(result.requests), 4),
            "hit_rate_per_gateway": [round(h, 4) for h in per_gateway],
            "picker_cpu_ms_per_request": round(1000 * cpu / max(1, requests), 3),
            "sync_bytes_per_request_per_link": round(sent / n / links / max(1, requests), 1),
            "sync_bytes_per_request_per_picker": round(sent / n / max(1, requests), 1),
            "dropped": sum(metric(t, "prefix_epp_sync_dropped_records_total", reason=r)
                           for t in texts for r in ("outbox_full", "peer_queue_full"))}


async def snapshot_run(endpoints: int, capacity: int) -> dict[str, Any]:
    cfg = replace(SyncConfig(), warm_timeout_s=120.0)
    pa, pb = free_ports(2)
    rng = random.Random(endpoints)
    src = PrefixIndex(capacity)
    for e in range(endpoints):
        src.load(f"10.0.0.{e}:8000", [rng.getrandbits(64) for _ in range(capacity)])
    pool = [f"10.0.0.{e}:8000" for e in range(endpoints)]
    stores = [Datastore(), Datastore()]
    for store in stores:
        load_static(store, pool)  # a peer's records are kept for endpoints of our own pool only
    a = PeerSync(replace(cfg, port=pa), SECRET.encode(), src, None, datastore=stores[0], bind="127.0.0.1")
    b = PeerSync(replace(cfg, port=pb, peers=(f"127.0.0.1:{pa}",)), SECRET.encode(), PrefixIndex(capacity), None,
                 datastore=stores[1], bind="127.0.0.1")
    wire = 0
    chunk: list[tuple[int, str, Sequence[int]]] = []
    for endpoint, hashes in src.dump():  # the frames the service sends, for their size
        for start in range(0, len(hashes), cfg.snapshot_chunk_hashes):
            chunk = [(LOAD, endpoint, hashes[start:start + cfg.snapshot_chunk_hashes])]
            wire += len(a.codec.encode(SNAPSHOT, a.origin, chunk))
    await a.start()
    await b.start()
    try:
        t0 = time.perf_counter()
        loaded = await b.warm_start()
        seconds = time.perf_counter() - t0
    finally:
        await b.stop()
        await a.stop()
    assert loaded == src.entries == b.index.entries, (loaded, src.entries, b.index.entries)
    return {"endpoints": endpoints, "entries": loaded, "bytes": wire, "seconds": round(seconds, 3)}


PROMPTS = [json.dumps({"model": "m", "prompt": "You are the support desk of a large company. " * 80
                      + f"question {i}", "max_tokens": 4}).encode() for i in range(64)]


async def ready(url: str) -> None:
    """Until the pod answers 200 behind Envoy (its workers have synced and Envoy sees it healthy)."""
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.post(url, data=PROMPTS[0], headers={"content-type": "application/json"}) as r:
                    await r.read()
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never answered 200")


def client_process(url: str, concurrency: int, total: int, start_at: float) -> tuple[float, float, int, int]:
    """One client process: a closed loop of `total` requests from `start_at` (wall clock).

    Returns (start, end, answered 200, failed)."""
    tally = loadgen.Tally()

    async def go() -> tuple[float, float]:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.time()
        await loadgen.closed_loop(url, PROMPTS, concurrency, total, tally, warm_up=concurrency)
        return t0, time.time()

    t0, t1 = asyncio.run(go())
    return t0, t1, len(tally.latencies), tally.failed


def workers_run(tmp: Path, workers: int, total: int) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    ports = free_ports(4)
    clients = max(1, workers // 2)
    with contextlib.ExitStack() as stack:
        for i, port in enumerate(ports):  # one process each: one would saturate before 8 workers do
            stack.enter_context(running(python_module("testkit.echo_backends", str(port), "--trivial"),
                                        tmp / f"backend-{i}.log", wait_port=port))
        backends = [f"127.0.0.1:{p}" for p in ports]
        procs = stack.enter_context(pickers(tmp, backends, 1, False, ("--workers", str(workers))))
        url = stack.enter_context(envoy(tmp, "envoy", [procs[0][0]], backends, concurrency=max(2, workers // 2),
                                        per_connection=100)) + "/v1/completions"
        asyncio.run(ready(url))
        with multiprocessing.get_context("spawn").Pool(clients) as pool:
            pool.map(time.sleep, [0.0] * clients)  # every client process up before the clock starts
            start_at = time.time() + 0.5
            parts = pool.starmap(client_process, [(url, 32, total // clients, start_at)] * clients)
    answered, failed = sum(p[2] for p in parts), sum(p[3] for p in parts)
    if failed:
        raise RuntimeError(f"--workers {workers}: {failed} requests failed")
    window = max(p[1] for p in parts) - min(p[0] for p in parts)
    return {"workers": workers, "clients": clients, "requests": answered, "rps": round(answered / window, 1)}


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def _of(rows: Sequence[dict[str, Any]], workload: str, config: str, key: str) -> list[float]:
    return [r[key] for r in rows if r["workload"] == workload and r["config"] == config]


def summarize(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if raw.get("hit_rate"):
        rows = raw["hit_rate"]
        for r in rows:
            r.setdefault("hit_rate_min_gateway", min(r.get("hit_rate_per_gateway") or [r["hit_rate"]]))
        labels = [c for c, _, _ in CONFIGS if any(r["config"] == c for r in rows)]
        out["configs"] = labels
        for key in ("hit_rate", "hit_rate_min_gateway", "picker_cpu_ms_per_request",
                    "sync_bytes_per_request_per_link", "sync_bytes_per_request_per_picker"):
            out[key] = {w: {c: spread(_of(rows, w, c, key)) for c in labels if _of(rows, w, c, key)}
                        for w in WORKLOADS}
    if raw.get("workers"):
        counts = sorted({r["workers"] for r in raw["workers"]})
        out["workers_rps"] = {str(n): spread([r["rps"] for r in raw["workers"] if r["workers"] == n]) for n in counts}
    if raw.get("snapshot"):
        out["snapshot"] = raw["snapshot"]
    return out


def _cell(x: dict[str, float], fmt: str = ".3f", scale: float = 1.0) -> str:
    return f"{x['median'] * scale:{fmt}} ({x['min'] * scale:{fmt}}-{x['max'] * scale:{fmt}})"


def table(summary: dict[str, Any]) -> str:
    lines = []
    if "hit_rate" in summary:
        kib = 1000 / 1024  # bytes per request -> KiB/s at 1,000 req/s
        lines += ["Hit rate (cached / prompt tokens, median and min-max of the repetitions): the pool, and the "
                  "lowest of its gateways; sync KiB/s at 1,000 req/s through the pool; pickers' CPU per request.",
                  "", "| pickers | workload | pool hit rate | lowest gateway | sync per link KiB/s "
                  "| sync sent per picker KiB/s | picker CPU ms/request |", "|---|---|---:|---:|---:|---:|---:|"]
        for w in WORKLOADS:
            for c in (c for c in summary["configs"] if c in summary["hit_rate"][w]):
                synced = "unsynced" not in c and c != "1"
                link = _cell(summary["sync_bytes_per_request_per_link"][w][c], ".0f", kib) if synced else "-"
                per = _cell(summary["sync_bytes_per_request_per_picker"][w][c], ".0f", kib) if synced else "-"
                lines.append(f"| {c} | {w} | {_cell(summary['hit_rate'][w][c])} | "
                             f"{_cell(summary['hit_rate_min_gateway'][w][c])} | {link} | {per} | "
                             f"{_cell(summary['picker_cpu_ms_per_request'][w][c], '.2f')} |")
    if "snapshot" in summary:
        lines += ["", "| snapshot: endpoints | entries | bytes | seconds |", "|---:|---:|---:|---:|"]
        lines += [f"| {s['endpoints']} | {s['entries']} | {s['bytes']} | {s['seconds']} |" for s in summary["snapshot"]]
    if "workers_rps" in summary:
        lines += ["", "| --workers | req/s (median, min-max) |", "|---:|---:|"]
        for n, x in summary["workers_rps"].items():
            lines.append(f"| {n} | {x['median']:.0f} ({x['min']:.0f}-{x['max']:.0f}) |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas")
    p.add_argument("--parts", nargs="+", default=["hit-rate", "snapshot", "workers"],
                   choices=["hit-rate", "snapshot", "workers"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seeds", nargs="+", type=int, help="the repetitions' seeds (default 0 .. reps-1)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--time-scale", type=float, default=3.0)
    p.add_argument("--worker-requests", type=int, default=3000)
    p.add_argument("--worker-counts", nargs="+", type=int, default=[1, 2])
    p.add_argument("--configs", nargs="+", default=[c for c, _, _ in CONFIGS], choices=[c for c, _, _ in CONFIGS])
    p.add_argument("--out", default=str(RESULTS / "replicas"))
    a = p.parse_args(argv)
    raw: dict[str, list[dict[str, Any]]] = {"hit_rate": [], "snapshot": [], "workers": []}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp_s:
        tmp = Path(tmp_s)
        for rep in a.seeds if a.seeds is not None else range(a.reps):
            if "hit-rate" in a.parts:
                for w in a.workloads:
                    for label, n, sync in (c for c in CONFIGS if c[0] in a.configs):
                        row = hit_rate_run(tmp / f"{rep}-{w}-{n}-{sync}", w, rep, label, n, sync, a.time_scale)
                        print(json.dumps(row), flush=True)
                        raw["hit_rate"].append(row)
            if "workers" in a.parts:
                for n in a.worker_counts:
                    row = workers_run(tmp / f"{rep}-workers-{n}", n, a.worker_requests)
                    print(json.dumps(row), flush=True)
                    raw["workers"].append(row)
        if "snapshot" in a.parts:
            cap = EppConfig().prefix.lru_capacity_per_server
            for endpoints in (4, 16):
                row = asyncio.run(snapshot_run(endpoints, cap))
                print(json.dumps(row), flush=True)
                raw["snapshot"].append(row)
    out = Path(a.out)
    settings = {"reps": a.reps, "time_scale": a.time_scale, "worker_requests": a.worker_requests,
                "cores": os.cpu_count(),
                "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}  # >2 on 2 cores: a busy machine
    config = {part: settings for part in a.parts}
    if out.with_suffix(".json").exists():  # parts not run this time keep their earlier results
        earlier = json.loads(out.with_suffix(".json").read_text())
        for part, key in (("hit-rate", "hit_rate"), ("snapshot", "snapshot"), ("workers", "workers")):
            if part not in a.parts:
                raw[key] = earlier["runs"].get(key, [])
                if part in earlier.get("config", {}):
                    config[part] = earlier["config"][part]
    summary = summarize(raw)
    out.with_suffix(".json").write_text(json.dumps({"config": config, "summary": summary, "runs": raw}, indent=1)
                                        + "\n")
    out.with_suffix(".md").write_text(table(summary))
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())


