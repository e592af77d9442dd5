"""Picker overhead benchmark: what the picker adds on top of Envoy, and how fast one process is.

Two measurements, both on this machine (2 cores shared by everything):

1. Decision latency in process: `Director.route` (parse + hash + index lookup + score + pick +
   record) on 8 KB and 512 KB completion bodies against 8 endpoints with a warm index.
2. Through real Envoy with trivial backends: Envoy alone (round robin) vs Envoy + picker
   (full-duplex request body; response processing on and off) at several concurrency levels,
   for 8 KB and 512 KB prompts: latency p50/p99 and requests/s of one picker process.

Usage: python -m bench.overhead [--quick] [--out bench/results/overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.config import EppConfig
from extproc.datastore import EndpointSpec
from extproc.envoy_config import build_config, render
from tests.support.envoy import envoy_binary
from tests.support.procs import free_ports, prefix_epp, python_module, running, wait_for_port


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def prompt_body(size: int, seed: int, shared: int = 0) -> bytes:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = ("shared system prompt " * (shared // 21 + 1))[:shared]
    while len(text) < size:
        text += rng.choice(words) + " "
    return orjson.dumps({"model": "bench-model", "prompt": text[:size], "max_tokens": 1})


def decision_latency(size: int, n: int) -> dict[str, float]:
    from extproc.app import App

    app = App(EppConfig(seed=1))
    app.datastore.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(8))
    bodies = [prompt_body(size, i, shared=size // 2) for i in range(64)]
    from extproc.director import RequestContext

    samples: list[float] = []
    for i in range(n + 50):
        ctx = RequestContext(path="/v1/completions", request_id=str(i))
        body = bodies[i % len(bodies)]
        start = time.perf_counter()
        decision = app.director.route(ctx, body)
        elapsed = time.perf_counter() - start
        app.director.complete(decision.primary)
        if i >= 50:
            samples.append(elapsed)
    return {"p50_ms": percentile(samples, 50) * 1e3, "p99_ms": percentile(samples, 99) * 1e3,
            "mean_ms": statistics.fmean(samples) * 1e3}


def plain_envoy_config(listen: int, admin: int, backends: list[str]) -> dict[str, Any]:
    cfg = build_config(listen, "127.0.0.1:1", admin, epp_tls=False, endpoints=tuple(backends))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][1:]  # router only: no ext_proc
    cluster = cfg["static_resources"]["clusters"][1]
    cluster.pop("load_balancing_policy")
    cluster["lb_policy"] = "ROUND_ROBIN"
    cfg["static_resources"]["clusters"] = [cluster]
    return cfg


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, total: int) -> dict[str, float]:
    latencies: list[float] = []
    errors = 0
    issued = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker(wid: int) -> None:
            nonlocal issued, errors
            while issued < total:
                i = issued
                issued += 1
                start = time.perf_counter()
                async with session.post(url, data=bodies[i % len(bodies)],
                                        headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - start)

        warm = min(50, total // 5)
        for _ in range(warm):
            async with session.post(url, data=bodies[0], headers={"content-type": "application/json"}) as r:
                await r.read()
        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"rps": len(latencies) / elapsed, "p50_ms": percentile(latencies, 50) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3, "errors": errors, "requests": len(latencies)}


def through_envoy(tmp: Path, sizes: list[int], concurrencies: list[int], total: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    b_ports = free_ports(2)
    backends = [f"127.0.0.1:{p}" for p in b_ports]
    with ExitStack() as stack:
        stack.enter_context(running(python_module("tests.support.echo_backends", *map(str, b_ports), "--trivial"),
                                    tmp / "backends.log", wait_port=b_ports[-1]))
        grpc_port, health, metrics = free_ports(3)
        stack.enter_context(running(prefix_epp(
            "serve", "--endpoints", ",".join(backends), "--grpc-port", str(grpc_port), "--grpc-health-port",
            str(health), "--metrics-port", str(metrics), "--secure-serving=false", "--bind-address", "127.0.0.1",
            "--log-level", "warning"), tmp / "picker.log", wait_port=grpc_port))
        setups: list[tuple[str, dict[str, Any]]] = []
        epp = f"127.0.0.1:{grpc_port}"
        configs: list[tuple[str, Callable[[int, int], dict[str, Any]]]] = [
            ("envoy-only", lambda lp, ap: plain_envoy_config(lp, ap, backends)),
            ("envoy+picker", lambda lp, ap: build_config(lp, epp, ap, epp_tls=False)),
            # Informational: without response processing Envoy ends the ext_proc stream once the request
            # is forwarded, so the picker cannot count requests in flight. Not a supported setup.
            ("envoy+picker, responses not processed",
             lambda lp, ap: build_config(lp, epp, ap, epp_tls=False, process_responses=False)),
        ]
        for name, cfg_fn in configs:
            listen, admin = free_ports(2)
            path = tmp / f"{len(setups)}.yaml"
            path.write_text(render(cfg_fn(listen, admin)))
            stack.enter_context(running(
                [envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "error",
                 "--base-id", str(listen)], tmp / f"envoy{len(setups)}.log", wait_port=listen))
            wait_for_port(listen)
            setups.append((name, {"url": f"http://127.0.0.1:{listen}/v1/completions"}))
        for size in sizes:
            bodies = [prompt_body(size, i, shared=size // 2) for i in range(32)]
            n = total if size <= 16384 else max(total // 4, 200)
            for conc in concurrencies:
                for name, setup in setups:
                    res = asyncio.run(closed_loop(setup["url"], bodies, conc, n))
                    row = {"setup": name, "prompt_bytes": size, "concurrency": conc, **res}
                    rows.append(row)
                    print(f"  {name:40s} {size // 1024:4d} KB c={conc:3d}  {res['rps']:7.0f} rps  "
                          f"p50 {res['p50_ms']:6.2f} ms  p99 {res['p99_ms']:6.2f} ms  errors {res['errors']}",
                          flush=True)
    return rows


def table(decisions: dict[str, dict[str, float]], rows: list[dict[str, Any]]) -> str:
    lines = ["| prompt | decision p50 (ms) | decision p99 (ms) |", "|---|---:|---:|"]
    for size, d in decisions.items():
        lines.append(f"| {size} | {d['p50_ms']:.3f} | {d['p99_ms']:.3f} |")
    lines += ["", "| setup | prompt | concurrency | req/s | p50 (ms) | p99 (ms) | errors |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['prompt_bytes'] // 1024} KB | {r['concurrency']} | {r['rps']:.0f} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests and levels")
    parser.add_argument("--out", default="bench/results/overhead.json")
    args = parser.parse_args()
    sizes = [8 * 1024, 512 * 1024]
    decisions = {f"{s // 1024} KB": decision_latency(s, 300 if args.quick else 2000) for s in sizes}
    for k, v in decisions.items():
        print(f"decision latency {k}: p50 {v['p50_ms']:.3f} ms, p99 {v['p99_ms']:.3f} ms", flush=True)
    concurrencies = [1, 16] if args.quick else [1, 8, 32]
    with tempfile.TemporaryDirectory() as tmp:
        rows = through_envoy(Path(tmp), sizes, concurrencies, 600 if args.quick else 3000)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"decision_latency": decisions, "through_envoy": rows}, indent=2))
    md = table(decisions, rows)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
