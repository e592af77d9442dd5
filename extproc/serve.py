"""`prefix-epp serve`: run the picker. Flag names and defaults follow the Go EPP where they exist;
every default comes from EppConfig (extproc/config.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from dataclasses import replace
from typing import Any

from extproc import logs
from extproc.config import EppConfig, PrefixConfig, SpillConfig, WeightsConfig

_D = EppConfig()
_P = PrefixConfig()
_S = SpillConfig()
_W = WeightsConfig()


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
                   help=f"{help_text} (default {str(default).lower()})")


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
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-endpoints", type=int, default=_D.max_endpoints,
                   help="endpoints returned per request, best first (>1: fallbacks)")
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
    g.add_argument("--spill-relative", type=float, default=_S.relative,
                   help="hot-spot guard: skip endpoints with load > R * min load + A")
    g.add_argument("--spill-absolute", type=float, default=_S.absolute, help="the A of --spill-relative")
    g.add_argument("--prefix-weight", type=float, default=_W.prefix, help="weight of the prefix scorer")
    g.add_argument("--inflight-weight", type=float, default=_W.inflight, help="weight of the in-flight scorer")
    g.add_argument("--seed", type=int, default=None, help="seed for random tie-breaks (tests)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> EppConfig:
    endpoints = tuple(e for e in args.endpoints.split(",") if e.strip()) if args.endpoints else ()
    return replace(
        _D,
        grpc_port=args.grpc_port, grpc_health_port=args.grpc_health_port, metrics_port=args.metrics_port,
        bind_address=args.bind_address, secure_serving=args.secure_serving, cert_path=args.cert_path,
        endpoints=endpoints, pool_name=args.pool_name, pool_namespace=args.pool_namespace,
        pool_group=args.pool_group, kubeconfig=args.kubeconfig, max_endpoints=args.max_endpoints,
        explain_decisions=args.explain_decisions, disable_endpoint_subset_filter=args.disable_endpoint_subset_filter,
        prefix=replace(_P, block_size_bytes=args.prefix_block_size, max_prefix_blocks=args.prefix_max_blocks,
                       lru_capacity_per_server=args.prefix_lru_capacity),
        spill=replace(_S, relative=args.spill_relative, absolute=args.spill_absolute),
        weights=replace(_W, prefix=args.prefix_weight, inflight=args.inflight_weight),
        seed=args.seed,
    )


def validate(config: EppConfig) -> None:
    if not config.endpoints and not config.pool_name:
        raise SystemExit("prefix-epp serve: give --endpoints or --pool-name")
    if config.max_endpoints < 1:
        raise SystemExit("prefix-epp serve: --max-endpoints must be >= 1")


async def serve(config: EppConfig) -> None:
    from extproc.app import App

    app = App(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await app.start()
    try:
        await stop.wait()
    finally:
        await app.stop()


def run(args: argparse.Namespace) -> int:
    logs.setup(args.log_level)
    config = config_from_args(args)
    validate(config)
    asyncio.run(serve(config))
    return 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the endpoint picker",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
