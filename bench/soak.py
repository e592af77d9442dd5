"""Soak: mixed traffic through real Envoy and the picker for a while; memory and state stay flat.

Stack: three echo backends (testkit/echo_backends.py, SSE answers for `"stream": true`),
the picker as a real process (`--prefix-lru-capacity 4000` so the prefix index fills during the
warm-up and then has to evict), Envoy in full-duplex mode. `--concurrency` clients (8) send,
by weight: valid completions and chats over a few hundred shared prefixes (55%), streamed
completions (10%), invalid bodies (10%), random model names (10%, bounded metric labels),
requests cancelled by the client half-way through a streamed answer (10%) and oversized bodies
(5%). Every `--interval` seconds (10) it samples the picker's RSS (/proc), its prefix-index
entries and bytes, the in-flight gauge, open ext_proc streams and /metrics size.

Verdict (`flat`): after the warm-up (the first fifth of the run), the median RSS of the last
quarter exceeds that of the second quarter by at most 5% + 10 MiB; the index stays within its
capacity; /metrics does not grow by more than 2 KB; once traffic stops, in-flight and open
streams return to 0 within 10 s; the picker is alive and logged no internal error. The report
also gives RSS growth per request after the warm-up (a least-squares slope): a leak of a few
bytes per request passes the 5% + 10 MiB check in 30 minutes, the slope shows it.

Usage: python -m bench.soak [--seconds 1800] [--out bench/results/soak]   (make soak)
Writes <out>.json (all samples) and <out>.md (summary table).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.commands.envoy_config import build_config, render
from testkit.envoy import envoy_binary
from testkit.procs import Proc, free_ports, prefix_epp, python_module, running, wait_for_port

LRU_CAPACITY = 4000
KINDS = (("valid", 55), ("stream", 10), ("invalid", 10), ("random_model", 10), ("cancelled", 10), ("oversized", 5))
ALL_KINDS = tuple(name for name, _ in KINDS)
INVALID = [b'{"model": "m", "prompt": ', b"[]", b'{"prompt": "no model"}', b'{"model": 5}',
           b'{"model": "m", "prompt": ' + b"[" * 300 + b"]" * 300 + b"}"]


@dataclass
class Sample:
    t: float
    rss_mib: float
    index_entries: float
    index_bytes: float
    inflight: float
    open_streams: float
    metrics_bytes: int
    requests: int


@dataclass
class Report:
    seconds: float
    concurrency: int
    requests: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    picker_errors: list[str] = field(default_factory=list)  # error log lines of the picker (first 20)
    grpc_write_after_reset: int = 0
    rss_bytes_per_request: float = 0.0  # least-squares slope of RSS against requests after the warm-up
    flat: bool = False


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int) -> tuple[dict[str, float], int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out, len(text)


@contextlib.contextmanager
def soak_stack(tmp: Path, picker_extra: tuple[str, ...] = ()) -> Iterator[tuple[Proc, int, int]]:
    """Yields (picker, envoy listen port, picker metrics port)."""
    ports = free_ports(3)
    backends = [f"127.0.0.1:{p}" for p in ports]
    grpc_port, health_port, metrics_port, listen, admin = free_ports(5)
    picker_args = prefix_epp("serve", "--endpoints", ",".join(backends), "--grpc-port", str(grpc_port),
                             "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
                             "--secure-serving=false", "--bind-address", "127.0.0.1",
                             "--prefix-lru-capacity", str(LRU_CAPACITY), "--max-request-body-bytes", "1000000",
                             "--log-level", "warning", *picker_extra)
    cfg = build_config(listen, f"127.0.0.1:{grpc_port}", admin, epp_tls=False)
    (tmp / "envoy.yaml").write_text(render(cfg))
    envoy_args = [envoy_binary(), "-c", str(tmp / "envoy.yaml"), "--concurrency", "1", "--log-level", "error",
                  "--base-id", str(listen)]
    with running(python_module("testkit.echo_backends", *map(str, ports)), tmp / "backends.log",
                 wait_port=ports[-1]), running(picker_args, tmp / "picker.log", wait_port=metrics_port) as picker:
        wait_for_port(grpc_port, proc=picker.popen)
        with running(envoy_args, tmp / "envoy.log", wait_port=listen):
            yield picker, listen, metrics_port


def _payload(rng: random.Random, kind: str) -> tuple[str, bytes]:
    prefix = f"system prompt {rng.randrange(300)}: " + "you are helpful. " * 40
    if kind == "invalid":
        return "/v1/completions", rng.choice(INVALID)
    if kind == "random_model":
        model = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(16))
        return "/v1/completions", json.dumps({"model": model, "prompt": prefix + str(rng.random())}).encode()
    if kind == "oversized":
        return "/v1/completions", json.dumps({"model": "m", "prompt": "x" * 1_100_000}).encode()
    if kind in ("stream", "cancelled"):
        return "/v1/completions", json.dumps({"model": "m", "prompt": prefix, "stream": True}).encode()
    if rng.random() < 0.5:
        body = {"model": "m", "messages": [{"role": "system", "content": prefix},
                                           {"role": "user", "content": f"question {rng.random()}"}]}
        return "/v1/chat/completions", json.dumps(body).encode()
    return "/v1/completions", json.dumps({"model": "m", "prompt": prefix + str(rng.random())}).encode()


async def _client(seed: int, url: str, stop_at: float, report: Report, kinds: tuple[str, ...]) -> None:
    rng = random.Random(seed)
    names, weights = zip(*[(k, w) for k, w in KINDS if k in kinds], strict=True)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < stop_at:
            kind = rng.choices(names, weights)[0]
            path, body = _payload(rng, kind)
            report.by_kind[kind] = report.by_kind.get(kind, 0) + 1
            report.requests += 1
            try:
                async with session.post(url + path, data=body, headers={"content-type": "application/json"}) as r:
                    report.statuses[str(r.status)] = report.statuses.get(str(r.status), 0) + 1
                    if kind == "cancelled":
                        await r.content.readany()  # the first chunk, then the client goes away
                        r.close()
                        continue
                    await r.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                key = type(exc).__name__
                report.statuses[key] = report.statuses.get(key, 0) + 1


async def _sampler(picker: Proc, metrics_port: int, t0: float, stop_at: float, interval: float,
                   report: Report) -> None:
    loop = asyncio.get_running_loop()
    while True:
        m, size = await loop.run_in_executor(None, scrape, metrics_port)
        report.samples.append(Sample(
            t=round(time.monotonic() - t0, 1), rss_mib=round(rss_mib(picker.pid), 1),
            index_entries=m.get("inference_extension_prefix_indexer_size", 0.0),
            index_bytes=m.get("prefix_epp_prefix_index_bytes", 0.0),
            inflight=m.get("prefix_epp_inflight_requests", 0.0), open_streams=m.get("prefix_epp_open_streams", 0.0),
            metrics_bytes=size, requests=report.requests))
        if time.monotonic() >= stop_at:
            return
        await asyncio.sleep(min(interval, max(0.0, stop_at - time.monotonic())))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs (0 with fewer than two distinct xs)."""
    return statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0


def verdict(report: Report, idle: dict[str, float], picker_ok: bool) -> None:
    s = report.samples
    n = len(s)
    q2 = [x.rss_mib for x in s[n // 4:n // 2]] or [s[0].rss_mib]
    q4 = [x.rss_mib for x in s[3 * n // 4:]] or [s[-1].rss_mib]
    warm = [x for x in s if x.t >= report.seconds / 5] or s
    report.rss_bytes_per_request = _slope([float(x.requests) for x in warm], [x.rss_mib * 2**20 for x in warm])
    report.checks = {
        "rss_flat": _median(q4) <= _median(q2) * 1.05 + 10,
        "index_within_capacity": max(x.index_entries for x in s) <= 3 * LRU_CAPACITY,
        "metrics_size_flat": warm[-1].metrics_bytes - warm[0].metrics_bytes <= 2048,
        "inflight_back_to_zero": idle.get("inflight", 1) == 0,
        "open_streams_back_to_zero": idle.get("open_streams", 1) == 0,
        "picker_alive_without_internal_errors": picker_ok,
        "traffic_flowed": report.statuses.get("200", 0) > 0,
    }
    report.flat = all(report.checks.values())


def write(report: Report, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    s = report.samples
    lines = [f"# Soak: {report.seconds:.0f} s, {report.concurrency} clients, {report.requests} requests",
             "", "Regenerate: `make soak` (`python -m bench.soak --seconds 1800 --out bench/results/soak`).", "",
             f"Requests by kind: {json.dumps(report.by_kind, sort_keys=True)}  ",
             f"Replies by status: {json.dumps(report.statuses, sort_keys=True)}  ",
             f"gRPC writes to streams Envoy had reset (logged by gRPC, not a picker fault): "
             f"{report.grpc_write_after_reset}  ",
             f"RSS growth after the warm-up (least squares against requests): "
             f"{report.rss_bytes_per_request:.1f} bytes per request", "",
             "| t (s) | requests | RSS (MiB) | index entries | index bytes | in flight | open streams "
             "| /metrics bytes |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    step = max(1, len(s) // 20)
    for x in [*s[::step], s[-1]] if s else []:
        lines.append(f"| {x.t:.0f} | {x.requests} | {x.rss_mib:.1f} | {x.index_entries:.0f} | {x.index_bytes:.0f} "
                     f"| {x.inflight:.0f} | {x.open_streams:.0f} | {x.metrics_bytes} |")
    lines += ["", "| check | ok |", "|---|---|", *[f"| {k} | {v} |" for k, v in report.checks.items()], "",
              f"**flat: {report.flat}**", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


async def soak(seconds: float, concurrency: int, interval: float, out: Path | None,
               kinds: tuple[str, ...] = ALL_KINDS, picker_extra: tuple[str, ...] = ()) -> Report:
    report = Report(seconds=seconds, concurrency=concurrency)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmpdir, \
            soak_stack(Path(tmpdir), picker_extra) as (picker, listen, metrics_port):
        url = f"http://127.0.0.1:{listen}"
        t0 = time.monotonic()
        stop_at = t0 + seconds
        await asyncio.gather(_sampler(picker, metrics_port, t0, stop_at, interval, report),
                             *(_client(i, url, stop_at, report, kinds) for i in range(concurrency)))
        loop = asyncio.get_running_loop()
        idle: dict[str, float] = {}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m, _ = await loop.run_in_executor(None, scrape, metrics_port)
            idle = {"inflight": m.get("prefix_epp_inflight_requests", 0.0),
                    "open_streams": m.get("prefix_epp_open_streams", 0.0)}
            if not any(idle.values()):
                break
            await asyncio.sleep(0.1)
        errors = [line for line in picker.log_text().splitlines() if '"level":"error"' in line or "Traceback" in line]
        report.picker_errors = [line[:500] for line in errors][:20]
        # gRPC core logs ExecuteBatchError when it writes to a stream Envoy has just reset (a client
        # that went away): counted, but not a fault of the picker.
        report.grpc_write_after_reset = sum('"logger":"grpc._cython.cygrpc"' in e and "ExecuteBatchError" in e
                                            for e in errors)
        own = len(errors) - report.grpc_write_after_reset
        verdict(report, idle, picker.alive() and own == 0)
    if out is not None:
        write(report, out)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seconds", type=float, default=1800.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    p.add_argument("--kinds", nargs="+", choices=ALL_KINDS, default=list(ALL_KINDS),
                   help="traffic kinds to send (default: all, by their weights)")
    p.add_argument("--picker-arg", action="append", default=[], help="one more `prefix-epp serve` flag (repeat)")
    args = p.parse_args(argv)
    report = asyncio.run(soak(args.seconds, args.concurrency, args.interval, args.out, tuple(args.kinds),
                              tuple(args.picker_arg)))
    print(json.dumps({"flat": report.flat, "checks": report.checks, "requests": report.requests,
                      "rss_mib_first_last": [report.samples[0].rss_mib, report.samples[-1].rss_mib]}))
    return 0 if report.flat else 1


if __name__ == "__main__":
    sys.exit(main())
