"""`prefix-epp envoy-config`: print a working static Envoy configuration for the picker.

The listener runs the ext_proc filter in the Inference Extension's modes (request and response
bodies FULL_DUPLEX_STREAMED, trailers SEND; `--request-body-mode buffered` for BUFFERED) and
routes on the `envoy.lb` dynamic metadata the picker returns:

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

from extproc.datastore import split_host_port
from extproc.serve import parse_bool
from extproc.server.health import EXT_PROC_SERVICE
from extproc.server.responses import DESTINATION_HEADER, LB_NAMESPACE

_TYPE = "@type"


def build_config(
    listen_port: int, epp: str, admin_port: int = 0, *, listen_address: str = "127.0.0.1",
    epp_tls: bool = True, request_body_mode: str = "FULL_DUPLEX_STREAMED", process_responses: bool = True,
    route_timeout_s: int = 86400, failure_mode_allow: bool = False, endpoints: tuple[str, ...] = (),
) -> dict[str, Any]:
    epp_host, epp_port = split_host_port(epp)
    response_body_mode = "FULL_DUPLEX_STREAMED" if process_responses else "NONE"
    processing_mode: dict[str, str] = {
        "request_header_mode": "SEND",
        "request_body_mode": request_body_mode,
        "request_trailer_mode": "SEND" if request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
        "response_header_mode": "SEND" if process_responses else "SKIP",
        "response_body_mode": response_body_mode,
        "response_trailer_mode": "SEND" if process_responses else "SKIP",
    }
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": "1000s",
            "processing_mode": processing_mode,
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
        process_responses=args.process_responses, failure_mode_allow=args.failure_mode_allow,
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
    p.add_argument("--request-body-mode", choices=["full-duplex-streamed", "buffered"],
                   default="full-duplex-streamed", help="ext_proc request body mode")
    p.add_argument("--process-responses", type=parse_bool, nargs="?", const=True, default=True, metavar="BOOL",
                   help="send response headers, bodies and trailers to the picker (reference config)")
    p.add_argument("--failure-mode-allow", type=parse_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="let requests through unrouted when the picker fails (ORIGINAL_DST then returns 503)")
    p.add_argument("--endpoints", default="",
                   help="static model-server endpoints ip:port,...: route with override_host (fallback lists)")
    p.set_defaults(func=run)
