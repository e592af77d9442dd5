"""The model route's traffic settings in the chart (BackendTrafficPolicy, HTTPRoute) equal the
defaults `prefix-epp envoy-config` uses (extproc/config/settings.py ProxyTrafficConfig): circuit breakers
sized for LLM concurrency, retries that walk the fallback list only when the picker returns
several endpoints, and a route timeout for long generations."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import yaml

from extproc.config.settings import EppConfig, ProxyTrafficConfig
from testkit.k8s_objects import CHART, Obj, find

Render = Callable[[str], list[Obj]]
T = ProxyTrafficConfig()


def seconds(duration: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(h|ms|m|s)", duration))


def test_values_equal_the_proxy_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["envoyGateway"]
    cb, retry = values["traffic"]["circuitBreaker"], values["traffic"]["retry"]
    assert (cb["maxConnections"], cb["maxPendingRequests"], cb["maxParallelRequests"], cb["maxParallelRetries"]) == (
        T.max_connections, T.max_pending_requests, T.max_parallel_requests, T.max_parallel_retries)
    assert tuple(retry["triggers"]) == T.retry_on
    assert tuple(retry["httpStatusCodes"]) == T.retriable_status_codes
    assert seconds(retry["backoffBaseInterval"]) == T.retry_backoff_base_ms / 1000
    assert seconds(values["route"]["requestTimeout"]) == T.route_timeout_s
    assert seconds(values["traffic"]["upstreamIdleTimeout"]) == T.upstream_idle_timeout_s
    assert seconds(values["extProc"]["messageTimeout"]) == T.ext_proc_message_timeout_s


def test_the_message_timeout_outlasts_flow_control_s_default_ttls() -> None:
    """A request held by flow control waits inside the ext_proc message's answer (BUFFERED bodies)."""
    fc = EppConfig().flow_control
    assert T.ext_proc_message_timeout_s > max(fc.default_request_ttl_s, fc.no_endpoint_ttl_s)
    assert fc.ttl_beyond(T.ext_proc_message_timeout_s) == []
    assert replace(fc, default_request_ttl_s=0.0).ttl_beyond(T.ext_proc_message_timeout_s) == [
        "defaultRequestTTL", "noEndpointRequestTTL"]


def test_idle_model_connections_close_before_the_servers_keep_alive(render: Render) -> None:
    """vLLM closes keep-alive connections idle for 5 s; Envoy must close its own first."""
    spec = find(render("envoy-gateway"), "BackendTrafficPolicy")["spec"]
    assert seconds(spec["timeout"]["http"]["connectionIdleTimeout"]) == T.upstream_idle_timeout_s < 5


def test_circuit_breaker_on_the_model_route(render: Render) -> None:
    spec = find(render("envoy-gateway"), "BackendTrafficPolicy")["spec"]
    assert spec["circuitBreaker"] == {"maxConnections": T.max_connections,
                                      "maxPendingRequests": T.max_pending_requests,
                                      "maxParallelRequests": T.max_parallel_requests,
                                      "maxParallelRetries": T.max_parallel_retries}
    assert spec["circuitBreaker"]["maxParallelRequests"] > 1024  # Envoy's default


def test_no_retry_with_a_single_endpoint(render: Render) -> None:
    # Envoy Gateway adds no retry policy when the BackendTrafficPolicy has none.
    objs = render("eg-single-endpoint")
    assert "retry" not in find(objs, "BackendTrafficPolicy")["spec"]
    assert "filters" not in find(objs, "HTTPRoute")["spec"]["rules"][0]


def test_fallbacks_by_default(render: Render) -> None:
    retry = find(render("envoy-gateway"), "BackendTrafficPolicy")["spec"]["retry"]
    assert retry["numRetries"] == ProxyTrafficConfig().fallback_endpoints - 1


def test_retry_walks_the_fallbacks(render: Render) -> None:
    retry = find(render("eg-fallbacks"), "BackendTrafficPolicy")["spec"]["retry"]
    assert retry["numRetries"] == 2  # picker.maxEndpoints 3
    assert tuple(retry["retryOn"]["triggers"]) == T.retry_on
    assert not set(retry["retryOn"]["triggers"]) & {"5xx", "gateway-error"}  # only before the response started
    assert "timeout" not in retry["perRetry"]  # no per-try timeout that would cut a generation
    assert seconds(retry["perRetry"]["backOff"]["baseInterval"]) == T.retry_backoff_base_ms / 1000


def test_route_timeout_allows_long_generations(render: Render) -> None:
    route = find(render("envoy-gateway"), "HTTPRoute")
    assert seconds(route["spec"]["rules"][0]["timeouts"]["request"]) == T.route_timeout_s >= 600


def test_served_endpoint_header_only_with_fallbacks(render: Render) -> None:
    rule = find(render("eg-fallbacks"), "HTTPRoute")["spec"]["rules"][0]
    assert rule["filters"] == [{"type": "ResponseHeaderModifier", "responseHeaderModifier": {
        "set": [{"name": "x-gateway-destination-endpoint-served", "value": "%UPSTREAM_HOST%"}]}}]
    assert find(render("envoy-gateway"), "HTTPRoute")["spec"]["rules"][0]["filters"] == rule["filters"]
