"""The routers under inference-perf, the field's own load generator, beside our generator's figures.

For each repetition (`--repeat`, repetition-major) and router (`--routers`, setups of
`bench.lib.routers`), one run: fresh simulated replicas (cold caches; `--replicas`, real time)
sized like our shared-prefix workload's, the router in front of them exactly as `bench.run`
starts it, one probe request, then inference-perf (`testkit.inference_perf_env`, cached outside
the repository) with the scaled published shared-prefix config (`bench.lib.inference_perf`),
then everything stopped. The replicas, inference-perf and the prefix-epp pickers all count with
one tokenizer (`testkit.inference_perf_env.tokenizer_dir`; module docstring of
`bench.lib.inference_perf`).

Writes bench/results/{name}.json and {name}.md (name "inference-perf", or with --quick
"inference-perf-quick"): every repetition's rows, the mean and min-max of TTFT and of the cached
share per router, and beside them our generator's figures for the same routers from `--beside`
results files of `bench.run` (their shared-prefix rows). Each repetition's rows also go to
runs/{name}-r{k}.json as soon as they exist, so a run that dies keeps what it measured. A router
that fails (or whose inference-perf run has no success) is reported under "Not run" with why.

    python -m bench.inference_perf --repeat 3 --beside bench/results/llmd-shared-prefix.json
    python -m bench.inference_perf --quick --routers prefix-epp random   # ~2 min
    python -m bench.inference_perf --render-only --beside bench/results/llmd-shared-prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.lib import client, llmd
from bench.lib import inference_perf as ip
from bench.lib.oracle import workload_oracle
from bench.lib.report import RESULTS, runs_dir
from bench.lib.routers import KV_EVENT_ROUTERS, PICKER_TRANSPORT, PUBLISHING_ROUTERS, ROUTERS, sim_replicas, start
from bench.lib.runner import sim_settings
from bench.lib.stats import spread
from bench.lib.tables import fmt
from bench.lib.workloads import SharedPrefixParams, shared_prefix
from testkit.inference_perf_env import VERSION, tokenizer_dir
from testkit.inference_perf_env import ensure as ensure_inference_perf

DEFAULT_ROUTERS = ("random", "round-robin", "prefix-epp", "sglang-router", "go-epp", "llm-d", "llm-d-precise")


def run_router(router: str, tmp: Path, scale: ip.Scale, replicas: int, model_dir: Path) -> dict[str, Any]:
    """One run (module docstring): fresh replicas, `router`, inference-perf; its report's row.
    `model_dir`: the tokenizer directory everyone counts with (tokenizer.json + tokenizer_config.json)."""
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = str(model_dir / "tokenizer.json")
    # KV cache sized like bench.run's shared-prefix with the same group count and prompt sizes.
    params = SharedPrefixParams(groups=scale.num_groups, per_group=scale.num_prompts_per_group,
                                system_tokens=scale.system_prompt_len, question_tokens=scale.question_len)
    sim = replace(sim_settings(workload_oracle(shared_prefix(params)), replicas, 1.0),
                  kv_events=router in PUBLISHING_ROUTERS, sim_args=("--tokenizer", tokenizer))
    picker_args = ("--tokenizer", tokenizer) if router in KV_EVENT_ROUTERS else ()
    with sim_replicas(tmp, sim) as pool, start(router, tmp, pool.addresses, picker_args, pool.kv_events) as handle:
        asyncio.run(client.probe(handle.url))
        config = ip.scaled_config(scale, handle.url, model_dir, tmp / "report")
        row = ip.run(ip_env(), config, tmp, scale.duration_s + ip.TIMEOUT_MARGIN_S)
    return row


def ip_env() -> Any:
    return ensure_inference_perf()


# The figures aggregated over repetitions: name -> (row key, sub-key or "").
FIGURES = {"ttft_p50": ("ttft_ms", "p50"), "ttft_p90": ("ttft_ms", "p90"), "ttft_p99": ("ttft_ms", "p99"),
           "tpot_p50": ("tpot_ms", "p50"), "itl_p50": ("itl_ms", "p50"), "requests_per_s": ("requests_per_s", ""),
           "output_tokens_per_s": ("output_tokens_per_s", ""), "cached_share": ("cached_share", ""),
           "failures": ("failures", "")}


def aggregate(reps: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per router: mean and min-max over the repetitions of the figures the table shows."""
    out: dict[str, dict[str, Any]] = {}
    for router in dict.fromkeys(r for rep in reps for r in rep):
        rows = [rep[router] for rep in reps if router in rep]
        out[router] = {"repetitions": len(rows)}
        for name, (key, sub) in FIGURES.items():
            out[router][name] = spread([float(row[key][sub] if sub else row[key]) for row in rows])
    return out


def ours(beside: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Our generator's shared-prefix means per router from bench.run results files."""
    out: dict[str, dict[str, Any]] = {}
    for path in beside:
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        out |= doc.get("results", {}).get("shared-prefix", {})
    return out


def _cell(s: dict[str, float], scale: float = 1.0, digits: int = 0, pct: bool = False) -> str:
    if math.isnan(s["mean"]):
        return "-"
    def f(v: float) -> str:
        return f"{v * 100:.1f}%" if pct else fmt(v * scale, digits)

    return f(s["mean"]) if s["min"] == s["max"] else f"{f(s['mean'])} ({f(s['min'])}-{f(s['max'])})"


def table(agg: dict[str, dict[str, Any]], mine: dict[str, dict[str, Any]]) -> str:
    lines = ["| router | picker TLS / KV events | runs | cached share | TTFT p50 | p90 | p99 | TPOT p50 | ITL p50 "
             "| req/s | output tok/s | failures | ours: hit rate | ours: TTFT p50 | p90 | p99 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for router, a in agg.items():
        tls, events = PICKER_TRANSPORT.get(router, (False, ""))
        picker = f"{'TLS' if tls else 'plaintext'} / {events}" if router in PICKER_TRANSPORT else "-"
        o = mine.get(router)
        ours_cells = (f"{o['hit_rate']:.1%} | {fmt(o['ttft_ms']['p50'])} | {fmt(o['ttft_ms']['p90'])} "
                      f"| {fmt(o['ttft_ms']['p99'])}") if o else "- | - | - | -"
        lines.append(f"| {router} | {picker} | {a['repetitions']} | {_cell(a['cached_share'], pct=True)} "
                     f"| {_cell(a['ttft_p50'])} | {_cell(a['ttft_p90'])} | {_cell(a['ttft_p99'])} "
                     f"| {_cell(a['tpot_p50'], digits=1)} | {_cell(a['itl_p50'], digits=1)} "
                     f"| {_cell(a['requests_per_s'], digits=2)} | {_cell(a['output_tokens_per_s'])} "
                     f"| {_cell(a['failures'])} | {ours_cells} |")
    return "\n".join(lines)


def write(out_dir: Path, name: str, config: dict[str, Any], reps: list[dict[str, dict[str, Any]]],
          beside: Sequence[Path]) -> None:
    agg = aggregate(reps)
    doc = {"config": config, "results": agg, "repetitions": reps}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    s = config["scale"]
    md = [f"inference-perf {config['inference_perf']} (`data.type: shared_prefix`, {s['num_groups']} groups x "
          f"{s['num_prompts_per_group']}, system prompt {s['system_prompt_len']} + question {s['question_len']} "
          f"tokens, {s['output_len']} output tokens, streaming completions, Poisson ladder "
          f"{'/'.join(f'{q:g}' for q in s['ladder_qps'])} QPS x {s['stage_s']} s) against "
          f"{config['replicas']} simulated vLLM replicas (real time, cold per router), "
          f"{len(reps)} repetition(s); times in ms; mean (min-max) over repetitions; cached share = "
          "cached / prompt tokens from the replicas' usage. Arrival times are not seeded by inference-perf. "
          "\"ours\": bench.run's shared-prefix means for the same router (" +
          (", ".join(p.name for p in beside) or "none given") + ").", ""]
    if config.get("llmd_build"):
        b = config["llmd_build"]
        md += [f"llm-d router: {b.get('version', '?')} (commit {b.get('commit', '?')[:8]}).", ""]
    md += [f"Not run: {r}: {why}." for r, why in config.get("not_run", {}).items()]
    md += ["", table(agg, ours(beside)), ""]
    (out_dir / f"{name}.md").write_text("\n".join(md))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", nargs="+", choices=[r for r in ROUTERS if r != "clairvoyant"],
                   default=list(DEFAULT_ROUTERS))
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="30 groups, a 3/6 QPS ladder of 10 s stages")
    p.add_argument("--beside", type=Path, nargs="*", default=[], help="bench.run results files to tabulate beside")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--name")
    p.add_argument("--render-only", action="store_true", help="rewrite {name}.md from {name}.json (and --beside)")
    args = p.parse_args(argv)
    scale = ip.QUICK if args.quick else ip.SCALED
    name = args.name or ("inference-perf-quick" if args.quick else "inference-perf")
    if args.render_only:
        doc = json.loads((args.out_dir / f"{name}.json").read_text())
        write(args.out_dir, name, doc["config"], doc["repetitions"], args.beside)
        print((args.out_dir / f"{name}.md").read_text())
        return 0
    model_dir = tokenizer_dir()
    ensure_inference_perf()
    config: dict[str, Any] = {"inference_perf": VERSION, "scale": asdict(scale), "published": ip.PUBLISHED,
                              "replicas": args.replicas, "routers": args.routers, "not_run": {}}
    routers = list(args.routers)
    if any(r in llmd.SETUPS for r in routers):
        why = llmd.unavailable()
        if why:
            config["not_run"] |= {r: why for r in routers if r in llmd.SETUPS}
            routers = [r for r in routers if r not in llmd.SETUPS]
        else:
            config["llmd_build"] = llmd.build_info()
    reps: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="prefix-epp-inference-perf-") as tmp:
        for k in range(1, args.repeat + 1):
            rep: dict[str, dict[str, Any]] = {}
            reps.append(rep)
            for router in routers:
                if router in config["not_run"]:
                    continue
                t0 = time.monotonic()
                try:
                    rep[router] = run_router(router, Path(tmp) / f"r{k}-{router}", scale, args.replicas, model_dir)
                except (ip.RunFailed, RuntimeError, OSError) as exc:
                    config["not_run"][router] = f"repetition {k}: {str(exc).splitlines()[0][:300]}"
                    print(f"  {router} not run from here on: {config['not_run'][router]}", flush=True)
                    continue
                r = rep[router]
                print(f"  r{k} {router:<14} cached {r['cached_share']:.1%}  TTFT p50 {fmt(r['ttft_ms']['p50'])} "
                      f"p90 {fmt(r['ttft_ms']['p90'])} p99 {fmt(r['ttft_ms']['p99'])} ms  ok {r['successes']} "
                      f"failed {r['failures']}  ({time.monotonic() - t0:.0f} s)", flush=True)
                write(runs_dir(args.out_dir), f"{name}-r{k}", config, [rep], args.beside)
            write(args.out_dir, name, config, reps, args.beside)
    print((args.out_dir / f"{name}.md").read_text())
    return 0 if any(reps) else 1


if __name__ == "__main__":
    sys.exit(main())
