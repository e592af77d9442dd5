"""Picker overhead benchmark: what the picker adds on top of Envoy, per request and per token.

Measured on this machine (2 cores shared by the client, Envoy, the picker and the backends):

1. Decision latency in process: `Director.route` (parse + hash + index lookup + score + pick +
   record) on 8 KB and 512 KB completion bodies against 8 endpoints with a warm index; and the
   precise mode's tokenization (`Director.prepare`, builtin tokenizer, off the event loop) on a
   7,200-token prompt, cold (every chunk encoded) and warm (a shared prefix already cached).
2. Through real Envoy configured by `prefix-epp envoy-config`, with trivial backends that answer
   1, 50 or 500 streamed tokens back to back (so the picker, not a model, is what is measured):
   Envoy alone (round robin, no ext_proc) against Envoy + picker in three wirings:
   - `default`: buffered request body, response trailers, no response headers or body (but the
     sampled share, `--usage-sample-rate` at its default, asked for by mode_override);
   - `default, all sampled`: the same with `--usage-sample-rate 1`: every response body comes to
     the picker (STREAMED), which prices one sampled request, hence the default sample rate;
   - `duplex-request`: full-duplex request body (streamed back by the picker), response headers
     and trailers, no response body;
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
import random
import statistics
import string
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.lib import go_epp
from bench.lib.loadgen import Tally, closed_loop, open_loop
from bench.lib.stats import percentile
from extproc.commands.envoy_config import build_config, render
from extproc.config.settings import EppConfig, KVEventsConfig
from extproc.core.datastore import EndpointSpec
from testkit.envoy import envoy_binary, plain_envoy_config
from testkit.procs import Proc, free_ports, prefix_epp, python_module, running

WIRINGS: dict[str, tuple[str, str, tuple[str, ...]]] = {  # name -> (request body, responses, picker flags)
    "default": ("BUFFERED", "end", ()),
    "default, all sampled": ("BUFFERED", "end", ("--usage-sample-rate", "1")),
    "duplex-request": ("FULL_DUPLEX_STREAMED", "end", ()),
    "full-duplex": ("FULL_DUPLEX_STREAMED", "full-duplex", ()),
}


def prompt_body(size: int, seed: int, shared: int = 0, tokens: int = 1, interval_ms: float = 0.0) -> bytes:
    """A completion request of about `size` prompt bytes; stream, max_tokens and the trivial backend's
    pause between tokens come first (testkit/echo_backends.py reads the first 256 bytes)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = ("shared system prompt " * (shared // 21 + 1))[:shared]
    parts = [text]
    n = len(text)
    while n < size:
        word = rng.choice(words) + " "
        parts.append(word)
        n += len(word)
    head: dict[str, object] = {"stream": True, "max_tokens": tokens} if tokens > 1 else {"max_tokens": 1}
    if interval_ms and tokens > 1:
        head["interval_ms"] = interval_ms
    return orjson.dumps({**head, "model": "bench-model", "prompt": "".join(parts)[:size]})


def decision_latency(size: int, n: int) -> dict[str, float]:
    from extproc.control.director import RequestContext
    from extproc.runtime.app import App

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
    from extproc.tokenization.chunking import BuiltinTokenizer

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


@dataclass
class Setup:
    url: str
    picker: Proc | None = None
    metrics_port: int = 0


def response_body_messages(port: int) -> float:
    """The picker's count of response_body messages from Envoy (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('prefix_epp_extproc_messages_total{kind="response_body"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def start_setups(tmp: Path, stack: ExitStack, backends: list[str]) -> dict[str, Setup]:
    """Envoy alone plus one Envoy and one picker per wiring, by name."""
    setups: dict[str, Setup] = {}
    for name in ("envoy-only", *WIRINGS):
        listen, admin = free_ports(2)
        picker: Proc | None = None
        metrics = 0
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
        setups[name] = Setup(f"http://127.0.0.1:{listen}/v1/completions", picker, metrics if picker else 0)
    add_go_epp_setup(tmp, stack, backends, setups)
    return setups


GO_EPP_SETUP = "go-epp (GIE v1.5.0)"


def add_go_epp_setup(tmp: Path, stack: ExitStack, backends: list[str],
                     setups: dict[str, Setup]) -> None:
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
    setups[GO_EPP_SETUP] = Setup(url, picker)  # its /metrics has no prefix-epp message counts


def _answers(url: str) -> bool:
    req = urllib.request.Request(url, data=prompt_body(64, 0), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def measure(setups: dict[str, Setup], size: int, tokens: int, conc: int,
            total: int, rounds: int = 5, rate: float = 0.0, interval_ms: float = 0.0) -> list[dict[str, Any]]:
    """The setups take turns, `rounds` times, so a change in the machine's load hits all alike.

    `conc` workers in a closed loop, or, with `rate`, an open loop at that many requests/s; with
    `interval_ms`, streamed tokens come that far apart, one SSE event each, as a model server sends them.
    """
    bodies = [prompt_body(size, i, shared=size // 2, tokens=tokens, interval_ms=interval_ms) for i in range(32)]
    tallies = {name: Tally() for name in setups}
    body_messages = {name: 0.0 for name in setups}
    for r in range(rounds):
        for name, setup in setups.items():
            pid = setup.picker.pid if setup.picker else None
            before = response_body_messages(setup.metrics_port) if setup.metrics_port else 0.0
            if rate:
                asyncio.run(open_loop(setup.url, bodies, rate, max(1, total // rounds), tallies[name], pid))
            else:
                asyncio.run(closed_loop(setup.url, bodies, conc, max(1, total // rounds), tallies[name], pid,
                                        warm_up=10 if r == 0 else 0))
            if setup.metrics_port:
                body_messages[name] += response_body_messages(setup.metrics_port) - before
    rows: list[dict[str, Any]] = []
    for name, setup in setups.items():
        picker = setup.picker
        t = tallies[name]
        ok = len(t.latencies)
        row = {"setup": name, "prompt_bytes": size, "tokens": tokens, "concurrency": conc, "rate": rate,
               "token_interval_ms": interval_ms,
               "rps": ok / t.elapsed_s, "p50_ms": percentile(t.latencies, 50) * 1e3,
               "p99_ms": percentile(t.latencies, 99) * 1e3, "ok": ok, "failed": t.failed,
               "picker_cpu_ms_per_request": t.cpu_s * 1e3 / max(1, ok) if picker else None,
               # Counted from prefix-epp's /metrics; the Go picker's has no such count.
               "response_body_messages_per_request": (body_messages[name] / max(1, ok + t.failed)
                                                      if setup.metrics_port else None)}
        rows.append(row)
        per = row["response_body_messages_per_request"]
        cpu_text = (f"  picker CPU {row['picker_cpu_ms_per_request']:.2f} ms/req"
                    + ("" if per is None else f", {per:.1f} body msgs/req")) if picker else ""
        load = f"{rate:4.0f}/s" if rate else f"c={conc:3d}"
        print(f"  {name:21s} {size // 1024:4d} KB {tokens:4d} tok {load}  {row['rps']:7.0f} rps  "
              f"p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  failed {t.failed}{cpu_text}",
              flush=True)
    return rows


def through_envoy(tmp: Path, quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    b_ports = free_ports(2)
    backends = [f"127.0.0.1:{p}" for p in b_ports]
    with ExitStack() as stack:
        stack.enter_context(running(python_module("testkit.echo_backends", *map(str, b_ports), "--trivial"),
                                    tmp / "backends.log", wait_port=b_ports[-1]))
        setups = start_setups(tmp, stack, backends)
        n = 200 if quick else 1000
        for size in (8 * 1024, 512 * 1024):
            for tokens in (1, 50, 500):
                count = n if size <= 16384 else n // 4
                rows += measure(setups, size, tokens, 1, count // (2 if tokens == 500 else 1))
        for tokens in (1, 50, 500):  # per-token cost at one request rate, tokens paced like a model's
            rows += measure(setups, 8 * 1024, tokens, 0, n // 5, rate=10.0, interval_ms=4.0)
        rows += measure(setups, 8 * 1024, 1, 32, n * 3)  # throughput of one picker process
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
    lines += ["", "| setup | prompt | tokens | load | req/s | p50 (ms) | p99 (ms) | picker CPU (ms/req) "
              "| response-body messages/req | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cpu = "-" if r["picker_cpu_ms_per_request"] is None else f"{r['picker_cpu_ms_per_request']:.2f}"
        per = r["response_body_messages_per_request"]
        msgs = "-" if per is None else f"{per:.1f}"
        load = f"{r['rate']:.0f}/s, 1 token/{r['token_interval_ms']:g} ms" if r.get("rate") else f"c={r['concurrency']}"
        lines.append(f"| {r['setup']} | {r['prompt_bytes'] // 1024} KB | {r['tokens']} | {load} | "
                     f"{r['rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {cpu} | {msgs} | {r['failed']} |")
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
