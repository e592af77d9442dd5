"""Real Prometheus text under vLLM's metric names, generated with prometheus_client.

`exposition(...)` returns the load gauges, `vllm:cache_config_info`, `vllm:lora_requests_info`
(several series, the newest last-but-not-least), a decoy gauge whose name extends a wanted one,
and enough histogram noise (vLLM's latency histograms, per engine) to reach ~100 KB, like a real
vLLM /metrics page.
"""

from __future__ import annotations

import functools
import random

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = tuple(round(0.001 * 1.5 ** i, 6) for i in range(30))
NOISE_FAMILIES = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                  "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                  "iteration_tokens_total", "request_max_num_generation_tokens", "request_params_n",
                  "request_params_max_tokens", "inter_token_latency_seconds")


@functools.cache
def noise(engines: int = 3, model: str = "m") -> bytes:
    reg = CollectorRegistry()
    rng = random.Random(0)
    for fam in NOISE_FAMILIES:
        h = Histogram(f"vllm:{fam}", f"Histogram of {fam}", ["model_name", "engine"], buckets=BUCKETS, registry=reg)
        for e in range(engines):
            for _ in range(20):
                h.labels(model, str(e)).observe(rng.expovariate(2.0))
    c = Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name", "engine"], registry=reg)
    c.labels(model, "0").inc(12345)
    decoy = Gauge("vllm:num_requests_waiting_decoy", "Decoy: extends a wanted name", ["reason"], registry=reg)
    decoy.labels("capacity").set(999)
    return generate_latest(reg)


def exposition(waiting: float = 0, running: float = 0, kv: float = 0.0, *, engines: int = 1,
               block_size: int | None = 16, num_gpu_blocks: int = 1000,
               loras: list[tuple[str, str, int, float]] | None = None, model: str = "m",
               with_noise: bool = True) -> bytes:
    """`waiting`/`running` are per engine (summed by the reader); loras: (running, waiting, max, timestamp)."""
    reg = CollectorRegistry()
    gw = Gauge("vllm:num_requests_waiting", "Waiting requests", ["model_name", "engine"], registry=reg)
    gr = Gauge("vllm:num_requests_running", "Running requests", ["model_name", "engine"], registry=reg)
    gk = Gauge("vllm:kv_cache_usage_perc", "KV cache usage", ["model_name", "engine"], registry=reg)
    for e in range(engines):
        gw.labels(model, str(e)).set(waiting)
        gr.labels(model, str(e)).set(running)
        gk.labels(model, str(e)).set(kv)
    if block_size is not None:
        info = Gauge("vllm:cache_config_info", "Cache config", ["block_size", "num_gpu_blocks", "cache_dtype"],
                     registry=reg)
        info.labels(str(block_size), str(num_gpu_blocks), "auto").set(1)
    if loras:
        li = Gauge("vllm:lora_requests_info", "LoRA", ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                   registry=reg)
        for run, wait, mx, ts in loras:
            li.labels(str(mx), run, wait).set(ts)
    text = generate_latest(reg)
    return noise(model=model) + text if with_noise else text


@functools.lru_cache(maxsize=64)
def restrict(page: bytes, names: frozenset[str]) -> bytes:
    """The page as prometheus_client renders it for `?name[]=...`: only the samples named (their
    families' HELP and TYPE lines kept), as vLLM's /metrics answers a filtered scrape."""
    wanted = {n.encode() for n in names}
    out: list[bytes] = []
    comments: list[bytes] = []
    family_kept = False
    for line in page.split(b"\n"):
        if line.startswith(b"# HELP "):
            comments, family_kept = [line], False
        elif line.startswith(b"#"):
            comments.append(line)
        elif line:
            name = line.split(b"{", 1)[0].split(b" ", 1)[0]
            if name in wanted:
                if not family_kept:
                    out.extend(comments)
                    family_kept = True
                out.append(line)
    return b"\n".join(out) + b"\n" if out else b""
