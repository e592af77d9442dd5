"""`prefix-epp sim`: run one or many simulated vLLM replicas in one process.

    prefix-epp sim --port 8000 --model NAME                  # one replica
    prefix-epp sim --replicas 8 --base-port 8001 --time-scale 10

Every flag's default comes from `SimConfig` (flag `--x-y` sets field `x_y`); see
`prefix_epp_sim.config` for their meaning. Flag names follow vLLM and llm-d-inference-sim where
those have the same concept: `--served-model-name`, `--max-model-len`, `--max-num-seqs`,
`--max-num-batched-tokens`, `--block-size`, `--max-loras`, `--lora-modules`, `--stream-interval`,
`--inter-token-latency`, `--prefill-time-per-token`, `--prefill-overhead` (milliseconds),
`--seed`, `--kv-cache-size` (alias of `--kv-cache-blocks`), `--failure-injection-rate` (percent,
alias of `--failure-rate` as a fraction), and vLLM's `--kv-events-config '<json>'`, which
overrides the `--kv-events-*` flags and applies vLLM's bind-or-connect rule (bind when the
endpoint contains `*`, `::`, `ipc://` or `inproc://`), and vLLM's `--kv-transfer-config '<json>'`
(NixlConnector, or ExampleConnector on a shared directory: a prefill/decode pair,
`prefix_epp_sim.kv_transfer`).

`--clairvoyant-port P` adds the benchmark's clairvoyant reference router on port P
(`prefix_epp_sim.clairvoyant`): it sends each request to the replica with the least predicted TTFT.

SIGINT and SIGTERM stop the replicas and exit 0. `python -m prefix_epp_sim.cli ...` runs the same
command without the other sub-commands.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import zmq

from extproc.core import logs
from prefix_epp_sim.clairvoyant import clairvoyant_front
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas

log = logging.getLogger("prefix_epp_sim")
_D = SimConfig()


def _percent(text: str) -> float:
    return float(text) / 100.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve = p.add_argument_group("serving")
    serve.add_argument("--host", default=_D.host, help="bind address (default %(default)s)")
    serve.add_argument("--port", "--base-port", dest="port", type=int, default=_D.port,
                       help="port of replica 0; replica i uses port + i (default %(default)s)")
    serve.add_argument("--replicas", type=int, default=_D.replicas)
    serve.add_argument("--spread-hosts", action="store_true", default=_D.spread_hosts,
                       help="replica i binds IPv4 address host + i on the same port, like pods")
    serve.add_argument("--model", default=_D.model)
    serve.add_argument("--served-model-name", nargs="+", default=list(_D.served_model_name))
    serve.add_argument("--max-model-len", type=int, default=_D.max_model_len)
    serve.add_argument("--default-max-tokens", type=int, default=_D.default_max_tokens,
                       help="max_tokens when a request sets none")
    serve.add_argument("--max-loras", type=int, default=_D.max_loras)
    serve.add_argument("--tokenizer", default=_D.tokenizer, metavar="TOKENIZER_JSON",
                       help="count and hash prompts with this tokenizer.json and the chat template beside it, "
                            "as an engine of that model would (default: the builtin tokenizer)")
    serve.add_argument("--lora-modules", nargs="+", default=list(_D.lora_modules),
                       help="adapters: NAME, NAME=PATH or '{\"name\": NAME}'")
    model = p.add_argument_group("cache and scheduler")
    model.add_argument("--block-size", type=int, default=_D.block_size)
    model.add_argument("--kv-cache-blocks", "--kv-cache-size", dest="kv_cache_blocks", type=int,
                       default=_D.kv_cache_blocks)
    model.add_argument("--max-num-seqs", type=int, default=_D.max_num_seqs)
    model.add_argument("--max-num-batched-tokens", type=int, default=_D.max_num_batched_tokens)
    model.add_argument("--stream-interval", type=int, default=_D.stream_interval)
    model.add_argument("--inter-token-latency", type=float, default=_D.inter_token_latency,
                       help="ms per decode step at batch 1")
    model.add_argument("--decode-time-per-seq", type=float, default=_D.decode_time_per_seq,
                       help="ms added per extra sequence in a step")
    model.add_argument("--prefill-time-per-token", type=float, default=_D.prefill_time_per_token,
                       help="ms per uncached prompt token")
    model.add_argument("--prefill-overhead", type=float, default=_D.prefill_overhead,
                       help="ms added to a step with prefill")
    model.add_argument("--slow-replicas", type=int, default=_D.slow_replicas,
                       help="the last N replicas pay every cost --slow-factor times (a heterogeneous pool)")
    model.add_argument("--slow-factor", type=float, default=_D.slow_factor)
    model.add_argument("--metrics-surface", choices=("vllm", "minimal"), default=_D.metrics_surface,
                       help="minimal: only running, waiting, KV usage and the cache config on /metrics")
    model.add_argument("--time-scale", type=float, default=_D.time_scale,
                       help="divide every sleep by this (costs and metrics stay in model time)")
    serve.add_argument("--clairvoyant-port", type=int, default=_D.clairvoyant_port,
                       help="also serve a clairvoyant front here: each request goes to the replica with the "
                            "least predicted TTFT from their true caches and queues (a benchmark reference)")
    faults = p.add_argument_group("faults")
    faults.add_argument("--failure-rate", type=float, default=_D.failure_rate,
                        help="fraction of requests answered HTTP 500")
    faults.add_argument("--failure-injection-rate", dest="failure_rate", type=_percent,
                        default=argparse.SUPPRESS, help="the same, in percent (llm-d-inference-sim)")
    faults.add_argument("--startup-delay", type=float, default=_D.startup_delay,
                        help="seconds before /health answers 200")
    faults.add_argument("--seed", type=int, default=_D.seed)
    events = p.add_argument_group("KV events")
    events.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=_D.kv_events)
    events.add_argument("--kv-events-endpoint", default=_D.kv_events_endpoint)
    events.add_argument("--kv-events-port-base", type=int, default=_D.kv_events_port_base)
    events.add_argument("--kv-events-replay-endpoint", default=_D.kv_events_replay_endpoint)
    events.add_argument("--kv-events-replay-port-base", type=int, default=_D.kv_events_replay_port_base)
    events.add_argument("--kv-events-topic", default=_D.kv_events_topic)
    events.add_argument("--kv-events-encoding", choices=("array", "map"), default=_D.kv_events_encoding)
    events.add_argument("--kv-events-connect", action="store_true", default=_D.kv_events_connect)
    events.add_argument("--kv-events-buffer-steps", type=int, default=_D.kv_events_buffer_steps)
    events.add_argument("--kv-events-hwm", type=int, default=_D.kv_events_hwm)
    events.add_argument("--kv-events-config", metavar="JSON", help="vLLM's KVEventsConfig as JSON")
    p.add_argument("--kv-transfer-config", metavar="JSON",
                   help="vLLM's KVTransferConfig as JSON: kv_connector NixlConnector or ExampleConnector "
                        "(kv_connector_extra_config.shared_storage_path), kv_role (prefix_epp_sim.kv_transfer)")
    p.set_defaults(kv_connector=_D.kv_connector, kv_role=_D.kv_role,  # set from --kv-transfer-config only
                   kv_shared_storage_path=_D.kv_shared_storage_path)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _vllm_kv_events(text: str) -> dict[str, Any]:
    cfg = json.loads(text)
    if not isinstance(cfg, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    enabled = bool(cfg.get("enable_kv_cache_events", False)) and cfg.get("publisher", "zmq") != "null"
    out: dict[str, Any] = {"kv_events": enabled}
    if "endpoint" in cfg:
        endpoint = str(cfg["endpoint"])
        out["kv_events_endpoint"] = endpoint
        out["kv_events_connect"] = not any(m in endpoint for m in ("*", "::", "ipc://", "inproc://"))
    for key, field in (("replay_endpoint", "kv_events_replay_endpoint"), ("topic", "kv_events_topic"),
                       ("buffer_steps", "kv_events_buffer_steps"), ("hwm", "kv_events_hwm")):
        if cfg.get(key) not in (None, ""):
            out[field] = cfg[key]
    return out


_CONNECTORS = {"NixlConnector": "nixl", "ExampleConnector": "shared-storage",
               "SharedStorageConnector": "shared-storage"}  # the last: ExampleConnector's former name


def _vllm_kv_transfer(text: str) -> dict[str, Any]:
    cfg = json.loads(text)
    if not isinstance(cfg, dict) or cfg.get("kv_connector") not in _CONNECTORS:
        raise ValueError(f"--kv-transfer-config: kv_connector must be one of {', '.join(_CONNECTORS)}")
    extra = cfg.get("kv_connector_extra_config") or {}
    return {"kv_connector": _CONNECTORS[cfg["kv_connector"]], "kv_role": cfg.get("kv_role", "kv_both"),
            "kv_shared_storage_path": str(extra.get("shared_storage_path", "")) if isinstance(extra, dict) else ""}


def config_from_args(args: argparse.Namespace) -> SimConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)}
    values["served_model_name"] = tuple(values["served_model_name"])
    values["lora_modules"] = tuple(values["lora_modules"])
    if getattr(args, "kv_events_config", None):
        values.update(_vllm_kv_events(args.kv_events_config))
    if getattr(args, "kv_transfer_config", None):
        values.update(_vllm_kv_transfer(args.kv_transfer_config))
    return SimConfig(**values)


async def serve(config: SimConfig) -> None:
    """Run `config.replicas` replicas until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with run_replicas(config) as replicas, contextlib.AsyncExitStack() as stack:
            if config.clairvoyant_port is not None:
                await stack.enter_async_context(clairvoyant_front(replicas, config, config.clairvoyant_port))
            log.info("sim_ready", extra={"replicas": len(replicas), "time_scale": config.time_scale,
                                         "addresses": [r.address for r in replicas]})
            await stop.wait()
            log.info("sim_stopping")
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    logs.setup(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("sim_bad_config", extra={"error": str(exc)})
        return 2
    try:
        asyncio.run(serve(config))
    except (OSError, zmq.ZMQError) as exc:
        log.error("sim_start_failed", extra={"error": str(exc)})
        return 1
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("sim", help="run simulated vLLM model servers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix-epp sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
