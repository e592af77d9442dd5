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
  carries a `mode_override` asking for the response headers (their status is the request's
  outcome, and they name the endpoint that served it, below) and for the response body of a
  sampled share of requests (`prefix-epp serve --usage-sample-rate`); with
  FULL_DUPLEX_STREAMED request bodies Envoy ignores `mode_override` and the closed loop sees no
  responses.
- `full-duplex`: the Inference Extension's reference configuration: every response chunk makes a
  round trip through the picker (about 0.07 ms of picker CPU per streamed token, bench/overhead.py).
- `none`: no response processing; Envoy ends the ext_proc stream once the request is forwarded,
  so in-flight counts drop before the response even starts (not a supported setup).

Upstream routing:

- without `--endpoints`: an ORIGINAL_DST cluster reads the destination from the metadata, so any
  pod IP the picker discovers is reachable. It takes a single `ip:port` (use --max-endpoints 1).
- with `--endpoints`: a STATIC cluster of those endpoints with the override_host load-balancing
  policy, which accepts the picker's ordered fallback list (`ip:port,ip:port`).

Traffic defaults (extproc/config/settings.py `ProxyTrafficConfig`, shared with the Helm chart): circuit
breakers sized for thousands of concurrent generations; a one-hour route timeout; and, when
`--max-endpoints` > 1, a retry policy that walks the picker's fallback list (one retry per
fallback) on failures before the model server answered: connect failure, refused stream, a reset
or closed connection before any response header (a killed engine), or a 500/502/503/504 status
(an engine error, or Envoy's own for a failed connection). Once a response has started nothing is
retried, so a generation never runs twice after its response started.

Served endpoint (Endpoint Picker Protocol): the route adds the response header
`x-gateway-destination-endpoint-served: %UPSTREAM_HOST%` (the address that really answered,
overwriting anything the model server sent), a header-to-metadata filter copies it into the
`envoy.lb` dynamic metadata, and ext_proc forwards that namespace to the picker on the response
path (`metadata_options.forwarding_namespaces`), so the picker can move its accounting from the
first choice to a fallback that served the request.

Stream ends: Envoy ends each finished ext_proc stream with a half-close and a reset, its default.
`--graceful-ext-proc-close` sets the runtime flag `envoy.reloadable_features.ext_proc_graceful_grpc_close`
instead (Envoy half-closes and waits for the picker to close the stream), which Envoy 1.40
survives only some of the time: it crashed (SIGSEGV) in all 6 attempts of a real-vLLM benchmark
run (bench/results/graceful-close-vllm/, docs/kubernetes.md "Stream ends"); without the flag the
run completed. The picker meets the reset without answering it (extproc/transport/grpc_server.py:
a status sent on a reset call leaks native memory in grpc.aio).

TLS to the picker (`--epp-tls`, the default): without `--upstream-ca-file` Envoy does not verify
the picker's certificate (`validation_context: {}`, the reference configuration; the picker's
default certificate is self-signed), so whoever can answer on the picker's address receives every
prompt. With `--upstream-ca-file FILE` Envoy verifies the certificate chain against that CA
(`validation_context.trusted_ca`), sends `--upstream-server-name` (default: the `--epp` host) as
SNI and requires it among the certificate's DNS (or, for an IP, IP) subject alternative names.
`--upstream-client-cert`/`--upstream-client-key` make Envoy present a client certificate, for a
picker that requires one (`prefix-epp serve --client-ca-file`, mutual TLS).

Client-set control headers (`--strip-control-headers`, on by default): the HTTP connection
manager removes `test-epp-endpoint-selection`, the `x-gateway-destination-endpoint*` headers and
`x-prefiller-host-port` from every request before any filter runs (an early header mutation), so
the picker never sees a client's value for them. A route's `request_headers_to_remove` would not
do: the router applies it after ext_proc has already read the headers.

Envoy never reads the `x-gateway-destination-endpoint` request
header for routing, so a client that forges it steers nothing, even while the picker is down.

Picker failures (`--failure-mode-allow`, on by default: fail open): an ext_proc stream that fails
after the picker answered (the picker crashed or restarted mid-generation) leaves the request to
run to its end instead of cutting it; a request the picker cannot route goes on unsteered: round
robin over `--endpoints`, or 503 from ORIGINAL_DST, which has no address to go to. What it costs:
the picker does not see those requests end, so their in-flight counts die with the process that
held them (a restarted picker starts from zero anyway). Fail closed (`--failure-mode-allow=false`)
cuts every open request and answers 500 while the picker is unreachable.

Fallbacks (on by default with `--endpoints`): `--max-endpoints` defaults to 2 there, so a first
choice that refuses the connection or answers 500/502/503/504 before its response started costs a
retry on the picker's second choice, not a failed request (run `prefix-epp serve --max-endpoints 2`
to hand Envoy that second choice; with one, the retry goes round robin).

`metadata_options.receiving_namespaces` must list `envoy.lb`, or Envoy drops the metadata.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import yaml

from extproc.config.settings import EppConfig, ProxyTrafficConfig
from extproc.config.values import endpoint_list, parse_bool
from extproc.core.datastore import split_host_port
from extproc.transport.health import EXT_PROC_SERVICE
from extproc.transport.responses import DESTINATION_HEADER, LB_NAMESPACE, PREFILLER_HEADER, SERVED_HEADER

_TYPE = "@type"
# Request headers a client must not set: the conformance test's endpoint selection, the
# Endpoint Picker Protocol's destination headers, which only the picker (or Envoy) writes, and the
# P/D prefill endpoint the decode pod's sidecar obeys (also when the picker fails open).
CONTROL_HEADERS = ("test-epp-endpoint-selection", DESTINATION_HEADER, f"{DESTINATION_HEADER}-subset", SERVED_HEADER,
                   PREFILLER_HEADER)
# --graceful-ext-proc-close: Envoy ends an ext_proc stream whose work is done with a half-close and
# waits for the picker to close it, instead of resetting it (module docstring: off by default).
GRACEFUL_EXT_PROC_CLOSE = {"envoy.reloadable_features.ext_proc_graceful_grpc_close": True}
_PICKER = EppConfig()  # the picker's defaults, which these must match
FALLBACK_ENDPOINTS = ProxyTrafficConfig().fallback_endpoints  # --max-endpoints with --endpoints
_MAX_BODY = _PICKER.max_request_body_bytes


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
    epp_tls: bool = _PICKER.secure_serving, request_body_mode: str = "BUFFERED",
    response_processing: str = "end", max_request_body_bytes: int = _MAX_BODY,
    failure_mode_allow: bool = True, endpoints: tuple[str, ...] = (), max_endpoints: int = _PICKER.max_endpoints,
    traffic: ProxyTrafficConfig | None = None, upstream_ca_file: str = "", upstream_server_name: str = "",
    upstream_client_cert: str = "", upstream_client_key: str = "", strip_control_headers: bool = True,
    graceful_ext_proc_close: bool = False,
) -> dict[str, Any]:
    traffic = traffic or ProxyTrafficConfig()
    epp_host, epp_port = split_host_port(epp)
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": failure_mode_allow,
            "message_timeout": f"{traffic.ext_proc_message_timeout_s}s",
            "processing_mode": processing_mode(request_body_mode, response_processing),
            "allow_mode_override": True,
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                                 "forwarding_namespaces": {"untyped": [LB_NAMESPACE]}},
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
                "routes": [_route(traffic, max_endpoints)],
            }],
        },
        **({"early_header_mutation_extensions": [_strip_headers(CONTROL_HEADERS)]} if strip_control_headers else {}),
        "http_filters": [
            ext_proc,
            _served_to_metadata(),
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
        "circuit_breakers": _circuit_breakers(traffic),
        "health_checks": [{
            "timeout": "2s", "interval": "2s", "no_traffic_interval": "2s", "unhealthy_threshold": 3,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
        }],
        "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": epp_host, "port_value": epp_port}}}}]}]},
    }
    if epp_tls:
        epp_cluster["transport_socket"] = _upstream_tls(epp_host, upstream_ca_file, upstream_server_name,
                                                        upstream_client_cert, upstream_client_key)
    elif upstream_ca_file or upstream_client_cert or upstream_client_key:
        raise ValueError("--upstream-ca-file and --upstream-client-cert/-key need --epp-tls")
    picked_cluster = _override_host_cluster(endpoints, traffic) if endpoints else {
        "name": "picked",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": f"{traffic.connect_timeout_s}s",
        "original_dst_lb_config": {"metadata_key": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
        "circuit_breakers": _circuit_breakers(traffic),
        "typed_extension_protocol_options": _upstream_http(traffic),
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
    if graceful_ext_proc_close:
        config["layered_runtime"] = {"layers": [{"name": "static", "static_layer": GRACEFUL_EXT_PROC_CLOSE}]}
    if admin_port:
        config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return config


def _upstream_tls(epp_host: str, ca_file: str, server_name: str, client_cert: str,
                  client_key: str) -> dict[str, Any]:
    """The TLS transport socket of the picker cluster (see the module docstring)."""
    if bool(client_cert) != bool(client_key):
        raise ValueError("--upstream-client-cert and --upstream-client-key go together")
    if server_name and not ca_file:
        raise ValueError("--upstream-server-name needs --upstream-ca-file (nothing is verified without a CA)")
    context: dict[str, Any] = {"alpn_protocols": ["h2"]}
    tls: dict[str, Any] = {_TYPE: "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"}
    if ca_file:
        name = server_name or epp_host
        san_type = "IP_ADDRESS" if _is_ip(name) else "DNS"
        context["validation_context"] = {
            "trusted_ca": {"filename": ca_file},
            "match_typed_subject_alt_names": [{"san_type": san_type, "matcher": {"exact": name}}],
        }
        if not _is_ip(name):
            tls["sni"] = name
    else:
        # Without a CA nothing can be verified (the picker's default certificate is self-signed).
        context["validation_context"] = {}
    if client_cert:
        context["tls_certificates"] = [{"certificate_chain": {"filename": client_cert},
                                        "private_key": {"filename": client_key}}]
    tls["common_tls_context"] = context
    return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def _strip_headers(names: tuple[str, ...]) -> dict[str, Any]:
    """An early header mutation removing `names` from every request, before any HTTP filter."""
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": name} for name in names],
        },
    }


def _circuit_breakers(t: ProxyTrafficConfig) -> dict[str, Any]:
    return {"thresholds": [{"max_connections": t.max_connections, "max_pending_requests": t.max_pending_requests,
                            "max_requests": t.max_parallel_requests, "max_retries": t.max_parallel_retries}]}


def _route(t: ProxyTrafficConfig, max_endpoints: int) -> dict[str, Any]:
    route: dict[str, Any] = {"cluster": "picked", "timeout": f"{t.route_timeout_s}s"}
    if max_endpoints > 1:
        # Each retry goes to the next endpoint of the picker's list (override_host, or Envoy
        # Gateway's endpointOverride); with a single endpoint there is nothing to walk.
        route["retry_policy"] = {
            "retry_on": ",".join(t.retry_on),
            "retriable_status_codes": list(t.retriable_status_codes),
            "num_retries": max_endpoints - 1,
            "retry_back_off": {"base_interval": f"{t.retry_backoff_base_ms / 1000}s"},
        }
    return {
        "match": {"prefix": "/"},
        "route": route,
        # The address that really served the request, whatever the model server sent.
        "response_headers_to_add": [{"header": {"key": SERVED_HEADER, "value": "%UPSTREAM_HOST%"},
                                     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }


def _served_to_metadata() -> dict[str, Any]:
    """Copy the served-endpoint response header into the envoy.lb dynamic metadata. Listed after
    ext_proc, so on the response path it runs before ext_proc, which then forwards the metadata."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            _TYPE: "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "response_rules": [{"header": SERVED_HEADER, "on_header_present": {
                "metadata_namespace": LB_NAMESPACE, "key": SERVED_HEADER, "type": "STRING"}}],
        },
    }


def _override_host_cluster(endpoints: tuple[str, ...], traffic: ProxyTrafficConfig) -> dict[str, Any]:
    lb_endpoints = []
    for item in endpoints:
        host, port = split_host_port(item)
        lb_endpoints.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}})
    return {
        "name": "picked",
        "type": "STATIC",
        "connect_timeout": f"{traffic.connect_timeout_s}s",
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
        "circuit_breakers": _circuit_breakers(traffic),
        "typed_extension_protocol_options": _upstream_http(traffic),
    }


def _upstream_http(t: ProxyTrafficConfig) -> dict[str, Any]:
    """HTTP/1.1 to the model servers, idle connections closed before the servers close them."""
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        _TYPE: "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "common_http_protocol_options": {"idle_timeout": f"{t.upstream_idle_timeout_s}s"},
        "explicit_http_config": {"http_protocol_options": {}},
    }}


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def default_max_endpoints(endpoints: Sequence[str]) -> int:
    """Fallbacks on where the cluster takes a list (override_host, with --endpoints); ORIGINAL_DST
    takes a single address."""
    return FALLBACK_ENDPOINTS if endpoints else 1


def render(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    print(render(build_config(
        args.listen_port, args.epp, args.admin_port, listen_address=args.listen_address, epp_tls=args.epp_tls,
        request_body_mode=args.request_body_mode.upper().replace("-", "_"),
        response_processing=args.response_processing, max_request_body_bytes=args.max_request_body_bytes,
        failure_mode_allow=args.failure_mode_allow,
        endpoints=tuple(e.partition("@")[0] for e in args.endpoints),
        max_endpoints=default_max_endpoints(args.endpoints) if args.max_endpoints is None else args.max_endpoints,
        upstream_ca_file=args.upstream_ca_file,
        upstream_server_name=args.upstream_server_name, upstream_client_cert=args.upstream_client_cert,
        upstream_client_key=args.upstream_client_key, strip_control_headers=args.strip_control_headers,
        graceful_ext_proc_close=args.graceful_ext_proc_close,
    )), end="")
    return 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("envoy-config", help="print a static Envoy config that uses the picker",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--listen-port", type=int, default=8081, help="Envoy listener port")
    p.add_argument("--listen-address", default="127.0.0.1", help="Envoy listener address")
    p.add_argument("--epp", default=f"127.0.0.1:{_PICKER.grpc_port}", help="picker ext_proc address host:port")
    p.add_argument("--admin-port", type=int, default=0, help="Envoy admin port (0: no admin interface)")
    p.add_argument("--epp-tls", type=parse_bool, nargs="?", const=True, default=_PICKER.secure_serving, metavar="BOOL",
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
    p.add_argument("--failure-mode-allow", type=parse_bool, nargs="?", const=True, default=True, metavar="BOOL",
                   help="fail open: a request routed before the picker failed runs to its end, and one the picker "
                        "cannot route goes on unsteered (round robin with --endpoints, 503 without); false: Envoy "
                        "cuts every open request and answers 500 while the picker is unreachable")
    p.add_argument("--endpoints", type=endpoint_list, default="", metavar="IP:PORT,...",
                   help="static model-server endpoints IP:port,... (as serve --endpoints): route with "
                        "override_host (fallback lists)")
    p.add_argument("--max-endpoints", type=int, default=None,
                   help="endpoints the picker returns (its --max-endpoints); >1 adds a retry policy that walks "
                        f"them (default: {FALLBACK_ENDPOINTS} with --endpoints, else 1: ORIGINAL_DST takes one "
                        "address)")
    p.add_argument("--upstream-ca-file", default="",
                   help="PEM CA that signed the picker's certificate: Envoy verifies it (chain, SNI and SAN); "
                        "empty: TLS without verification")
    p.add_argument("--upstream-server-name", default="",
                   help="name Envoy sends as SNI and requires in the picker certificate's SANs "
                        "(with --upstream-ca-file; default: the --epp host)")
    p.add_argument("--upstream-client-cert", default="",
                   help="PEM client certificate Envoy presents to the picker (mutual TLS: serve --client-ca-file)")
    p.add_argument("--upstream-client-key", default="", help="private key of --upstream-client-cert")
    p.add_argument("--strip-control-headers", type=parse_bool, nargs="?", const=True, default=True, metavar="BOOL",
                   help="remove client-set test-epp-endpoint-selection and x-gateway-destination-endpoint* "
                        "request headers before any filter (false: pass them to the picker, for conformance tests)")
    p.add_argument("--graceful-ext-proc-close", type=parse_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="set envoy.reloadable_features.ext_proc_graceful_grpc_close: Envoy half-closes finished "
                        "ext_proc streams and waits for the picker to close them instead of resetting them "
                        "(Envoy 1.40 crashed with it under load: off by default)")
    p.set_defaults(func=run)
