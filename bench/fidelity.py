"""How close the simulator comes to real vLLM: the same request sequences on both, side by side.

    python -m bench.fidelity calibrate     # ~2 min: one real engine -> bench/results/fidelity-profile.json
    python -m bench.run --backend sim-vllm --workloads shared-prefix multi-turn cache-pressure \\
        --routers random round-robin least-request prefix-epp prefix-epp-precise sglang-router \\
        --repeat 3 --name bench-sim-vllm   # the vLLM-sized workloads on 2 simulated engines
    python -m bench.fidelity table         # bench/results/fidelity.{md,json}

1. `calibrate` starts one engine of the real-vLLM rig (`testkit.vllm`: vLLM's CPU build, the tiny
   model, one core) and measures it alone, one request at a time, the prefix cache reset before
   each cold request: for prompts of LENGTHS tokens (TRIALS each), the TTFT cold and again warm
   (the same prompt: everything but the last block cached), and the decode time per output token
   at 1 and DECODE_BATCH concurrent sequences. A least-squares line through the TTFTs against
   uncached tokens, cold and warm together, gives the prefill cost per uncached token (slope) and
   the fixed cost of a first token (intercept: the step, plus what the API server does per
   request, which a warm request pays too). The simulator's cost model (`prefix_epp_sim.engine`)
   maps onto it as: inter_token_latency = the single-sequence decode time; decode_time_per_seq =
   the growth per extra sequence; prefill_time_per_token = the slope; prefill_overhead = the
   intercept minus inter_token_latency (the rest of a first token's fixed cost).
2. `bench.run --backend sim-vllm` replays the vLLM-sized workloads (same seeds, so the same
   request sequences as `--backend vllm`) on 2 simulated engines with the engines' cache (512
   blocks of 32 tokens), that profile, and the model's tokenizer.json (`prefix-epp sim
   --tokenizer`: the simulator counts and hashes the engine's real token ids).
3. `table` puts each (workload, router) of bench-vllm-1201.json (the real run of 12-01, beside which the
   profile was fitted) and bench-sim-vllm.json side by side:
   hit rate (the real engines' counters; the simulator's usage) and TTFT p50/p90, with the
   simulator's relative error, and flags where it misses the bounds the comparison is held to
   (HIT_BOUND, TTFT_BOUND).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.lib.client import RequestResult, send
from bench.lib.report import RESULTS
from bench.lib.sim_vllm import PROFILE, load_profile
from bench.lib.vllm_backend import warm
from bench.lib.workloads import MODEL
from testkit.tiny_model import TEXT
from testkit.vllm import BLOCK_SIZE, NUM_BLOCKS, Engine, engines

LENGTHS = (256, 768, 1536, 2304, 3072)  # prompt tokens (the vLLM-sized workloads send 2.3-3.2k)
TRIALS = 3
DECODE_TOKENS = 48
DECODE_BATCH = 4
HIT_BOUND, TTFT_BOUND = 0.10, 0.25  # relative error the simulator is held to (hit rate, TTFT p50)
REAL, SIM = "bench-vllm-1201", "bench-sim-vllm"  # the real run the simulator was fitted beside (12-01)


def prompt_of(tokens: int, salt: int) -> str:
    """About `tokens` tokens of the tiny model (one per common word), unique per salt from the start."""
    words = TEXT.split()
    rng = random.Random(salt)
    return f"{salt} " + " ".join(rng.choice(words) for _ in range(tokens - 2))


async def timed(url: str, prompt: str, max_tokens: int) -> RequestResult:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
               "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = RequestResult(session=0, turn=0, label="calibrate", sent_s=0.0, lag_s=0.0)
    async with aiohttp.ClientSession() as session:
        await send(session, url, payload, result, 1.0)
    if not result.ok or result.ttft_s is None:
        raise RuntimeError(f"calibration request failed: {result.status} {result.error}")
    return result


def decode_ms(r: RequestResult) -> float:
    """Mean time per output token after the first."""
    assert r.ttft_s is not None
    return (r.e2e_s - r.ttft_s) * 1000 / max(1, r.completion_tokens - 1)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


async def measure(engine: Engine) -> dict[str, Any]:
    url = f"{engine.url}/v1/completions"
    cold: list[tuple[int, float]] = []
    warm_: list[tuple[int, float]] = []
    for length in LENGTHS:
        for trial in range(TRIALS):
            engine.reset_prefix_cache()
            text = prompt_of(length, 1000 * length + trial)
            first = await timed(url, text, 2)
            again = await timed(url, text, 2)
            assert first.ttft_s is not None and again.ttft_s is not None
            cold.append((first.prompt_tokens, first.ttft_s * 1000))
            warm_.append((again.prompt_tokens - again.cached_tokens, again.ttft_s * 1000))
    single = [decode_ms(await timed(url, prompt_of(64, 7 + i), DECODE_TOKENS)) for i in range(TRIALS)]
    batched: list[float] = []
    for i in range(TRIALS):
        rs = await asyncio.gather(*(timed(url, prompt_of(64, 100 * i + j), DECODE_TOKENS)
                                    for j in range(DECODE_BATCH)))
        batched.append(statistics.fmean(decode_ms(r) for r in rs))
    return {"cold_ttft_ms": cold, "warm_ttft_ms": warm_, "decode_ms_1": single,
            f"decode_ms_{DECODE_BATCH}": batched}


def profile_of(m: dict[str, Any]) -> dict[str, Any]:
    """The simulator's cost model fitted to the measurements (module docstring, step 1)."""
    points = [*m["cold_ttft_ms"], *m["warm_ttft_ms"]]  # (uncached tokens, TTFT ms)
    intercept, slope = fit_line([float(n) for n, _ in points], [t for _, t in points])
    itl = statistics.median(m["decode_ms_1"])
    per_seq = max(0.0, (statistics.median(m[f"decode_ms_{DECODE_BATCH}"]) - itl) / (DECODE_BATCH - 1))
    return {"inter_token_latency": round(itl, 3), "decode_time_per_seq": round(per_seq, 3),
            "prefill_time_per_token": round(max(0.0, slope), 5),
            "prefill_overhead": round(max(0.0, intercept - itl), 3),
            "warm_ttft_ms_median": round(statistics.median(t for _, t in m["warm_ttft_ms"]), 2),
            "block_size": BLOCK_SIZE, "kv_cache_blocks": NUM_BLOCKS}


def calibrate(out: Path = PROFILE) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="prefix-epp-fidelity-") as tmp, \
            engines(Path(tmp), 1, served_model_name=MODEL) as (engine,):
        warm(engine)
        m = asyncio.run(measure(engine))
    doc = {"profile": profile_of(m), "measurements": m,
           "how": "one engine alone on one core (testkit.vllm), one request at a time: bench/fidelity.py"}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _rel(sim: float, real: float) -> float:
    return (sim - real) / real if real else math.nan


def rows(real: dict[str, Any], sim: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, router) both files have: real and simulated figures and the errors."""
    out = []
    for wname, routers in real["results"].items():
        for router, r in routers.items():
            s = sim["results"].get(wname, {}).get(router)
            if s is None:
                continue
            real_hit = r.get("engine_hit_rate", r["hit_rate"])
            row = {"workload": wname, "router": router, "hit_real": real_hit, "hit_sim": s["hit_rate"],
                   "hit_err": s["hit_rate"] - real_hit}
            for q in ("p50", "p90"):
                row[f"ttft_{q}_real"], row[f"ttft_{q}_sim"] = r["ttft_ms"][q], s["ttft_ms"][q]
                row[f"ttft_{q}_err"] = _rel(s["ttft_ms"][q], r["ttft_ms"][q])
            row["hit_within"] = abs(row["hit_err"]) <= HIT_BOUND * real_hit
            row["ttft_within"] = abs(row["ttft_p50_err"]) <= TTFT_BOUND
            out.append(row)
    return out


def markdown(table: list[dict[str, Any]], profile: dict[str, Any]) -> str:
    lines = ["# Simulator fidelity: the same sequences on real vLLM and on the simulator", "",
             f"Real: `{REAL}.json` (2 vLLM CPU engines). Simulated: `{SIM}.json` (2 simulated engines, "
             f"{profile['kv_cache_blocks']} blocks x {profile['block_size']} tokens, the model's tokenizer, the "
             f"profile fitted by `python -m bench.fidelity calibrate`: inter_token_latency "
             f"{profile['inter_token_latency']} ms, decode_time_per_seq {profile['decode_time_per_seq']} ms, "
             f"prefill_time_per_token {profile['prefill_time_per_token']} ms, prefill_overhead "
             f"{profile['prefill_overhead']} ms). Means of the repetitions in each file. Error: hit rate in "
             f"points (bound {HIT_BOUND:.0%} of the real figure), TTFT relative (bound {TTFT_BOUND:.0%} on p50).",
             "", "| workload | router | hit rate real | sim | error | TTFT p50 real | sim | error "
             "| TTFT p90 real | sim | error | hit rate within | TTFT p50 within |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in table:
        lines.append(f"| {r['workload']} | {r['router']} | {r['hit_real']:.1%} | {r['hit_sim']:.1%} | "
                     f"{r['hit_err'] * 100:+.1f} pt | {r['ttft_p50_real']:.0f} | {r['ttft_p50_sim']:.0f} | "
                     f"{r['ttft_p50_err']:+.0%} | {r['ttft_p90_real']:.0f} | {r['ttft_p90_sim']:.0f} | "
                     f"{r['ttft_p90_err']:+.0%} | {'yes' if r['hit_within'] else 'no'} | "
                     f"{'yes' if r['ttft_within'] else 'no'} |")
    return "\n".join(lines) + "\n"


def table(results: Path = RESULTS) -> list[dict[str, Any]]:
    real = json.loads((results / f"{REAL}.json").read_text())
    sim = json.loads((results / f"{SIM}.json").read_text())
    out = rows(real, sim)
    profile = load_profile(results / PROFILE.name)
    (results / "fidelity.json").write_text(json.dumps({"profile": profile, "rows": out}, indent=1) + "\n")
    (results / "fidelity.md").write_text(markdown(out, profile))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("step", choices=("calibrate", "table"))
    args = p.parse_args(argv)
    if args.step == "calibrate":
        doc = calibrate()
        print(json.dumps(doc["profile"], indent=1))
    else:
        for r in table():
            print(f"{r['workload']:<15} {r['router']:<20} hit {r['hit_real']:.1%} / {r['hit_sim']:.1%}  "
                  f"TTFT p50 {r['ttft_p50_real']:.0f} / {r['ttft_p50_sim']:.0f} ms ({r['ttft_p50_err']:+.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
