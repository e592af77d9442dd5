"""`prefix-epp envoy-config`: print a working static Envoy configuration for the picker.

The listener runs the ext_proc filter with request headers and body (`--request-body-mode`:
BUFFERED by default, or FULL_DUPLEX_STREAMED, the Inference Extension's mode) and routes on the
`envoy.lb` dynamic metadata the picker returns. BUFFERED sends the body to the picker once, in one
message, with nothing to stream back (bench/overhead.py: less picker CPU per request than full
duplex, the gap growing with the body), and it is the mode in which Envoy honours the picker's
per-request `mode_override` (Envoy ignores it while a body mode is FULL_DUPLEX_STREAMED). Envoy
holds a buffered body up to the listener's per-connection buffer limit, set to
`--max-request-body-bytes` (413 above it). Responses (`--response-processing`):

- `end` (default): response trailers SEND, body NONE, headers SKIP with BUFFERED request bodies
  (SEND with full-duplex ones). The picker is off the token stream (its cost per request does not
  grow with the answer's length) and still sees the response end: Envoy keeps the ext_proc stream
  open until the response is complete when the trailer mode is SEND, and the stream's end
  releases the in-flight count. With BUFFERED request bodies the picker's request_headers reply
  carries a `mode_override` asking for response headers when it explains decisions and for the
  response body of a sampled share of requests (`prefix-epp serve --usage-sample-rate`); with
  FULL_DUPLEX_STREAMED request bodies Envoy ignores `mode_override` and the closed loop sees no
  responses. Skipping the response headers saves one of the exchanges of every request.
- `full-duplex`: the Inference Extension's reference configuration: every response chunk makes a
  round trip through the picker (about 0.1 ms of picker CPU per streamed token).
- `none`: no response processing; Envoy ends the ext_proc stream once the request is forwarded,
  so in-flight counts drop before the response even starts (not a supported setup).

Upstream routing:

- without `--endpoints`: an ORIGINAL_DST cluster reads the destination from the metadata, so any
  pod IP the picker discovers is reachable. It takes a single `ip:port` (use --max-endpoints 1).
- with `--endpoints`: a STATIC cluster of those endpoints with the override_host load-balancing
  policy, which accepts the picker's ordered fallback list (`ip:port,ip:port`); the route retries
  connection failures on the next endpoint of the list.
 Envoy never reads the `x-gateway-destination-endpoint` request
header for routing, so a client that forges it steers nothing, even while the picker is down
(fail-closed: Envoy answers 500 until the picker is back).

`metadata_options.receiving_namespaces` must list `envoy.lb`, or Envoy drops the metadata.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from extproc.config import EppConfig
from extproc.datastore import split_host_port
from extproc.serve import parse_bool
from extproc.server.health import EXT_PROC_SERVICE
from extproc.server.responses import DESTINATION_HEADER, LB_NAMESPACE

_TYPE = "@type"
_MAX_BODY = EppConfig().max_request_body_bytes


RESPONSE_PROCESSING = ("end", "full-duplex", "none")
REQUEST_BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")


def processing_mode(request_body_mode: str, response_processing: str) -> dict[str, str]:
    """The ext_proc filter's static processing_mode (see the module docstring)."""
    if request_body_mode not in REQUEST_BODY_MODES:
        raise ValueError(f"request body mode must be one of {REQUEST_BODY_MODES}, got {request_body_mode!r}")
    if response_processing not in RESPONSE_PROCESSING:
        raise ValueError(f"response processing must be one of {RESPONSE_PROCESSING}, got {response_processing!r}")
    duplex = request_body_mode == "FULL_DUPLEX_STREAMED"
    responses = response_processing != "none"
    return {
        "request_header_mode": "SEND",
        "request_body_mode": request_body_mode,
        "request_trailer_mode": "SEND" if duplex else "SKIP",
        # With BUFFERED bodies the picker asks for response headers per request when it wants them.
        "response_header_mode": "SEND" if responses and (duplex or response_processing == "full-duplex") else "SKIP",
        "response_body_mode": "FULL_DUPLEX_STREAMED" if response_processing == "full-duplex" else "NONE",
        "response_trailer_mode": "SEND" if responses else "SKIP",
    }


def build_config(
    listen_port: int, epp: str, admin_port: int = 0, *, listen_address: str = "127.0.0.1",
    epp_tls: bool = True, request_body_mode: str = "BUFFERED",
    response_processing: str = "end", max_request_body_bytes: int = _MAX_BODY,
    route_timeout_s: int = 86400, failure_mode_allow: bool = False, endpoints: tuple[str, ...] = (),
) -> dict[str, Any]:
    epp_host, epp_port = split_host_port(epp)
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": "1000s",
            "processing_mode": processing_mode(request_body_mode, response_processing),
            "allow_mode_override": True,
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
        },
    }
    hcm = {
        _TYPE: "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{
                "name": "all", "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": _route(route_timeout_s, bool(endpoints))}],
            }],
        },
        "http_filters": [
            ext_proc,
            {"name": "envoy.filters.http.router",
             "typed_config": {_TYPE: "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    epp_cluster: dict[str, Any] = {
        "name": "epp",
        "type": "STRICT_DNS" if not _is_ip(epp_host) else "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                _TYPE: "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "initial_stream_window_size": 65536, "initial_connection_window_size": 1048576}},
            },
        },
        "circuit_breakers": {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000,
                                             "max_requests": 40000}]},
        "health_checks": [{
            "timeout": "2s", "interval": "2s", "no_traffic_interval": "2s", "unhealthy_threshold": 3,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
        }],
        "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": epp_host, "port_value": epp_port}}}}]}]},
    }
    if epp_tls:
        epp_cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                _TYPE: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                # The picker's certificate is self-signed by default; the reference config does not verify it.
                "common_tls_context": {"validation_context": {}, "alpn_protocols": ["h2"]},
            },
        }
    picked_cluster = _override_host_cluster(endpoints) if endpoints else {
        "name": "picked",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "5s",
        "original_dst_lb_config": {"metadata_key": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
        "circuit_breakers": {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000,
                                             "max_requests": 40000}]},
    }
    config: dict[str, Any] = {
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": {"socket_address": {"address": listen_address, "port_value": listen_port}},
                # BUFFERED request bodies are held by Envoy up to this limit (413 above it); the
                # default 1 MiB would refuse long prompts the picker accepts.
                **({"per_connection_buffer_limit_bytes": max_request_body_bytes}
                   if request_body_mode == "BUFFERED" else {}),
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": [epp_cluster, picked_cluster],
        },
    }
    if admin_port:
        config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return config


def _route(timeout_s: int, retries: bool) -> dict[str, Any]:
    route: dict[str, Any] = {"cluster": "picked", "timeout": f"{timeout_s}s"}
    if retries:
        # override_host moves to the next endpoint of the picker's list on each retry.
        route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset-before-request",
                                 "num_retries": 2}
    return route


def _override_host_cluster(endpoints: tuple[str, ...]) -> dict[str, Any]:
    lb_endpoints = []
    for item in endpoints:
        host, port = split_host_port(item)
        lb_endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}})
    return {
        "name": "picked",
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "picked", "endpoints": [{"lb_endpoints": lb_endpoints}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                _TYPE: "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {_TYPE: "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                            ".round_robin.v3.RoundRobin"},
                }}]},
            },
        }}]},
        "circuit_breakers": {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000,
                                             "max_requests": 40000}]},
    }


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def render(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    print(render(build_config(
        args.listen_port, args.epp, args.admin_port, listen_address=args.listen_address, epp_tls=args.epp_tls,
        request_body_mode=args.request_body_mode.upper().replace("-", "_"),
        response_processing=args.response_processing, max_request_body_bytes=args.max_request_body_bytes,
        failure_mode_allow=args.failure_mode_allow,
        endpoints=tuple(e.strip() for e in args.endpoints.split(",") if e.strip()),
    )), end="")
    return 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("envoy-config", help="print a static Envoy config that uses the picker",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--listen-port", type=int, default=8081, help="Envoy listener port")
    p.add_argument("--listen-address", default="127.0.0.1", help="Envoy listener address")
    p.add_argument("--epp", default="127.0.0.1:9002", help="picker ext_proc address host:port")
    p.add_argument("--admin-port", type=int, default=0, help="Envoy admin port (0: no admin interface)")
    p.add_argument("--epp-tls", type=parse_bool, nargs="?", const=True, default=True, metavar="BOOL",
                   help="talk TLS to the picker (match prefix-epp serve --secure-serving)")
    p.add_argument("--request-body-mode", choices=["buffered", "full-duplex-streamed"], default="buffered",
                   help="ext_proc request body mode: buffered (Envoy then honours the picker's per-request "
                        "mode_override) or the Inference Extension's full-duplex-streamed")
    p.add_argument("--response-processing", choices=RESPONSE_PROCESSING, default="end",
                   help="what of each response the picker sees: its end (trailers SEND; with buffered request "
                        "bodies the picker asks per request for headers and sampled bodies), every body chunk "
                        "(the reference full-duplex config), or nothing")
    p.add_argument("--max-request-body-bytes", type=int, default=_MAX_BODY,
                   help="with buffered request bodies, Envoy's per-connection buffer limit (match the picker's)")
    p.add_argument("--failure-mode-allow", type=parse_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="let requests through unrouted when the picker fails (ORIGINAL_DST then returns 503)")
    p.add_argument("--endpoints", default="",
                   help="static model-server endpoints ip:port,...: route with override_host (fallback lists)")
    p.set_defaults(func=run)
