"""Every default of the picker, defined once.

`EppConfig` is the single source of truth: the CLI (`prefix-epp serve`) takes its flag defaults
from it, the EndpointPickerConfig loader fills parameters from it, and the Helm chart's values are
tested against it. Names follow the Go EPP of the Gateway API Inference Extension where a knob
has an equivalent there (`--grpc-port`, `lruCapacityPerServer`, weights 2/2/3, ...).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


@dataclass(frozen=True)
class PrefixConfig:
    """Approximate prefix-cache index (see extproc/prefix/)."""

    block_size_bytes: int = 64  # 16 tokens x ~4 bytes per token, as the Go EPP
    max_prefix_blocks: int = 256  # Go EPP maxPrefixBlocksToMatch
    lru_capacity_per_server: int = 31250  # Go EPP lruCapacityPerServer (~500k tokens of KV)
    auto_tune: bool = True  # size from vllm:cache_config_info when scraped


@dataclass(frozen=True)
class SpillConfig:
    """Hot-spot guard: an endpoint this much busier than the least loaded one is not a candidate.

    load(e) > spill_relative * min_load + spill_absolute  =>  e is skipped (unless all are).
    """

    relative: float = 1.5
    absolute: float = 4.0


@dataclass(frozen=True)
class WeightsConfig:
    prefix: float = 3.0
    queue: float = 2.0
    kv_cache: float = 2.0
    inflight: float = 2.0


@dataclass(frozen=True)
class EppConfig:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"
    secure_serving: bool = True
    cert_path: str = ""
    endpoints: tuple[str, ...] = ()
    pool_name: str = ""
    pool_namespace: str = ""
    pool_group: str = "inference.networking.k8s.io"
    kubeconfig: str = ""
    max_endpoints: int = 1
    explain_decisions: bool = False
    disable_endpoint_subset_filter: bool = False
    refresh_metrics_interval_s: float = 0.05
    metrics_staleness_threshold_s: float = 2.0
    scrape_timeout_s: float = 1.0
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    spill: SpillConfig = field(default_factory=SpillConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    seed: int | None = None


def defaults_of(cls: type) -> dict[str, object]:
    """Field name -> default value of a config dataclass (for CLI help and consistency tests)."""
    out: dict[str, object] = {}
    for f in fields(cls):
        if f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = f.default
    return out
