"""`prefix-epp serve`: run the picker. Flag names and defaults follow the Go EPP where they exist;
every default comes from EppConfig (extproc/config/settings.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import replace
from typing import Any

from extproc.config.settings import (
    NEW_PREFIX_PLACEMENTS,
    SCHEDULERS,
    AffinityConfig,
    DrainConfig,
    EppConfig,
    KVEventsConfig,
    LatencyConfig,
    PrefixConfig,
    SpillConfig,
    SyncConfig,
    WeightsConfig,
)
from extproc.core import logs

_D = EppConfig()
_P = PrefixConfig()
_S = SpillConfig()
_W = WeightsConfig()
_K = KVEventsConfig()
_Y = SyncConfig()
_DR = DrainConfig()
_L = LatencyConfig()
_A = AffinityConfig()


def parse_bool(value: str | bool) -> bool:
    """Go-style booleans: `--flag`, `--flag=true`, `--flag=false`."""
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in ("1", "t", "true", "yes", "on"):
        return True
    if lowered in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def _bool_flag(p: argparse._ArgumentGroup, name: str, default: bool, help_text: str) -> None:
    p.add_argument(name, type=parse_bool, nargs="?", const=True, default=default, metavar="BOOL",
                   help=help_text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving")
    g.add_argument("--grpc-port", type=int, default=_D.grpc_port, help="ext_proc gRPC port")
    g.add_argument("--grpc-health-port", type=int, default=_D.grpc_health_port, help="gRPC health port")
    g.add_argument("--metrics-port", type=int, default=_D.metrics_port, help="Prometheus /metrics port (0: off)")
    g.add_argument("--bind-address", default=_D.bind_address, help="address the servers listen on")
    _bool_flag(g, "--secure-serving", _D.secure_serving, "serve ext_proc over TLS")
    g.add_argument("--cert-path", default=_D.cert_path,
                   help="directory with tls.crt and tls.key; self-signed when empty")
    g = p.add_argument_group("discovery")
    g.add_argument("--endpoints", default="", help="static endpoints ip:port,ip:port (instead of a pool)")
    g.add_argument("--pool-name", default=_D.pool_name, help="InferencePool to serve")
    g.add_argument("--pool-namespace", default=_D.pool_namespace, help="its namespace (env NAMESPACE)")
    g.add_argument("--pool-group", default=_D.pool_group, help="InferencePool API group")
    g.add_argument("--kubeconfig", default=_D.kubeconfig, help="kubeconfig path (in-cluster config if empty)")
    g = p.add_argument_group("model-server metrics")
    g.add_argument("--refresh-metrics-interval", type=duration, default=_D.refresh_metrics_interval_s,
                   metavar="DURATION", help="scrape interval per endpoint, e.g. 50ms or 0.05 (0: no scraping)")
    g.add_argument("--metrics-staleness-threshold", type=duration, default=_D.metrics_staleness_threshold_s,
                   metavar="DURATION", help="older scrapes count as stale: saturated for scorers, "
                   "left out of the pool gauges")
    g = p.add_argument_group("scheduling")
    g.add_argument("--config-file", default=_D.config_file, help="EndpointPickerConfig YAML file")
    g.add_argument("--config-text", default=_D.config_text, help="EndpointPickerConfig YAML text")
    g.add_argument("--max-endpoints", type=int, default=_D.max_endpoints,
                   help="endpoints returned per request, best first (>1: fallbacks)")
    g.add_argument("--max-request-body-bytes", type=int, default=_D.max_request_body_bytes,
                   help="larger request bodies are refused with 413 (the picker buffers the body)")
    g.add_argument("--usage-sample-rate", type=float, default=_D.usage_sample_rate,
                   help="share of requests whose response body the picker asks for, to compare predicted "
                        "and reported cached tokens (0..1; needs a gateway that honours mode_override)")
    g.add_argument("--max-buffered-bytes", type=int, default=_D.max_buffered_bytes,
                   help="request-body bytes buffered by all streams together; new requests beyond it get 429")
    _bool_flag(g, "--explain-decisions", _D.explain_decisions,
               "add an x-prefix-epp-decision response header with the scores")
    _bool_flag(g, "--disable-endpoint-subset-filter", _D.disable_endpoint_subset_filter,
               "ignore the proxy's envoy.lb.subset_hint")
    g.add_argument("--prefix-block-size", type=int, default=_P.block_size_bytes,
                   help="prefix block size in bytes (~4 bytes per token)")
    g.add_argument("--prefix-max-blocks", type=int, default=_P.max_prefix_blocks,
                   help="blocks of a prompt considered at most")
    g.add_argument("--prefix-lru-capacity", type=int, default=_P.lru_capacity_per_server,
                   help="prefix index capacity per endpoint, in blocks")
    g.add_argument("--scheduler", choices=SCHEDULERS, default=_D.scheduler,
                   help="built-in profile: least predicted time to first token, or the weighted sum of "
                        "prefix, queue, KV-cache and in-flight scorers behind the hot-spot spill filter")
    g.add_argument("--prefill-ms-per-token", type=float, default=_L.prefill_ms_per_token,
                   help="predicted-ttft prior: prefill milliseconds per prompt token (learned per endpoint "
                        "from its TTFT histogram)")
    g.add_argument("--eviction-weight", type=float, default=_L.eviction_weight,
                   help="predicted-ttft: multiple of the prefill time charged for each token of other prefixes "
                        "a copy evicts from a full cache (0: ignore capacity)")
    g.add_argument("--new-prefix-placement", choices=NEW_PREFIX_PLACEMENTS, default=_L.new_prefix_placement,
                   help="predicted-ttft: on full caches, place a prompt no endpoint holds where fewer prefix "
                        "families live (homes) or where fewer tokens were recently inserted (churn)")
    g.add_argument("--affinity-credit", type=float, default=_L.affinity_credit,
                   help="predicted-ttft: an endpoint that served the request's affinity key is credited with "
                        "this share of the request's uncached prefill time")
    _bool_flag(g, "--ttft-calibration", _L.calibrate,
               "learn each endpoint's slowdown from its vllm:time_to_first_token_seconds histogram")
    _bool_flag(g, "--affinity-hints", _A.enabled, "treat requests with the same prompt_cache_key (else the same "
               "--session-header value) as sharing a prefix; keys are only hashed, never logged")
    g.add_argument("--session-header", default=_A.session_header, metavar="NAME",
                   help="request header whose value is an affinity hint when the body has no prompt_cache_key "
                   "(empty: none)")
    g.add_argument("--spill-relative", type=float, default=_S.relative,
                   help="hot-spot guard: skip endpoints with load > R * min load + A")
    g.add_argument("--spill-absolute", type=float, default=_S.absolute, help="the A of --spill-relative")
    g.add_argument("--prefix-weight", type=float, default=_W.prefix, help="weight of the prefix scorer")
    g.add_argument("--inflight-weight", type=float, default=_W.inflight, help="weight of the in-flight scorer")
    g.add_argument("--seed", type=int, default=None, help="seed for random tie-breaks (tests)")
    g.add_argument("--model-names", default="",
                   help="comma-separated model names that keep their own metric label (the engines' own "
                   "model names always do; any other name is counted as 'other')")
    _add_kv_events_arguments(p)
    _add_ha_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def duration(value: str) -> float:
    """Seconds from a Go duration ("50ms", "2s") or a plain number of seconds."""
    from extproc.scheduling.config_loader import ConfigError, parse_duration

    try:
        return float(value)
    except ValueError:
        pass
    try:
        return parse_duration(value.strip(), "duration")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"not a duration: {value!r} (e.g. 50ms, 2s)") from None


def config_from_args(args: argparse.Namespace) -> EppConfig:
    endpoints = tuple(e for e in args.endpoints.split(",") if e.strip()) if args.endpoints else ()
    return replace(
        _D,
        grpc_port=args.grpc_port, grpc_health_port=args.grpc_health_port, metrics_port=args.metrics_port,
        bind_address=args.bind_address, secure_serving=args.secure_serving, cert_path=args.cert_path,
        endpoints=endpoints, pool_name=args.pool_name, pool_namespace=args.pool_namespace,
        pool_group=args.pool_group, kubeconfig=args.kubeconfig, max_endpoints=args.max_endpoints,
        max_request_body_bytes=args.max_request_body_bytes, usage_sample_rate=args.usage_sample_rate,
        max_buffered_bytes=args.max_buffered_bytes,
        explain_decisions=args.explain_decisions, disable_endpoint_subset_filter=args.disable_endpoint_subset_filter,
        refresh_metrics_interval_s=args.refresh_metrics_interval,
        metrics_staleness_threshold_s=args.metrics_staleness_threshold,
        config_file=args.config_file, config_text=args.config_text,
        prefix=replace(_P, block_size_bytes=args.prefix_block_size, max_prefix_blocks=args.prefix_max_blocks,
                       lru_capacity_per_server=args.prefix_lru_capacity),
        affinity=replace(_A, enabled=args.affinity_hints, session_header=args.session_header.strip().lower()),
        spill=replace(_S, relative=args.spill_relative, absolute=args.spill_absolute),
        weights=replace(_W, prefix=args.prefix_weight, inflight=args.inflight_weight),
        scheduler=args.scheduler,
        latency=replace(_L, prefill_ms_per_token=args.prefill_ms_per_token, eviction_weight=args.eviction_weight,
                        new_prefix_placement=args.new_prefix_placement,
                        affinity_credit=args.affinity_credit, calibrate=args.ttft_calibration),
        seed=args.seed,
        model_names=tuple(n.strip() for n in args.model_names.split(",") if n.strip()),
        kv_events=_kv_events_from_args(args),
        sync=replace(_Y, port=args.sync_port, peers=tuple(x.strip() for x in args.peers.split(",") if x.strip()),
                     peer_selector=args.peer_selector, secret_file=args.sync_secret_file,
                     warm_timeout_s=args.sync_warm_timeout),
        drain=replace(_DR, timeout_s=args.drain_timeout),
        workers=args.workers,
    )


def _add_ha_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas, workers and drain (extproc/sync/, extproc/runtime/)")
    g.add_argument("--sync-port", type=int, default=_Y.port,
                   help="peer-sync gRPC port: share the prefix index with peer replicas (0: off)")
    g.add_argument("--peers", default=",".join(_Y.peers),
                   help="static peers host:port,... (their --sync-port; this replica may be listed)")
    g.add_argument("--peer-selector", default=_Y.peer_selector,
                   help="Kubernetes label selector of this picker's own pods: peers are the ready ones")
    g.add_argument("--sync-secret-file", default=_Y.secret_file,
                   help="file with the peers' shared secret (else env PREFIX_EPP_SYNC_SECRET)")
    g.add_argument("--sync-warm-timeout", type=duration, default=_Y.warm_timeout_s, metavar="DURATION",
                   help="wait at most this long for a peer's index snapshot before reporting ready")
    g.add_argument("--drain-timeout", type=duration, default=_DR.timeout_s, metavar="DURATION",
                   help="on SIGTERM, wait this long at most for open streams to end")
    g.add_argument("--workers", type=int, default=_D.workers,
                   help="picker processes sharing the ext_proc port (SO_REUSEPORT), one core each")


def _add_kv_events_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("precise prefix routing (KV events, extproc/kvevents/)")
    g.add_argument("--prefix-scorer", choices=("approximate", "precise"), default=_K.prefix_scorer,
                   help="prefix scorer of the default profile; precise subscribes to the engines' KV events")
    _bool_flag(g, "--kv-events", _K.enabled, "subscribe to KV events and compare both scorers' predictions "
               "even when the approximate scorer routes")
    g.add_argument("--kv-events-port", type=int, default=_K.port,
                   help="engine KV-events publisher port on the endpoint's host (per endpoint: host:port@tcp://h:p)")
    g.add_argument("--kv-events-replay-port", type=int, default=_K.replay_port,
                   help="engine replay (ROUTER) port on the same host; 0: no replay, resync instead")
    g.add_argument("--kv-events-dp-size", type=int, default=_K.dp_size,
                   help="data-parallel ranks per endpoint; rank r publishes on port + r")
    g.add_argument("--kv-events-block-size", type=int, default=_K.block_size,
                   help="engine tokens per block until vllm:cache_config_info or an event reports it")
    g.add_argument("--kv-events-index-capacity", type=int, default=_K.index_capacity,
                   help="precise index entries per endpoint rank until num_gpu_blocks is scraped")
    g.add_argument("--kv-events-max-blocks", type=int, default=_K.max_blocks,
                   help="leading token blocks of a prompt looked up at most")
    g.add_argument("--kv-events-speculative-ttl", type=duration, default=_K.speculative_ttl_s, metavar="DURATION",
                   help="how long decision-time entries count before events confirm them")
    g.add_argument("--kv-events-resync-window", type=duration, default=_K.resync_window_s, metavar="DURATION",
                   help="after lost events, fresh events needed this long before precise scoring resumes")
    g.add_argument("--kv-events-silence-timeout", type=duration, default=_K.silence_timeout_s, metavar="DURATION",
                   help="an endpoint routed to without any event for this long is scored approximately")
    g.add_argument("--kv-events-replay-timeout", type=duration, default=_K.replay_timeout_s, metavar="DURATION",
                   help="wait per replayed message")
    g.add_argument("--tokenizer", default=_K.tokenizer,
                   help="builtin (the simulator's), remote (the engine's POST /tokenize) or a tokenizer.json path")
    g.add_argument("--tokenizer-timeout", type=duration, default=_K.tokenize_timeout_s, metavar="DURATION",
                   help="timeout of a remote tokenization (then the approximate index scores the request)")


def _kv_events_from_args(args: argparse.Namespace) -> KVEventsConfig:
    return replace(
        _K, prefix_scorer=args.prefix_scorer, enabled=args.kv_events, port=args.kv_events_port,
        replay_port=args.kv_events_replay_port, dp_size=args.kv_events_dp_size,
        block_size=args.kv_events_block_size, index_capacity=args.kv_events_index_capacity,
        max_blocks=args.kv_events_max_blocks, speculative_ttl_s=args.kv_events_speculative_ttl,
        resync_window_s=args.kv_events_resync_window, silence_timeout_s=args.kv_events_silence_timeout,
        replay_timeout_s=args.kv_events_replay_timeout, tokenizer=args.tokenizer,
        tokenize_timeout_s=args.tokenizer_timeout,
    )


def _validate_ha(config: EppConfig) -> None:
    from extproc.core.datastore import split_host_port
    from extproc.sync.manager import load_secret

    y = config.sync  # the ranges of its numbers are checked with the others (extproc/config/validate.py)
    if (y.peers or y.peer_selector) and not y.port:
        raise SystemExit("prefix-epp serve: --peers and --peer-selector need --sync-port")
    if y.peer_selector and not config.pool_name:
        raise SystemExit("prefix-epp serve: --peer-selector needs Kubernetes discovery (--pool-name)")
    for peer in y.peers:
        try:
            split_host_port(peer)
        except ValueError as exc:
            raise SystemExit(f"prefix-epp serve: --peers: {exc}") from None
    if y.port:
        try:
            load_secret(y)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"prefix-epp serve: {exc}") from None


def validate(config: EppConfig) -> None:
    """Refuse to start on any invalid flag or config field, naming it (extproc/config/validate.py)."""
    from pathlib import Path

    from extproc.config.validate import check, overridden, profile_conflicts
    from extproc.discovery.pool import PoolError, pool_version
    from extproc.scheduling.config_loader import ConfigError, load_config

    if not config.endpoints and not config.pool_name:
        raise SystemExit("prefix-epp serve: give --endpoints or --pool-name")
    k = config.kv_events
    if k.tokenizer not in ("builtin", "remote") and not Path(k.tokenizer).is_file():
        raise SystemExit(f"prefix-epp serve: --tokenizer {k.tokenizer}: no such file (or builtin, remote)")
    problems = check(config)  # the flags as given: name the flag even if the config file would change it
    if problems:
        raise SystemExit("prefix-epp serve: " + "; ".join(problems))
    _validate_ha(config)
    try:
        if config.pool_name:
            pool_version(config.pool_group)
        loaded, profile = load_config(config)
    except (ConfigError, PoolError) as exc:
        raise SystemExit(f"prefix-epp serve: {exc}") from None
    problems = check(loaded)
    if problems:
        source = "--config-file" if config.config_file else "--config-text"
        raise SystemExit(f"prefix-epp serve: after applying {source}: " + "; ".join(problems))
    if profile is not None and (conflicts := profile_conflicts(config)):
        raise SystemExit(f"prefix-epp serve: {', '.join(conflicts)} cannot apply: the EndpointPickerConfig defines "
                         "the scheduling profile; set the scorers and their weights there")
    for flag, given, final in overridden(config, loaded):
        logging.getLogger("prefix_epp").warning(
            "the EndpointPickerConfig overrides a flag", extra={"flag": flag, "flag_value": given,
                                                               "config_value": final})


async def serve(config: EppConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain (extproc/transport/streams.py); a second signal cuts the drain short."""
    from extproc.runtime.app import App
    from extproc.runtime.workers import WorkerRole, worker_role

    app = App(config, role=worker_role() or WorkerRole())
    stop, hurry = asyncio.Event(), asyncio.Event()

    def signalled() -> None:
        (hurry if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, signalled)
    await app.start()
    try:
        await stop.wait()
        await app.drain(hurry)
    finally:
        await app.stop()


def run(args: argparse.Namespace) -> int:
    import sys

    from extproc.runtime.workers import supervise, worker_role
    from extproc.sync.manager import SECRET_ENV

    logs.setup(args.log_level)
    config = config_from_args(args)
    validate(config)
    if config.workers > 1 and worker_role() is None:
        have_secret = bool(config.sync.secret_file or os.environ.get(SECRET_ENV))
        return supervise(config.workers, sys.argv[1:], SECRET_ENV, have_secret)
    asyncio.run(serve(config))
    return 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the endpoint picker",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
