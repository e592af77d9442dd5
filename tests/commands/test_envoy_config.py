"""`prefix-epp envoy-config`: processing modes per wiring; the traffic defaults (circuit breakers,
retries only with fallbacks, long-generation timeout, served-endpoint report) come from
ProxyTrafficConfig; and every variant passes real Envoy's own validation (`envoy --mode validate`)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.commands.envoy_config import RESPONSE_PROCESSING, build_config, processing_mode, render
from extproc.config.settings import EppConfig, ProxyTrafficConfig
from testkit.envoy import envoy_binary

T = ProxyTrafficConfig()
ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")


def route(cfg: dict[str, Any]) -> dict[str, Any]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    [r] = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return dict(r)


def cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name))


@pytest.mark.parametrize("endpoints", [(), ENDPOINTS])
def test_circuit_breakers_sized_for_llm_concurrency(endpoints: tuple[str, ...]) -> None:
    cfg = build_config(8081, "127.0.0.1:9002", endpoints=endpoints)
    for name in ("picked", "epp"):
        [th] = cluster(cfg, name)["circuit_breakers"]["thresholds"]
        assert th == {"max_connections": T.max_connections, "max_pending_requests": T.max_pending_requests,
                      "max_requests": T.max_parallel_requests, "max_retries": T.max_parallel_retries}
        assert th["max_requests"] > 1024  # Envoy's default would 503 long generations above it


def test_no_retry_policy_with_a_single_endpoint() -> None:
    for endpoints in ((), ENDPOINTS):
        r = route(build_config(8081, "127.0.0.1:9002", endpoints=endpoints, max_endpoints=1))
        assert "retry_policy" not in r["route"]
        assert r["route"]["timeout"] == f"{T.route_timeout_s}s" and T.route_timeout_s >= 600


@pytest.mark.parametrize("max_endpoints", [2, 3])
def test_retry_walks_the_fallback_list_before_the_response_starts(max_endpoints: int) -> None:
    policy = route(build_config(8081, "127.0.0.1:9002", endpoints=ENDPOINTS,
                                max_endpoints=max_endpoints))["route"]["retry_policy"]
    assert policy["num_retries"] == max_endpoints - 1
    triggers = set(policy["retry_on"].split(","))
    assert triggers == {"connect-failure", "refused-stream", "reset-before-request", "retriable-status-codes"}
    # Never `reset`, `5xx` or a per-try timeout: those would re-run a generation that already started.
    assert not triggers & {"reset", "5xx", "gateway-error"} and "per_try_timeout" not in policy
    assert policy["retriable_status_codes"] == [502, 503, 504]


def test_served_endpoint_is_reported_to_the_picker() -> None:
    cfg = build_config(8081, "127.0.0.1:9002", endpoints=ENDPOINTS, max_endpoints=2)
    [add] = route(cfg)["response_headers_to_add"]
    assert add == {"header": {"key": "x-gateway-destination-endpoint-served", "value": "%UPSTREAM_HOST%"},
                   "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    # header_to_metadata after ext_proc: it runs first on the response path.
    assert names.index("envoy.filters.http.ext_proc") < names.index("envoy.filters.http.header_to_metadata")
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["metadata_options"]["forwarding_namespaces"] == {"untyped": ["envoy.lb"]}


@pytest.mark.parametrize("kwargs", [
    {},
    {"endpoints": ENDPOINTS, "max_endpoints": 3},
    {"max_endpoints": 2, "epp_tls": False, "request_body_mode": "BUFFERED"},
])
def test_real_envoy_accepts_the_config(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render(build_config(18081, "127.0.0.1:9002", 19901, **kwargs)))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_real_envoy_rejects_a_broken_config(tmp_path: Path) -> None:
    """The validation really checks: a non-numeric retry count is refused."""
    cfg = build_config(18081, "127.0.0.1:9002", endpoints=ENDPOINTS, max_endpoints=2)
    route(cfg)["route"]["retry_policy"]["num_retries"] = "two"
    path = tmp_path / "envoy.yaml"
    path.write_text(render(cfg))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0


def ext_proc(cfg: dict[str, object]) -> dict[str, object]:
    listener = cfg["static_resources"]["listeners"][0]  # type: ignore[index]
    filt = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]
    return filt["typed_config"]  # type: ignore[no-any-return]


def test_default_is_buffered_requests_and_the_response_end_only() -> None:
    cfg = build_config(8081, "127.0.0.1:9002")
    ep = ext_proc(cfg)
    assert ep["processing_mode"] == {
        "request_header_mode": "SEND", "request_body_mode": "BUFFERED", "request_trailer_mode": "SKIP",
        "response_header_mode": "SKIP", "response_body_mode": "NONE", "response_trailer_mode": "SEND",
    }
    assert ep["allow_mode_override"] is True
    listener = cfg["static_resources"]["listeners"][0]  # type: ignore[index]
    assert listener["per_connection_buffer_limit_bytes"] == EppConfig().max_request_body_bytes


def test_full_duplex_reference_and_no_buffer_limit() -> None:
    cfg = build_config(8081, "127.0.0.1:9002", request_body_mode="FULL_DUPLEX_STREAMED",
                       response_processing="full-duplex")
    mode = ext_proc(cfg)["processing_mode"]
    assert mode["request_trailer_mode"] == "SEND"  # type: ignore[index]
    assert mode["response_header_mode"] == "SEND"  # type: ignore[index]
    assert mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"  # type: ignore[index]
    assert "per_connection_buffer_limit_bytes" not in cfg["static_resources"]["listeners"][0]  # type: ignore[index]
    assert processing_mode("BUFFERED", "none")["response_trailer_mode"] == "SKIP"
    with pytest.raises(ValueError, match="response processing"):
        processing_mode("BUFFERED", "bodies")
    with pytest.raises(ValueError, match="request body mode"):
        processing_mode("STREAMED", "none")


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
@pytest.mark.parametrize("responses", RESPONSE_PROCESSING)
def test_real_envoy_accepts_every_wiring(tmp_path: Path, body_mode: str, responses: str) -> None:
    for endpoints in ((), ("127.0.0.1:8001", "127.0.0.1:8002")):
        path = tmp_path / "envoy.yaml"
        path.write_text(render(build_config(18081, "127.0.0.1:9002", 19901, request_body_mode=body_mode,
                                            response_processing=responses, endpoints=endpoints)))
        proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_streams_end_with_a_half_close_not_a_reset() -> None:
    cfg = build_config(8081, "127.0.0.1:9002")
    [layer] = cfg["layered_runtime"]["layers"]
    assert layer["static_layer"] == {"envoy.reloadable_features.ext_proc_graceful_grpc_close": True}
