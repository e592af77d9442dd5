"""`prefix-epp sidecar`: the proxy on a decode pod of a prefill/decode pool (extproc/sidecar/).

    prefix-epp sidecar --port 8000 --decode-url http://127.0.0.1:8200 --kv-connector shared-storage

Every default comes from `SidecarConfig` (extproc/config/sidecar.py); flag `--x-y` sets field
`x_y`. Names follow llm-d's pd-sidecar where it has the knob. A value refused at start-up is one
line naming its flag and exit status 2 (`StartupError`, printed by extproc/commands/main.py), as
is a port that cannot be bound. SIGTERM or SIGINT stops it gracefully (extproc/sidecar/server.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
from pathlib import Path
from typing import Any

from yarl import URL

from extproc.config.sidecar import CONNECTORS, TLS_STAGES, SidecarConfig
from extproc.config.validate import StartupError
from extproc.config.values import comma_list, duration, parse_bool
from extproc.core import logs

_D = SidecarConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=_D.port,
                   help="port the sidecar listens on: the InferencePool's targetPort (default %(default)s)")
    p.add_argument("--bind-address", default=_D.bind_address, help="IP address to listen on (default %(default)s)")
    p.add_argument("--decode-url", default=_D.decode_url,
                   help="the local decode engine (default %(default)s: llm-d's --model-server-port 8200)")
    p.add_argument("--kv-connector", choices=CONNECTORS, default=_D.kv_connector,
                   help="how the KV moves from the prefill engine to the decode engine: nixlv2 (vLLM's "
                        "NixlConnector; kv_transfer_params passed on) or shared-storage (vLLM's "
                        "ExampleConnector on one directory) (default %(default)s)")
    p.add_argument("--enable-tls", type=comma_list, default=_D.enable_tls, metavar="STAGE,...",
                   help="stages reached over https: prefiller, decoder")
    p.add_argument("--tls-insecure-skip-verify", type=comma_list, default=_D.tls_insecure_skip_verify,
                   metavar="STAGE,...", help="stages whose certificate is not verified: prefiller, decoder")
    p.add_argument("--ca-file", default=_D.ca_file,
                   help="PEM CA bundle that verifies the engines' certificates (default: the system's)")
    p.add_argument("--secure-serving", type=parse_bool, nargs="?", const=True, default=_D.secure_serving,
                   metavar="BOOL", help="serve TLS from --cert-path (default %(default)s)")
    p.add_argument("--cert-path", default=_D.cert_path, help="directory with tls.crt and tls.key")
    p.add_argument("--metrics-port", type=int, default=_D.metrics_port,
                   help="the sidecar's own /metrics (0: off; /metrics on --port is the engine's) "
                        "(default %(default)s)")
    p.add_argument("--max-request-body-bytes", type=int, default=_D.max_request_body_bytes,
                   help="larger request bodies are refused with 413 (default %(default)s)")
    p.add_argument("--max-prefill-response-bytes", type=int, default=_D.max_prefill_response_bytes,
                   help="a larger prefill answer is refused with 502 (default %(default)s)")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=duration, default=_D.connect_timeout_s,
                   metavar="DURATION", help="TCP connect to an engine, else 502 (default %(default)ss)")
    p.add_argument("--prefill-timeout", dest="prefill_timeout_s", type=duration, default=_D.prefill_timeout_s,
                   metavar="DURATION", help="a prefill's whole answer, else 504 (default %(default)ss)")
    p.add_argument("--max-connections", type=int, default=_D.max_connections,
                   help="outbound connections to the engines (default %(default)s)")
    p.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=duration, default=_D.shutdown_grace_s,
                   metavar="DURATION", help="on SIGTERM, time in-flight requests get (default %(default)ss)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    return SidecarConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SidecarConfig)})


def validate(c: SidecarConfig) -> None:
    """Refuse a configuration the sidecar cannot serve with, naming the flag."""
    for flag, port, low in (("--port", c.port, 1), ("--metrics-port", c.metrics_port, 0)):
        if not low <= port <= 65535:
            raise StartupError(f"{flag} must be within {low} to 65535, got {port}")
    try:
        ipaddress.ip_address(c.bind_address)
    except ValueError:
        raise StartupError(f"--bind-address must be an IP address, got {c.bind_address!r}") from None
    url = URL(c.decode_url)
    if url.scheme not in ("http", "https") or not url.host:
        raise StartupError(f"--decode-url must be an http:// or https:// URL, got {c.decode_url!r}")
    for flag, stages in (("--enable-tls", c.enable_tls), ("--tls-insecure-skip-verify", c.tls_insecure_skip_verify)):
        if unknown := [s for s in stages if s not in TLS_STAGES]:
            raise StartupError(f"{flag}: unknown stage {unknown[0]!r} (stages: {', '.join(TLS_STAGES)})")
    if c.ca_file and not Path(c.ca_file).is_file():
        raise StartupError(f"--ca-file {c.ca_file}: no such file")
    if c.secure_serving:
        if not c.cert_path:
            raise StartupError("--secure-serving needs --cert-path (a directory with tls.crt and tls.key)")
        for name in ("tls.crt", "tls.key"):
            if not (Path(c.cert_path) / name).is_file():
                raise StartupError(f"--cert-path {c.cert_path}: no {name}")
    for flag, value in (("--max-request-body-bytes", c.max_request_body_bytes),
                        ("--max-prefill-response-bytes", c.max_prefill_response_bytes),
                        ("--max-connections", c.max_connections)):
        if value < 1:
            raise StartupError(f"{flag} must be >= 1, got {value}")
    for flag, seconds in (("--connect-timeout", c.connect_timeout_s), ("--prefill-timeout", c.prefill_timeout_s)):
        if not seconds > 0:
            raise StartupError(f"{flag} must be > 0, got {seconds:g}")
    if c.shutdown_grace_s < 0:
        raise StartupError(f"--shutdown-grace must be >= 0, got {c.shutdown_grace_s:g}")


def run(args: argparse.Namespace) -> int:
    from extproc.sidecar.server import serve

    logs.setup(args.log_level)
    config = config_from_args(args)
    validate(config)
    try:
        return asyncio.run(serve(config))
    except OSError as exc:  # a port taken, a certificate unreadable
        raise StartupError(f"cannot serve on {config.bind_address}:{config.port}: {exc}") from None


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("sidecar", help="run the prefill/decode sidecar of a decode pod",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
