"""Every knob of the model-server simulator, with its default, in one frozen dataclass.

The CLI (`prefix_epp_sim.cli`) reads its defaults from `SimConfig` and builds one from the parsed
arguments; tests and benchmarks build one directly. Times in the cost model are milliseconds
of *model* time, the same unit as llm-d-inference-sim's flags; `time_scale` divides every
sleep, never a cost.

Defaults describe an 8B dense model (Llama-3-8B class, bf16) on one H100-80GB served by vLLM V1;
`prefix_epp_sim.engine` explains the cost-model numbers. The KV-cache size follows from the same
assumption: about 52 GB left for KV after weights and activations at 0.9 GPU-memory utilisation,
128 KiB of KV per token (32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes), so ~400k tokens
= 25,000 blocks of 16.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Literal

KVEventsEncoding = Literal["array", "map"]
KV_CONNECTORS = ("", "nixl", "shared-storage")  # vLLM's NixlConnector and ExampleConnector (prefix_epp_sim.kv_transfer)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
MetricsSurface = Literal["vllm", "minimal"]
COSTS = ("inter_token_latency", "decode_time_per_seq", "prefill_time_per_token", "prefill_overhead")


@dataclass(frozen=True)
class SimConfig:
    # Serving surface
    host: str = "127.0.0.1"
    port: int = 8000  # replica i listens on port + i (or on host + i with spread_hosts)
    replicas: int = 1
    spread_hosts: bool = False  # replica i binds the IPv4 address host + i, all on `port`
    model: str = "sim-model"
    served_model_name: tuple[str, ...] = ()  # empty: serve under `model`
    max_model_len: int = 32768
    default_max_tokens: int = 16
    max_loras: int = 1
    lora_modules: tuple[str, ...] = ()
    # A model's tokenizer.json (its chat template beside it) to count and hash prompts with, so
    # the simulator sees the token ids a real engine of that model would; "": the builtin tokenizer
    tokenizer: str = ""

    # KV cache
    block_size: int = 16
    kv_cache_blocks: int = 25_000

    # Scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    stream_interval: int = 1  # decode steps between streamed deltas, as vLLM's --stream-interval

    # Cost model (milliseconds of model time)
    inter_token_latency: float = 8.0  # one decode step with a single sequence
    decode_time_per_seq: float = 0.15  # added per extra sequence in a step
    prefill_time_per_token: float = 0.06  # per uncached prompt token computed in a step
    prefill_overhead: float = 2.0  # added to a step that computes any prefill
    time_scale: float = 1.0
    # Heterogeneous pools: the last `slow_replicas` replicas pay every cost `slow_factor` times
    slow_replicas: int = 0
    slow_factor: float = 4.0

    # What /metrics exports: "vllm" (vLLM V1's families), or "minimal" (running, waiting, KV usage
    # and the cache config only: no TTFT histogram, no token counters, as many non-vLLM engines)
    metrics_surface: MetricsSurface = "vllm"

    # Benchmark reference: a front on this port routes every request to the replica with the least
    # predicted TTFT, from the replicas' true state (prefix_epp_sim.clairvoyant); None: no front, 0: any port
    clairvoyant_port: int | None = None

    # Faults
    failure_rate: float = 0.0  # fraction of inference requests answered HTTP 500
    startup_delay: float = 0.0  # seconds (wall) before /health turns 200
    seed: int = 0

    # KV events (vLLM --kv-events-config equivalent)
    kv_events: bool = True
    kv_events_endpoint: str | None = None  # single replica; default tcp://<host>:<port_base>
    kv_events_port_base: int = 5557  # replica i publishes on port_base + i; 0 = ephemeral
    kv_events_replay_endpoint: str | None = None  # single replica; default: replay off
    kv_events_replay_port_base: int | None = None  # replica i replays on base + i; 0 = ephemeral
    kv_events_topic: str | None = None  # default kv@<host:port>@<served model name>
    kv_events_encoding: KVEventsEncoding = "map"  # vLLM 0.32's (prefix_epp_sim.kv_publisher)
    kv_events_connect: bool = False  # connect the PUB socket to a central SUB instead of binding
    kv_events_buffer_steps: int = 10_000  # batches kept for replay
    kv_events_hwm: int = 100_000

    # KV transfer between engines (vLLM's --kv-transfer-config; prefix_epp_sim.kv_transfer): "" (none),
    # "nixl" or "shared-storage"; the role, and the directory shared-storage replicas share
    kv_connector: str = ""
    kv_role: str = "kv_both"
    kv_shared_storage_path: str = ""

    def __post_init__(self) -> None:
        positive = ("port", "replicas", "max_model_len", "block_size", "kv_cache_blocks", "max_num_seqs",
                    "max_num_batched_tokens", "stream_interval", "max_loras", "kv_events_buffer_steps",
                    "default_max_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be within [0, 1]")
        costs = ("inter_token_latency", "decode_time_per_seq", "prefill_time_per_token", "prefill_overhead",
                 "startup_delay")
        for name in costs:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_model_len > self.kv_cache_blocks * self.block_size:
            # vLLM refuses to start when one maximal sequence cannot fit in the cache.
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV cache "
                f"({self.kv_cache_blocks} blocks x {self.block_size} tokens)")
        if not 0 <= self.slow_replicas <= self.replicas or self.slow_factor <= 0:
            raise ValueError("slow_replicas must be within [0, replicas] and slow_factor > 0")
        if self.metrics_surface not in ("vllm", "minimal"):
            raise ValueError("metrics_surface must be 'vllm' or 'minimal'")
        if self.kv_events_encoding not in ("array", "map"):
            raise ValueError("kv_events_encoding must be 'array' or 'map'")
        if self.kv_connector not in KV_CONNECTORS or self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_connector must be one of {KV_CONNECTORS[1:]} and kv_role one of {KV_ROLES}")
        if (self.kv_connector == "shared-storage") != bool(self.kv_shared_storage_path):
            raise ValueError("the shared-storage connector needs a shared_storage_path, and only it takes one")
        if self.replicas > 1 and (self.kv_events_replay_endpoint
                                  or (self.kv_events_endpoint and not self.kv_events_connect)):
            raise ValueError("with --replicas > 1, use the KV-events port bases (or --kv-events-connect)")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names a request's `model` may use for the base model (the first is canonical)."""
        return self.served_model_name or (self.model,)

    @property
    def lora_names(self) -> tuple[str, ...]:
        return tuple(parse_lora_module(m) for m in self.lora_modules)

    def for_replica(self, index: int) -> SimConfig:
        """Replica `index`'s configuration: every cost `slow_factor` times for the slow ones."""
        if not self.slow_replicas or index < self.replicas - self.slow_replicas or self.slow_factor == 1:
            return self
        return self.replace(**{name: getattr(self, name) * self.slow_factor for name in COSTS})

    def replace(self, **changes: object) -> SimConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def parse_lora_module(spec: str) -> str:
    """Adapter name from a `--lora-modules` item: `name`, `name=path` (vLLM) or `{"name": ...}` (llm-d)."""
    text = spec.strip()
    if text.startswith("{"):
        value = json.loads(text)
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"LoRA module {spec!r} needs a string 'name'")
        return name
    name = text.split("=", 1)[0].strip()
    if not name:
        raise ValueError(f"empty LoRA module name in {spec!r}")
    return name
