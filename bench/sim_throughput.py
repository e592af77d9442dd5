"""Simulator throughput: requests/s that N replicas in ONE process sustain on this machine.

Starts `python -m prefix_epp_sim.cli --replicas N --time-scale S` as a subprocess (the load
generator runs here, in another process, as it would in a benchmark), then keeps `concurrency`
requests in flight for at most `duration` seconds (or `max_requests`), spreading them round-robin
over the replicas. Prompts are `groups` shared prefixes of `prefix_tokens` tokens each plus a
short unique suffix, so most of each prompt is a prefix-cache hit after the first round.

Reports requests/s, errors, wall and model-time latency percentiles (model = wall x time_scale),
TTFT when streaming, the cached-token fraction from `usage`, and the simulator process's CPU use.

Usage: python -m bench.sim_throughput [--stream] [--no-kv-events] [--out bench/results/sim_throughput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.tokenization.builtin import count
from testkit.procs import free_port, python_module, running, wait_for_port

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma")


def shared_prefix(group: int, tokens: int) -> str:
    words = [f"{WORDS[(group * 7 + i) % len(WORDS)]}{i % 97}" for i in range(tokens * 2)]
    text = f"System prompt {group}:"
    # Grow in chunks and trim by whole words until the count matches.
    step = 256
    i = 0
    while count(text) < tokens:
        text += " " + " ".join(words[i:i + step])
        i += step
    pieces = text.split(" ")
    while count(" ".join(pieces)) > tokens:
        pieces.pop()
    return " ".join(pieces)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      stream: bool) -> tuple[float, float | None, int, int]:
    """(latency, ttft, prompt_tokens, cached_tokens) in wall seconds."""
    start = time.perf_counter()
    if not stream:
        async with session.post(url, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json"}) as resp:
            resp.raise_for_status()
            usage = orjson.loads(await resp.read())["usage"]
        return time.perf_counter() - start, None, usage["prompt_tokens"], usage["prompt_tokens_details"][
            "cached_tokens"]
    ttft: float | None = None
    usage = {}
    async with session.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return time.perf_counter() - start, ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


async def load(urls: list[str], args: argparse.Namespace, prefixes: list[str]) -> dict[str, Any]:
    latencies: list[float] = []
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = errors = 0
    issued = itertools.count()
    deadline = time.perf_counter() + args.duration
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal prompt_tokens, cached_tokens, errors
            while time.perf_counter() < deadline:
                n = next(issued)
                if n >= args.max_requests:
                    return
                body = {"model": "sim-model", "max_tokens": args.max_tokens,
                        "prompt": f"{prefixes[n % len(prefixes)]} Question {n}: what next?"}
                try:
                    lat, ttft, p, c = await one_request(session, urls[n % len(urls)], body, args.stream)
                except (aiohttp.ClientError, KeyError):
                    errors += 1
                    continue
                latencies.append(lat)
                if ttft is not None:
                    ttfts.append(ttft)
                prompt_tokens += p
                cached_tokens += c

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    scale = args.time_scale
    return {
        "requests": len(latencies), "errors": errors, "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "latency_wall_ms": {q: round(percentile(latencies, q) * 1000, 2) for q in (50, 90, 99)},
        "latency_model_ms": {q: round(percentile(latencies, q) * 1000 * scale, 1) for q in (50, 90, 99)},
        "ttft_model_ms": {q: round(percentile(ttfts, q) * 1000 * scale, 1) for q in (50, 90, 99)} if ttfts else None,
        "cached_fraction": round(cached_tokens / prompt_tokens, 3) if prompt_tokens else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load (max)")
    p.add_argument("--max-requests", type=int, default=200_000)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    prefixes = [shared_prefix(g, args.prefix_tokens) for g in range(args.groups)]
    base = free_port()
    while any(base + i > 65535 for i in range(args.replicas)):
        base = free_port()
    argv = python_module("prefix_epp_sim.cli", "--replicas", str(args.replicas), "--port", str(base),
                         "--time-scale", str(args.time_scale), "--log-level", "warning",
                         "--kv-events-port-base", "0", "--kv-events" if args.kv_events else "--no-kv-events")
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"sim_throughput_{os.getpid()}.log"
    with running(argv, log_path, wait_port=base) as proc:
        for i in range(args.replicas):
            wait_for_port(base + i, proc=proc.popen)
        urls = [f"http://127.0.0.1:{base + i}/v1/completions" for i in range(args.replicas)]
        cpu_before, wall_before = cpu_seconds(proc.pid), time.perf_counter()
        result = asyncio.run(load(urls, args, prefixes))
        cpu = cpu_seconds(proc.pid) - cpu_before
        wall = time.perf_counter() - wall_before
    result = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpu_cores": os.cpu_count(),
        **result,
        "sim_process_cpu_cores_used": round(cpu / wall, 2),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
