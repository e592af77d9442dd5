"""Several pickers and several workers: hit rate, sync bandwidth, snapshot cost, workers' throughput.

    python -m bench.replicas                  # everything, ~10 min on 2 cores (writes bench/results/replicas.*)
    python -m bench.replicas --parts workers --reps 5   # rerun one part; the others' results are kept

Parts (every figure side by side in one run, `--reps` repetitions (3), configurations interleaved
within each repetition, so a busy machine hits them alike):
1. hit-rate: 4 simulated replicas (`bench.lib.routers.sim_replicas`, KV cache sized as in `bench.run`)
   behind real Envoy whose ext_proc cluster holds 1, 2 or 4 pickers (LEAST_REQUEST over the
   healthy ones): "1", "2 synced", "4 synced" (--sync-port/--peers) and "2 unsynced". Workloads
   `shared-prefix` and `multi-turn` (`bench.lib.workloads`, --quick sizes, seeds = repetition),
   replayed `--time-scale` (3) times faster than real time. Hit rate = cached / prompt tokens
   reported by the engines. The same runs give the sync bandwidth: bytes the pickers sent to
   their peers per routed request, times 1,000 (= bytes/s per peer link at 1,000 req/s).
2. snapshot: a full index (`--prefix-lru-capacity` default, 31,250 blocks per endpoint, for 4 and
   16 endpoints) sent by one PeerSync and loaded by another over loopback gRPC (warm start):
   bytes on the wire and seconds until loaded.
3. workers: one pod (`--workers 1` and `--workers 2`) behind Envoy (`--concurrency 2`, 100
   streams per connection to the picker so connections spread over the workers), trivial echo
   backends, closed loop at concurrency 32 with 4 KB shared-prefix prompts: requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
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

from bench.lib import client
from bench.lib.oracle import workload_oracle
from bench.lib.routers import sim_replicas
from bench.lib.runner import sim_settings
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
CONFIGS = (("1", 1, False), ("2 synced", 2, True), ("4 synced", 4, True), ("2 unsynced", 2, False))
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
        list[tuple[int, int]]]:
    """n picker processes; yields [(grpc port, metrics port)] once all listen."""
    secret = tmp / "secret"
    secret.write_text(SECRET)
    ports = [free_ports(4) for _ in range(n)]
    peers = ",".join(f"127.0.0.1:{p[3]}" for p in ports)
    with contextlib.ExitStack() as stack:
        for i, (grpc_port, health, metrics, sync_port) in enumerate(ports):
            args = prefix_epp("serve", "--endpoints", ",".join(backends), "--secure-serving=false",
                              "--grpc-port", str(grpc_port), "--grpc-health-port", str(health),
                              "--metrics-port", str(metrics), "--bind-address", "127.0.0.1", "--log-level",
                              "warning", "--sync-warm-timeout", "1s", *extra)
            if sync:
                args += ["--sync-port", str(sync_port), "--peers", peers, "--sync-secret-file", str(secret)]
            stack.enter_context(running(args, tmp / f"picker-{i}.log", wait_port=grpc_port))
        for _, _, metrics, _ in ports:
            wait_for_port(metrics)
        yield [(p[0], p[2]) for p in ports]


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
            envoy(tmp, "envoy", [p for p, _ in procs], pool.addresses) as url:
        asyncio.run(client.probe(url))
        if sync:
            wait_peers([m for _, m in procs], n - 1)
        result = asyncio.run(client.run(url, workload, time_scale))
        texts = [scrape(m) for _, m in procs]
    routed = [metric(t, "prefix_epp_requests_total", outcome="routed", status="200") for t in texts]
    sent = sum(metric(t, "prefix_epp_sync_bytes_sent_total") for t in texts)
    links = max(1, n - 1)
    return {"config": label, "workload": workload_name, "seed": seed,
            "requests": len(result.requests), "errors": sum(1 for r in result.requests if not r.ok),
            "hit_rate": round(hit_rate(result.requests), 4),
            "share_per_picker": [round(r / max(1.0, sum(routed)), 3) for r in routed],
            "sync_bytes_per_request_per_link": round(sent / links / max(1.0, sum(routed)), 1) if sync else 0.0,
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


async def closed_loop(url: str, concurrency: int, total: int) -> float:
    shared = "You are the support desk of a large company. " * 80
    bodies = [json.dumps({"model": "m", "prompt": shared + f"question {i}", "max_tokens": 4}).encode()
              for i in range(64)]
    sent = 0

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal sent
        while sent < total:
            body = bodies[sent % len(bodies)]
            sent += 1
            async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for _ in range(300):  # until the pod is ready behind Envoy, then a warm-up
            if await worker_once(s, url, bodies[0]) == 200:
                break
            await asyncio.sleep(0.1)
        await asyncio.gather(*(worker_once(s, url, bodies[0]) for _ in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        return total / (time.perf_counter() - t0)


async def worker_once(s: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
        await r.read()
        return r.status


def workers_run(tmp: Path, workers: int, total: int) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    ports = free_ports(3)
    args = python_module("testkit.echo_backends", *map(str, ports), "--trivial")
    with running(args, tmp / "backends.log", wait_port=ports[-1]):
        backends = [f"127.0.0.1:{p}" for p in ports]
        with pickers(tmp, backends, 1, False, ("--workers", str(workers))) as procs, \
                envoy(tmp, "envoy", [procs[0][0]], backends, concurrency=2, per_connection=100) as url:
            rps = asyncio.run(closed_loop(url + "/v1/completions", 32, total))
    return {"workers": workers, "requests": total, "rps": round(rps, 1)}


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def summarize(raw: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if raw.get("hit_rate"):
        rows = raw["hit_rate"]
        out["hit_rate"] = {w: {c: spread([r["hit_rate"] for r in rows if r["workload"] == w and r["config"] == c])
                               for c, _, _ in CONFIGS} for w in WORKLOADS}
        out["sync_bytes_per_s_at_1000_rps_per_link"] = {
            w: spread([r["sync_bytes_per_request_per_link"] * 1000 for r in rows
                       if r["workload"] == w and r["config"] != "1" and "unsynced" not in r["config"]])
            for w in WORKLOADS}
    if raw.get("workers"):
        out["workers_rps"] = {str(n): spread([r["rps"] for r in raw["workers"] if r["workers"] == n]) for n in (1, 2)}
    if raw.get("snapshot"):
        out["snapshot"] = raw["snapshot"]
    return out


def table(summary: dict[str, Any]) -> str:
    lines = []
    if "hit_rate" in summary:
        lines += ["| pickers | " + " | ".join(WORKLOADS) + " |", "|---|" + "---:|" * len(WORKLOADS)]
        for c, _, _ in CONFIGS:
            cells = [summary["hit_rate"][w][c] for w in WORKLOADS]
            lines.append(f"| {c} | " + " | ".join(f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})" for x in cells)
                         + " |")
        bw = summary["sync_bytes_per_s_at_1000_rps_per_link"]
        lines += ["", "Sync bandwidth per peer link at 1,000 req/s: " + "; ".join(
            f"{w} {bw[w]['median'] / 1024:.0f} KiB/s ({bw[w]['min'] / 1024:.0f}-{bw[w]['max'] / 1024:.0f})"
            for w in WORKLOADS)]
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
    p.add_argument("--time-scale", type=float, default=3.0)
    p.add_argument("--worker-requests", type=int, default=3000)
    p.add_argument("--out", default=str(RESULTS / "replicas"))
    a = p.parse_args(argv)
    raw: dict[str, list[dict[str, Any]]] = {"hit_rate": [], "snapshot": [], "workers": []}
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp_s:
        tmp = Path(tmp_s)
        for rep in range(a.reps):
            if "hit-rate" in a.parts:
                for w in WORKLOADS:
                    for label, n, sync in CONFIGS:
                        row = hit_rate_run(tmp / f"{rep}-{w}-{n}-{sync}", w, rep, label, n, sync, a.time_scale)
                        print(json.dumps(row), flush=True)
                        raw["hit_rate"].append(row)
            if "workers" in a.parts:
                for n in (1, 2):
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


