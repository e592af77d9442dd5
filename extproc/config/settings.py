"""Every default of the picker, defined once.

`EppConfig` is the single source of truth: the CLI (`prefix-epp serve`) takes its flag defaults
from it through the flag table (extproc/config/flags.py), the EndpointPickerConfig loader fills
parameters from it, and the Helm chart's values are tested against it. Names follow the Go EPP
of the Gateway API Inference Extension where a knob has an equivalent there (`--grpc-port`,
`lruCapacityPerServer`, weights 2/2/3, ...).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Literal

from extproc.config.flow_control import FlowControlConfig

MIN_SCORED_ENDPOINTS = 4  # --max-scored-endpoints: a holder, two of the least waiting and a sample at the least


@dataclass(frozen=True)
class PrefixConfig:
    """Approximate prefix-cache index (see extproc/prefix/)."""

    block_size_bytes: int = 64  # 16 tokens x ~4 bytes per token, as the Go EPP
    bytes_per_token: int = 4  # blockSizeTokens -> bytes, and auto-tune (see extproc/scraping/scraper.py)
    # maxPrefixBlocksToMatch: 2048 x 64 bytes = 128 KB (~32k tokens), llm-d's current default. The Go
    # EPP v1.5's 256 (16 KB, ~4k tokens) cannot tell apart prompts that differ after their first 16 KB,
    # e.g. chats sharing a long system prompt, and under-predicts cached tokens of longer prompts.
    # Cost: decision p50 0.89 ms for a 512 KB prompt (0.29 ms at 256), unchanged for 8 KB.
    max_prefix_blocks: int = 2048
    lru_capacity_per_server: int = 31250  # Go EPP lruCapacityPerServer (~500k tokens of KV)
    auto_tune: bool = True  # size from vllm:cache_config_info when scraped


@dataclass(frozen=True)
class AffinityConfig:
    """Affinity hints (extproc/control/affinity.py): requests that share a key count as sharing a prefix.

    The key is the body's `prompt_cache_key` (OpenAI), else the value of `session_header`; it is
    only hashed (never stored, logged or used as a metric label).
    """

    enabled: bool = True  # --affinity-hints
    session_header: str = "x-session-id"  # --session-header: lower-case header name; "" reads no header


@dataclass(frozen=True)
class SpillConfig:
    """Hot-spot guard: an endpoint this much busier than the least loaded one is not a candidate.

    load(e) > spill_relative * min_load + spill_absolute  =>  e is skipped (unless all are).
    """

    relative: float = 1.5
    absolute: float = 4.0


@dataclass(frozen=True)
class BalanceConfig:
    """Bounded reuse (predicted-ttft-scorer, extproc/scheduling/reuse.py): a cached prefix does not
    count on an endpoint where more than `slack` in-flight requests already reuse it and which
    holds more than ceil(factor x (pool load + 1) / endpoints) requests; factor 0: no bound."""

    factor: float = 1.25
    slack: float = 2.0


@dataclass(frozen=True)
class WeightsConfig:
    prefix: float = 5.0  # > queue 2 + inflight 2: a full cache hit outweighs any load difference
    # short of the spill limit (measured: see extproc/scheduling/build.py)
    queue: float = 2.0
    kv_cache: float = 2.0
    inflight: float = 1.0
    unlisted: float = 1.0  # a scorer named in an EndpointPickerConfig profile without a weight


@dataclass(frozen=True)
class CacheAwareConfig:
    """The cache-aware reference scheduler (extproc/scheduling/scorers/cache_aware.py), with
    sglang-router's command-line defaults for its cache_aware policy."""

    cache_threshold: float = 0.3  # a longest match above this share of the prompt's blocks routes there
    balance_abs: int = 64  # imbalanced: max - min in-flight > balance_abs ...
    balance_rel: float = 1.5  # ... and max > balance_rel x min: the least loaded takes the request


SCHEDULERS = ("predicted-ttft", "weighted", "cache-aware")  # built-in profiles (extproc/scheduling/build.py)
NEW_PREFIX_PLACEMENTS = ("homes", "churn")  # LatencyConfig.new_prefix_placement
# Mechanisms of the default path that LatencyConfig.ablate (--ablate, benchmark only) turns off, each
# restoring the simplest behaviour in its place (docs/ablation.md says which, and where each lives).
ABLATIONS = (
    "idle-bound", "waiting-floor", "finish-drain", "decode-contention",  # the backlog (latency.py)
    "bytes-per-token", "bpt-rescale", "calibration-median", "capacity-window-guard",  # calibration.py
    "pool-calibration", "response-end-calibration",
    "first-token-bound", "first-token-twice", "first-token-slot-guard", "first-token-capacity-guard",
    "first-token-readable", "first-token-step-share", "first-token-floor",  # first_token.py
    "slot-wait", "slot-ages", "slot-ceiling", "pool-limit",  # slots.py
    "family-memory", "homes-placement", "fresh-tail-placement", "bounded-reuse", "new-prompt-bound",
    "whole-match", "kv-usage-fullness", "capacity-auto-tune",  # scorers/predicted_ttft.py
    "pins",  # scheduler.py, prefix/generations.py
)


@dataclass(frozen=True)
class LatencyConfig:
    """Predicted-TTFT scheduling (extproc/scheduling/latency.py): priors the engines' metrics refine.

    The priors describe Llama-3-8B (bf16) under vLLM on one H100, as the simulator does
    (prefix_epp_sim/engine.py); each endpoint's `slowdown` is then learned from its TTFT histogram,
    or from the response ends the picker sees where an engine exports none, so a slower GPU or a
    bigger model is measured, not configured. A pool of very different engines sets its priors
    in its EndpointPickerConfig (predicted-ttft-scorer parameters) or with the flags.
    """

    prefill_ms_per_token: float = 0.06  # ~16.7k prompt tokens/s
    overhead_ms: float = 10.0  # one engine step and first-token sampling, paid by every request
    decode_ms_per_seq: float = 0.15  # what each running sequence adds to every engine step
    decode_step_ms: float = 8.0  # one decode step with a single sequence (calibration from response ends)
    step_tokens: int = 8192  # vLLM max_num_batched_tokens: prefill tokens per engine step
    # Copying a prefix onto a replica whose cache is full evicts as many tokens of other prefixes;
    # they are charged at this multiple of their prefill time (0: capacity is ignored). Under
    # pressure an evicted prefix's return evicts another in turn, so one recompute undercounts:
    # 2 measured best (docs/scheduling.md, "Capacity").
    eviction_weight: float = 2.0
    # Where a prompt no candidate holds goes on full caches (extproc/scheduling/scorers/
    # predicted_ttft.py, 3.): "homes", where fewer prefix families live, or "churn", where fewer
    # tokens were recently inserted, so that the new prefix outlives its LRU longest.
    new_prefix_placement: str = "homes"
    # A replica that served the request's affinity key (prompt_cache_key, session header) is
    # credited with this share of the request's uncached prefill: the key says the prompt shares
    # more with that replica's earlier requests than the prefix index can see.
    affinity_credit: float = 0.5
    calibrate: bool = True  # learn each endpoint's slowdown (TTFT histogram, else response ends)
    # Engines from 10x faster to 50x slower than the prior (a CPU build, an old GPU, a 70B model).
    min_slowdown: float = 0.1
    max_slowdown: float = 50.0
    # Benchmark only (--ablate): ABLATIONS names of mechanisms turned off, for measuring what each pays.
    ablate: tuple[str, ...] = ()


@dataclass(frozen=True)
class SaturationConfig:
    """utilization-detector (Go EPP defaults): sheddable requests get 429 while the pool is saturated."""

    queue_depth_threshold: float = 5.0
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold_s: float = 0.2
    headroom: float = 0.0


@dataclass(frozen=True)
class MetricsSourceConfig:
    """metrics-data-source: where each endpoint's model-server metrics are scraped."""

    scheme: str = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True
    # What a model server may report (extproc/scraping/scraper.py): vLLM's page is ~100 KB; a larger
    # body is a failed scrape, never buffered whole.
    max_body_bytes: int = 4 * 1024 * 1024
    # Reported capacities beyond these are capped (logged once per endpoint): they size the prefix
    # indexes. The largest engines in use (a 1B model, fp8 KV cache, 192 GB GPU) hold ~11M tokens,
    # i.e. ~700k blocks of 16; a precise index entry costs ~230 bytes, so 2^20 blocks bound one
    # engine's entries at ~240 MB.
    max_num_gpu_blocks: int = 1 << 20
    max_cache_tokens: int = 1 << 24  # num_gpu_blocks * block_size (16.7M tokens)
    max_block_size: int = 4096  # vLLM uses 1..256 (hybrid models a few hundred more); beyond: unknown
    # Ask only for the families the scraper reads (`?name[]=...`, honoured by prometheus_client's
    # exposition): ~2 KB of vLLM's ~125 KB page (extproc/scraping/scraper.py).
    filter_families: bool = True


@dataclass(frozen=True)
class DiscoveryConfig:
    """Kubernetes list-then-watch loops (extproc/discovery/watch.py)."""

    watch_timeout_s: float = 60.0  # server-side timeoutSeconds, jittered up to 2x; read timeout + min(5 s, T/2)
    request_timeout_s: float = 10.0  # connect and read timeout of LIST requests
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    stop_timeout_s: float = 2.0  # bounded wait for the watch threads at shutdown
    objective_recheck_interval_s: float = 60.0  # probe again for a missing InferenceObjective CRD


# Prefill/decode roles of an endpoint (llm-d's pod label `llm-d.ai/role`, static endpoints'
# --endpoint-roles): prefill-decode serves both stages, `both` is its deprecated alias.
ENDPOINT_ROLES = ("prefill", "decode", "prefill-decode", "both")


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (extproc/scheduling/disagg.py): only with an EndpointPickerConfig
    whose disagg-profile-handler names a prefill decider; these are prefix-based-pd-decider's parameters."""

    # Disaggregate when at least this many prompt tokens are not cached on the chosen decode
    # endpoint; 0: never (llm-d's default, which turns the decider off).
    non_cached_tokens: int = 0
    prompt_tokens: int = 0  # ... and the prompt has at least this many tokens (0: no such gate)


# KV cache tiers an engine reports blocks on (vLLM's `medium` GPU, CPU, STORAGE), fastest first.
KV_TIERS = ("gpu", "cpu", "storage")


@dataclass(frozen=True)
class KVEventsConfig:
    """Precise prefix routing from engine KV-cache events, and its tokenizer (extproc/kvevents/)."""

    prefix_scorer: str = "approximate"  # --prefix-scorer: approximate | precise (implies enabled)
    enabled: bool = False  # --kv-events: subscribe even while the approximate scorer routes (closed loop)
    port: int = 5557  # vLLM's default publisher port, on the endpoint's host; rank r publishes on port + r
    # vLLM's replay ROUTER port on the same host (rank r: + r); 0: no replay, so no port of it can
    # be a rank's publisher port (5558 would be rank 1's beside 5557: extproc/kvevents/ranks.py)
    replay_port: int = 0
    dp_size: int = 1  # data-parallel ranks behind each endpoint's port (extproc/kvevents/ranks.py)
    block_size: int = 16  # engine tokens per block until vllm:cache_config_info or an event says
    index_capacity: int = 32768  # entries per (endpoint, rank) until num_gpu_blocks is scraped
    max_blocks: int = 2048  # leading blocks of a prompt looked up at most (llm-d's default)
    # What a block held on each KV cache tier counts for in the precise match (extproc/kvevents/tiers.py):
    # llm-d's defaults (GPU 1, CPU 0.8; its vLLM storage tier 0.3); weight 0: the tier is not indexed.
    tier_weights: tuple[tuple[str, float], ...] = (("gpu", 1.0), ("cpu", 0.8), ("storage", 0.3))
    speculative_ttl_s: float = 2.0  # decision-time entries count this long (llm-d's default)
    resync_window_s: float = 5.0  # fresh events needed after a resync before precise scoring resumes
    silence_timeout_s: float = 10.0  # routed to, no message since: uncertain (entries kept)
    replay_timeout_s: float = 1.0  # per message read from the replay socket
    max_messages_per_iteration: int = 64  # subscriber work between two yields to the event loop
    # Bounds on what an engine may send, each explained in extproc/kvevents/limits.py.
    max_message_bytes: int = 4 * 1024 * 1024  # ZMQ_MAXMSGSIZE: one step of ~450k tokens
    receive_hwm: int = 64  # ZMQ_RCVHWM, messages per socket; beyond it the publisher queues (vLLM: 100k)
    max_bytes_per_second: int = 4 * 1024 * 1024  # per (endpoint, rank); burst 2 s; beyond: dropped, resync
    max_replay_messages: int = 20000  # taken from one replay (vLLM keeps buffer_steps = 10,000); beyond: resync
    max_replay_bytes: int = 64 * 1024 * 1024  # taken from one replay; beyond: resync
    maintenance_interval_s: float = 0.5  # expire speculative entries, capacities, block size
    tokenizer: str = "builtin"  # builtin | remote | /path/to/tokenizer.json
    tokenize_timeout_s: float = 0.1  # remote: POST /tokenize on an endpoint


@dataclass(frozen=True)
class ProxyTrafficConfig:
    """Envoy-side traffic defaults for the model route: `prefix-epp envoy-config` and the Helm
    chart's BackendTrafficPolicy both use these (tests/deploy checks the chart against them)."""

    # Circuit breaker of the model cluster. Envoy's default of 1,024 concurrent requests per
    # cluster answers 503 (overflow) above that; one Envoy in front of a large vLLM pool holds
    # thousands of long generations at once.
    max_connections: int = 40000
    max_pending_requests: int = 40000
    max_parallel_requests: int = 40000
    max_parallel_retries: int = 1024
    # Retries walk the picker's fallback list (only when max_endpoints > 1, one retry per
    # fallback). Only failures before the request reached a model server or before it answered
    # with headers: a generation is never retried after its response started.
    # `reset`: the upstream reset or closed the connection before any response header (a killed
    # engine on a pooled connection); Envoy never retries once response headers went downstream.
    retry_on: tuple[str, ...] = ("connect-failure", "refused-stream", "reset",
                                 "retriable-status-codes")
    retriable_status_codes: tuple[int, ...] = (500, 502, 503, 504)
    # The picker's --max-endpoints where the gateway takes a fallback list (envoy-config with
    # --endpoints, the chart beside Envoy Gateway): the first choice and one fallback, so a dead
    # first choice costs a retry. ORIGINAL_DST takes a single address (EppConfig.max_endpoints, 1).
    fallback_endpoints: int = 2
    retry_backoff_base_ms: int = 25
    # Whole-request timeout: long generations (minutes of streamed tokens) must not be cut.
    route_timeout_s: int = 3600
    connect_timeout_s: float = 2.0
    # Idle upstream connections are closed after this. vLLM's server (uvicorn) closes a keep-alive
    # connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); Envoy keeps them for 1 h by default
    # and may send a request on one the server is closing: a 503 "connection termination".
    # Closing them first avoids the race.
    upstream_idle_timeout_s: float = 4.0
    # ext_proc message timeout: how long Envoy waits for the picker's answer to one message. A
    # request held by flow control waits in that answer (BUFFERED bodies), so it must exceed every
    # flow-control TTL (extproc/config/flow_control.py `ttl_beyond`); the Go EPP's value.
    ext_proc_message_timeout_s: int = 1000


@dataclass(frozen=True)
class SyncConfig:
    """Peer sync of the prefix index between picker replicas (extproc/sync/)."""

    port: int = 0  # --sync-port: 0 = no sync
    peers: tuple[str, ...] = ()  # --peers host:port,...: static peers (a replica may list itself)
    peer_selector: str = ""  # --peer-selector: Kubernetes label selector of the picker's own pods
    secret_file: str = ""  # --sync-secret-file; else env PREFIX_EPP_SYNC_SECRET
    flush_interval_s: float = 0.02  # local decisions are batched this long before they are sent
    max_batch_records: int = 1024  # records per frame at most
    max_batch_hashes: int = 262144  # hashes per frame at most (2 MB), unless one record has more
    pending_limit: int = 16384  # records waiting for the next flush; beyond: dropped and counted
    peer_queue_frames: int = 256  # frames waiting per peer; beyond: dropped and counted
    warm_timeout_s: float = 5.0  # --sync-warm-timeout: ready after this even if no peer sent a snapshot
    snapshot_chunk_hashes: int = 32768  # hashes per snapshot frame (256 KB)
    # A larger frame (on the wire or inflated) is refused unread; a legitimate one is at most 2.4 MB
    # (extproc/sync/wire.py), and each byte a forger sends costs an HMAC (extproc/sync/admission.py).
    max_frame_bytes: int = 3 * 1024 * 1024
    max_clock_skew_s: float = 120.0  # frames stamped further from our clock are refused
    replay_window: int = 4096  # seqs per origin remembered below the highest (extproc/sync/replay.py)
    max_origins: int = 4096  # sending processes whose replay window is kept
    verify_threads: int = 1  # threads checking received frames (MAC, inflate), off the event loop
    max_hosts: int = 4096  # sending addresses whose failure budget and open calls are kept
    failure_burst: int = 8  # refused frames an address may send before it is throttled ...
    failure_rate_per_s: float = 1.0  # ... and then this many per second
    max_calls_per_host: int = 32  # open sync calls per sending address (a peer pod: one per worker)
    max_calls: int = 256  # open sync calls in all (gRPC maximum_concurrent_rpcs)
    tls: bool = False  # --sync-tls: serve and dial peers over TLS with the --cert-path certificate
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 1.0  # a Hello per second to a peer that is down: cheap, and it rejoins fast


@dataclass(frozen=True)
class DrainConfig:
    """Graceful stop on SIGTERM (extproc/transport/streams.py)."""

    timeout_s: float = 30.0  # --drain-timeout: = the chart's terminationGracePeriodSeconds
    # --drain-readiness-delay: new streams are still served this long after SIGTERM, while the
    # NOT_SERVING readiness reaches the proxies and the kubelet; then the ext_proc port closes.
    readiness_delay_s: float = 5.0
    idle_s: float = 1.0  # with no new streams coming, exit once none has been open for this long


@dataclass(frozen=True)
class OutlierConfig:
    """Ejection of endpoints whose responses fail (extproc/control/health.py), as Envoy's outlier
    detection (consecutive_5xx) does, with the back-off doubling for each ejection in a row."""

    consecutive_failures: int = 3  # --outlier-consecutive-failures (0: never eject)
    base_ejection_s: float = 2.0  # --outlier-ejection-time
    max_ejection_s: float = 30.0


@dataclass(frozen=True)
class EppConfig:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"  # ext_proc; and every listener whose own address is empty
    metrics_bind_address: str = ""  # /metrics; "" = bind_address
    health_bind_address: str = ""  # gRPC health port; "" = bind_address
    sync_bind_address: str = ""  # peer-sync port; "" = bind_address
    secure_serving: bool = True
    cert_path: str = ""
    client_ca_file: str = ""  # --client-ca-file: require a client certificate signed by this CA
    endpoints: tuple[str, ...] = ()
    # --endpoint-roles IP:PORT=ROLE,...: the prefill/decode role of static endpoints (ENDPOINT_ROLES);
    # an endpoint not named is unlabelled (a decode endpoint, as llm-d counts it).
    endpoint_roles: tuple[str, ...] = ()
    pool_name: str = ""
    pool_namespace: str = ""
    pool_group: str = "inference.networking.k8s.io"
    kubeconfig: str = ""
    max_endpoints: int = 1
    # Above this many candidates a decision scores a shortlist of them (extproc/scheduling/shortlist.py;
    # 0: every candidate): scoring is ~1.5 us of Python per endpoint, most of a request's CPU at 256.
    max_scored_endpoints: int = 32  # or 0; at least MIN_SCORED_ENDPOINTS
    explain_decisions: bool = False
    max_request_body_bytes: int = 64 * 1024 * 1024  # the picker buffers the body: bound it (413 above)
    # Share of routed requests whose response body the picker asks for (the closed loop of
    # extproc/control/usage.py). A sampled streamed answer costs a round trip per chunk, ~0.07 ms of picker
    # CPU per token (bench/overhead.py: ~37 ms for 500 tokens against ~2 ms for a request), so 0.2 %
    # adds ~0.07 ms to the average 500-token request and still gives 720 samples an hour at 100 req/s.
    usage_sample_rate: float = 0.002
    # All streams' buffered bodies together (429 + Retry-After beyond): a quarter of the chart's 2 GiB
    # memory limit (extproc/transport/body_budget.py).
    max_buffered_bytes: int = 512 * 1024 * 1024
    # From the request headers to the body's end; past it 408 and the stream's hold is released
    # (extproc/transport/body_intake.py). Generous for a 64 MiB body on a slow link, short enough
    # that a stalled or trickled body cannot hold budget and a stream for long.
    request_body_timeout_s: float = 30.0
    # Honour the conformance tests' test-epp-endpoint-selection header (a client then picks its
    # endpoint); off, the header is ignored and counted (extproc/transport/control_headers.py).
    test_endpoint_selection: bool = False
    # Concurrent grpc.health.v1 Watch streams served; more get RESOURCE_EXHAUSTED (Check is unbounded
    # in number but answers at once). Kubelet and Envoy use Check.
    max_health_watches: int = 64
    disable_endpoint_subset_filter: bool = False
    refresh_metrics_interval_s: float = 0.05
    # Scrapes per second for the whole pool (extproc/scraping/plan.py): beyond 25 endpoints at the
    # 50 ms interval each endpoint's interval grows to endpoints / budget (512 ms at 256). A filtered
    # scrape costs ~0.35 ms of CPU (bench/results/scale.md: 0.18 core at 256 endpoints), so scraping
    # stays under ~0.2 core whatever the pool's size. 0: unbounded (every endpoint at the interval).
    scrape_budget_per_s: float = 500.0
    # Share of an engine's server time the pickers' scrapes may take, all pickers together
    # (extproc/scraping/plan.py): an endpoint whose scrape takes c seconds is scraped at most every
    # c x pickers / share (at most 1 s apart). vLLM 0.32 renders its whole page, 7-8 ms on the
    # development machine, so one picker scrapes it every ~370 ms; a 1 ms page keeps 50 ms. 0: no floor.
    scrape_engine_share: float = 0.02
    metrics_staleness_threshold_s: float = 2.0
    scrape_timeout_s: float = 1.0
    config_file: str = ""  # EndpointPickerConfig YAML (extproc/scheduling/config_loader.py)
    config_text: str = ""
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    spill: SpillConfig = field(default_factory=SpillConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    # Built-in profile when no EndpointPickerConfig gives one (extproc/scheduling/build.py):
    # predicted-ttft (least predicted time to first token), weighted (the Go EPP's weighted sum) or
    # cache-aware (sglang-router's cache_aware policy, the reference it is compared with).
    scheduler: str = "predicted-ttft"
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    # Flow control (extproc/flowcontrol/): off unless an EndpointPickerConfig's featureGates lists
    # flowControl; its `flowControl:` section (extproc/config/flow_control.py) fills this.
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)
    metrics_source: MetricsSourceConfig = field(default_factory=MetricsSourceConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    workers: int = 1  # --workers: picker processes sharing the ext_proc port (extproc/runtime/workers.py)
    seed: int | None = None
    # Model names that keep their own metric label (besides those the engines report); any other
    # client-chosen name is counted as "other" (extproc/telemetry/labels.py).
    model_names: tuple[str, ...] = ()

    def listen_address(self, listener: Literal["metrics", "health", "sync"]) -> str:
        """The address a listener binds: its own flag's, else --bind-address."""
        own: str = getattr(self, f"{listener}_bind_address")
        return own or self.bind_address


def defaults_of(cls: type) -> dict[str, object]:
    """Field name -> default value of a config dataclass (for CLI help and consistency tests)."""
    out: dict[str, object] = {}
    for f in fields(cls):
        if f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = f.default
    return out
