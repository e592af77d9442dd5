"""Picker overhead benchmark: what the picker adds on top of Envoy, per request and per token.

Measured on this machine (2 cores shared by the client, Envoy, the picker and the backends):

1. Decision latency in process: `Director.route` (parse + hash + index lookup + score + pick +
   record) on 8 KB and 512 KB completion bodies against 8 endpoints with a warm index; and the
   precise mode's tokenization (`Director.prepare`, builtin tokenizer, off the event loop) on a
   7,200-token prompt, cold (every chunk encoded) and warm (a shared prefix already cached).
2. Through real Envoy configured by `prefix-epp envoy-config`, with trivial backends that answer
   1, 50 or 500 streamed tokens back to back (so the picker, not a model, is what is measured):
   Envoy alone (round robin, no ext_proc) against Envoy + picker in three wirings:
   - `default`: buffered request body, response headers and trailers, no response body (but the
     sampled share, `--usage-sample-rate` at its default, asked for by mode_override);
   - `default, all sampled`: the same with `--usage-sample-rate 1`: every response body comes to
     the picker (STREAMED), which prices one sampled request, hence the default sample rate;
   - `duplex-request`: full-duplex request body (streamed back by the picker), response headers
     and trailers;
   - `full-duplex` (the previous default, the Inference Extension's reference config): full-duplex
     request body, and every response chunk makes a round trip through the picker.
   - `go-epp (GIE v1.5.0)`: the Go endpoint picker in its reference wiring (full-duplex request
     and response bodies), when Go or its cached build is present (`add_go_epp_setup`).
   For each: requests/s, latency p50/p99 and the picker's CPU per request (utime + stime of the
   picker process over the run, divided by the successful requests). Only 200 answers count in
   the figures; failures are reported apart.

Usage: python -m bench.overhead [--quick] [--out bench/results/overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.peers import go_epp
from extproc.config import EppConfig, KVEventsConfig
from extproc.datastore import EndpointSpec
from extproc.envoy_config import build_config, render
from tests.support.envoy import envoy_binary
from tests.support.procs import Proc, free_ports, prefix_epp, python_module, running

WIRINGS: dict[str, tuple[str, str, tuple[str, ...]]] = {  # name -> (request body, responses, picker flags)
    "default": ("BUFFERED", "headers-trailers", ()),
    "default, all sampled": ("BUFFERED", "headers-trailers", ("--usage-sample-rate", "1")),
    "duplex-request": ("FULL_DUPLEX_STREAMED", "headers-trailers", ()),
    "full-duplex": ("FULL_DUPLEX_STREAMED", "full-duplex", ()),
}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def prompt_body(size: int, seed: int, shared: int = 0, tokens: int = 1) -> bytes:
    """A completion request of about `size` prompt bytes; stream/max_tokens come first (see backends)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = ("shared system prompt " * (shared // 21 + 1))[:shared]
    parts = [text]
    n = len(text)
    while n < size:
        word = rng.choice(words) + " "
        parts.append(word)
        n += len(word)
    head = {"stream": True, "max_tokens": tokens} if tokens > 1 else {"max_tokens": 1}
    return orjson.dumps({**head, "model": "bench-model", "prompt": "".join(parts)[:size]})


def decision_latency(size: int, n: int) -> dict[str, float]:
    from extproc.app import App
    from extproc.director import RequestContext

    app = App(EppConfig(seed=1))
    app.datastore.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(8))
    bodies = [prompt_body(size, i, shared=size // 2) for i in range(64)]
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


def tokenization_latency(n: int) -> dict[str, float]:
    """Precise mode: the builtin tokenizer off the loop on a 7,200-token prompt (6,000 shared tokens
    + 1,200 of its own), cold (a fresh tokenizer, every chunk encoded) and warm (the shared part cached)."""
    from extproc.request.openai import Api, parse_request
    from extproc.tokenize import BuiltinTokenizer

    k = KVEventsConfig()
    max_tokens = k.max_blocks * k.block_size
    vocab = random.Random(0)
    # Words of 1-12 letters (about 1.16 builtin tokens each) from a 5,000-word vocabulary.
    words = ["".join(vocab.choice(string.ascii_lowercase) for _ in range(vocab.randint(1, 12))) + " "
             for _ in range(5000)]

    def text(seed: int, n_tokens: int) -> str:
        rng = random.Random(seed)
        return "".join(rng.choice(words) for _ in range(int(n_tokens / 1.16)))

    shared = text(0, 6000)

    async def run() -> dict[str, float]:
        cold: list[float] = []
        warm: list[float] = []
        tokens: list[int] = []
        warm_tokenizer = BuiltinTokenizer()
        for i in range(n + 1):
            own = text(i + 1, 1200)
            parsed = parse_request(Api.COMPLETIONS, orjson.dumps({"model": "bench-model", "prompt": shared + own}))
            start = time.perf_counter()
            await BuiltinTokenizer().encode_async(parsed, max_tokens)
            cold.append(time.perf_counter() - start)
            start = time.perf_counter()
            tokens = await warm_tokenizer.encode_async(parsed, max_tokens) or []
            if i:  # the first request warms the shared prefix
                warm.append(time.perf_counter() - start)
        return {"tokens": len(tokens), "cold_p50_ms": percentile(cold, 50) * 1e3,
                "warm_p50_ms": percentile(warm, 50) * 1e3, "warm_p99_ms": percentile(warm, 99) * 1e3}

    return asyncio.run(run())


def plain_envoy_config(listen: int, admin: int, backends: list[str]) -> dict[str, Any]:
    cfg = build_config(listen, "127.0.0.1:1", admin, epp_tls=False, endpoints=tuple(backends))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][1:]  # router only: no ext_proc
    cluster = cfg["static_resources"]["clusters"][1]
    cluster.pop("load_balancing_policy")
    cluster["lb_policy"] = "ROUND_ROBIN"
    cfg["static_resources"]["clusters"] = [cluster]
    return cfg


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, total: int,
                      pid: int | None = None) -> dict[str, float]:
    """`total` requests from `concurrency` workers after a warm-up; figures over the 200 answers only.

    With `pid`, also the CPU seconds that process spent during the timed part (`cpu_s`).
    """
    latencies: list[float] = []
    failures = 0
    issued = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker() -> None:
            nonlocal issued, failures
            while issued < total:
                i = issued
                issued += 1
                start = time.perf_counter()
                try:
                    async with session.post(url, data=bodies[i % len(bodies)],
                                            headers={"content-type": "application/json"}) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    failures += 1

        for _ in range(min(20, total // 5)):  # warm-up: connections, the picker's index
            async with session.post(url, data=bodies[0], headers={"content-type": "application/json"}) as r:
                await r.read()
        cpu_before = cpu_seconds(pid) if pid else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        cpu = cpu_seconds(pid) - cpu_before if pid else 0.0
    return {"rps": len(latencies) / elapsed, "p50_ms": percentile(latencies, 50) * 1e3,
            "p99_ms": percentile(latencies, 99) * 1e3, "ok": len(latencies), "failed": failures, "cpu_s": cpu}


def start_setups(tmp: Path, stack: ExitStack, backends: list[str]) -> dict[str, tuple[str, Proc | None]]:
    """Envoy alone plus one Envoy and one picker per wiring; name -> (url, picker process)."""
    setups: dict[str, tuple[str, Proc | None]] = {}
    for name in ("envoy-only", *WIRINGS):
        listen, admin = free_ports(2)
        picker: Proc | None = None
        if name == "envoy-only":
            cfg = plain_envoy_config(listen, admin, backends)
        else:
            grpc_port, health, metrics = free_ports(3)
            picker = stack.enter_context(running(prefix_epp(
                "serve", "--endpoints", ",".join(backends), "--grpc-port", str(grpc_port), "--grpc-health-port",
                str(health), "--metrics-port", str(metrics), "--secure-serving=false", "--bind-address",
                "127.0.0.1", "--log-level", "warning",
                # Trivial backends serve no metrics; scraping would add CPU that grows with wall time.
                "--refresh-metrics-interval", "0", *WIRINGS[name][2]), tmp / f"picker-{len(setups)}.log",
                wait_port=grpc_port))
            body_mode, responses, _ = WIRINGS[name]
            cfg = build_config(listen, f"127.0.0.1:{grpc_port}", admin, epp_tls=False,
                               request_body_mode=body_mode, response_processing=responses)
        path = tmp / f"{name.replace(' ', '_').replace(',', '')}.yaml"
        path.write_text(render(cfg))
        stack.enter_context(running(
            [envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "error",
             "--base-id", str(listen)], tmp / f"envoy-{path.stem}.log", wait_port=listen))
        setups[name] = (f"http://127.0.0.1:{listen}/v1/completions", picker)
    add_go_epp_setup(tmp, stack, backends, setups)
    return setups


GO_EPP_SETUP = "go-epp (GIE v1.5.0)"


def add_go_epp_setup(tmp: Path, stack: ExitStack, backends: list[str],
                     setups: dict[str, tuple[str, Proc | None]]) -> None:
    """The Go endpoint picker (bench/peers) behind its reference Envoy wiring, when it can run here.

    Full-duplex request and response bodies (the only mode it supports), default scheduling
    profile, its pool read from a real kube-apiserver. Compared on the same footing as the
    prefix-epp rows: plaintext gRPC (`--secure-serving=false`) and metrics scraping effectively
    off (`--refresh-metrics-interval 1h`; the trivial backends serve no metrics). Its CPU per
    request is the Go picker process's alone (not the API server's).
    """
    why = go_epp.unavailable()
    if why:
        print(f"  {GO_EPP_SETUP}: not run ({why})", flush=True)
        return
    listen, admin = free_ports(2)
    picker, grpc_port, _, _ = stack.enter_context(go_epp.go_epp(
        tmp / "go-epp", backends, ("--secure-serving=false", "--refresh-metrics-interval", "1h")))
    path = tmp / "go-epp.yaml"
    path.write_text(render(go_epp.envoy_config(listen, grpc_port, admin, backends, tls=False)))
    stack.enter_context(running([envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "error",
                                 "--base-id", str(listen)], tmp / "envoy-go-epp.log", wait_port=listen))
    url = f"http://127.0.0.1:{listen}/v1/completions"
    deadline = time.monotonic() + 30
    while not _answers(url):  # until its pods are in its datastore
        if time.monotonic() > deadline:
            raise RuntimeError(f"go-epp routes nothing:\n{picker.log_text()[-2000:]}")
        time.sleep(0.1)
    setups[GO_EPP_SETUP] = (url, picker)


def _answers(url: str) -> bool:
    req = urllib.request.Request(url, data=prompt_body(64, 0), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def measure(setups: dict[str, tuple[str, Proc | None]], size: int, tokens: int, conc: int,
            total: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    bodies = [prompt_body(size, i, shared=size // 2, tokens=tokens) for i in range(32)]
    for name, (url, picker) in setups.items():
        res = asyncio.run(closed_loop(url, bodies, conc, total, picker.pid if picker else None))
        cpu = res.pop("cpu_s")
        row = {"setup": name, "prompt_bytes": size, "tokens": tokens, "concurrency": conc, **res,
               "picker_cpu_ms_per_request": cpu * 1e3 / max(1, res["ok"]) if picker else None}
        rows.append(row)
        cpu_text = f"  picker CPU {row['picker_cpu_ms_per_request']:.2f} ms/req" if picker else ""
        print(f"  {name:21s} {size // 1024:4d} KB {tokens:4d} tok c={conc:3d}  {res['rps']:7.0f} rps  "
              f"p50 {res['p50_ms']:7.2f} ms  p99 {res['p99_ms']:7.2f} ms  failed {res['failed']}{cpu_text}",
              flush=True)
    return rows


def through_envoy(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    b_ports = free_ports(2)
    backends = [f"127.0.0.1:{p}" for p in b_ports]
    with ExitStack() as stack:
        stack.enter_context(running(python_module("tests.support.echo_backends", *map(str, b_ports), "--trivial"),
                                    tmp / "backends.log", wait_port=b_ports[-1]))
        setups = start_setups(tmp, stack, backends)
        n = 200 if quick else 1000
        for size in (8 * 1024, 512 * 1024):
            for tokens in (1, 50, 500):
                count = n if size <= 16384 else n // 4
                rows += measure(setups, size, tokens, 1, count // (2 if tokens == 500 else 1))
        for conc in (8, 32):  # throughput of one picker process, 8 KB, one token
            rows += measure(setups, 8 * 1024, 1, conc, n * 3)
    return rows


def table(decisions: dict[str, dict[str, float]], tokenize: dict[str, float], rows: list[dict[str, Any]]) -> str:
    lines = ["| prompt | decision p50 (ms) | decision p99 (ms) |", "|---|---:|---:|"]
    for size, d in decisions.items():
        lines.append(f"| {size} | {d['p50_ms']:.3f} | {d['p99_ms']:.3f} |")
    lines += ["", f"| precise-mode tokenization, {tokenize['tokens']:.0f} tokens | cold p50 (ms) | warm p50 (ms) "
              "| warm p99 (ms) |",
              "|---|---:|---:|---:|",
              f"| builtin, off the event loop | {tokenize['cold_p50_ms']:.2f} | {tokenize['warm_p50_ms']:.2f} | "
              f"{tokenize['warm_p99_ms']:.2f} |"]
    lines += ["", "| setup | prompt | tokens | concurrency | req/s | p50 (ms) | p99 (ms) | picker CPU (ms/req) "
              "| failed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu = "-" if r["picker_cpu_ms_per_request"] is None else f"{r['picker_cpu_ms_per_request']:.2f}"
        lines.append(f"| {r['setup']} | {r['prompt_bytes'] // 1024} KB | {r['tokens']} | {r['concurrency']} | "
                     f"{r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {cpu} | {r['failed']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--out", default="bench/results/overhead.json")
    args = parser.parse_args()
    sizes = [8 * 1024, 512 * 1024]
    decisions = {f"{s // 1024} KB": decision_latency(s, 300 if args.quick else 2000) for s in sizes}
    for k, v in decisions.items():
        print(f"decision latency {k}: p50 {v['p50_ms']:.3f} ms, p99 {v['p99_ms']:.3f} ms", flush=True)
    tokenize = tokenization_latency(20 if args.quick else 100)
    print(f"precise tokenization {tokenize['tokens']:.0f} tokens: cold p50 {tokenize['cold_p50_ms']:.2f} ms, "
          f"warm p50 {tokenize['warm_p50_ms']:.2f} ms", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = through_envoy(Path(tmp), args.quick)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"decision_latency": decisions, "precise_tokenization": tokenize,
                               "through_envoy": rows}, indent=2))
    md = table(decisions, tokenize, rows)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
