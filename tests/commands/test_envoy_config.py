"""`prefix-epp envoy-config`: processing modes per wiring; the traffic defaults (circuit breakers,
retries only with fallbacks, long-generation timeout, served-endpoint report) come from
ProxyTrafficConfig; and every variant passes real Envoy's own validation (`envoy --mode validate`)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.commands.envoy_config import RESPONSE_PROCESSING, build_config, processing_mode, render
from extproc.commands.main import main
from extproc.config.settings import EppConfig, ProxyTrafficConfig
from testkit.certs import Authority
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


@pytest.mark.parametrize("endpoints", [(), ENDPOINTS])
def test_idle_model_connections_close_before_vllms_keep_alive_does(endpoints: tuple[str, ...]) -> None:
    """vLLM (uvicorn) closes a keep-alive connection idle for 5 s; a request Envoy sent on it then
    fails with 503 "connection termination". Envoy closes its idle ones first."""
    options = cluster(build_config(8081, "127.0.0.1:9002", endpoints=endpoints),
                      "picked")["typed_extension_protocol_options"]
    http = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert http["common_http_protocol_options"]["idle_timeout"] == f"{T.upstream_idle_timeout_s}s"
    assert T.upstream_idle_timeout_s < 5 and "http_protocol_options" in http["explicit_http_config"]


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
    assert triggers == {"connect-failure", "refused-stream", "reset", "retriable-status-codes"}
    # Envoy retries only before response headers went downstream: a reset or a 500 there (a killed
    # engine, an engine error) costs a retry on the next choice, never a second run of an answer the
    # client is receiving. No per-try timeout: that would cut a long generation.
    assert not triggers & {"5xx", "gateway-error"} and "per_try_timeout" not in policy
    assert policy["retriable_status_codes"] == [500, 502, 503, 504]


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


def test_streams_end_with_envoys_reset_unless_the_graceful_close_is_asked_for() -> None:
    assert "layered_runtime" not in build_config(8081, "127.0.0.1:9002")
    cfg = build_config(8081, "127.0.0.1:9002", graceful_ext_proc_close=True)
    [layer] = cfg["layered_runtime"]["layers"]
    assert layer["static_layer"] == {"envoy.reloadable_features.ext_proc_graceful_grpc_close": True}


# --- TLS to the picker and client-set control headers ------------------------------------------

def epp_tls_context(cfg: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = cluster(cfg, "epp")["transport_socket"]["typed_config"]
    return typed


def test_tls_without_a_ca_verifies_nothing() -> None:
    tls = epp_tls_context(build_config(8081, "picker.ns.svc:9002"))
    assert tls["common_tls_context"]["validation_context"] == {} and "sni" not in tls


@pytest.mark.parametrize(("epp", "server_name", "san_type", "sni"), [
    ("prefix-epp.ns.svc.cluster.local:9002", "", "DNS", "prefix-epp.ns.svc.cluster.local"),
    ("10.0.0.9:9002", "prefix-epp.ns.svc", "DNS", "prefix-epp.ns.svc"),
    ("10.0.0.9:9002", "", "IP_ADDRESS", None),
])
def test_a_ca_makes_envoy_verify_chain_and_name(epp: str, server_name: str, san_type: str, sni: str | None) -> None:
    tls = epp_tls_context(build_config(8081, epp, upstream_ca_file="/etc/ca.crt", upstream_server_name=server_name))
    ctx = tls["common_tls_context"]
    name = server_name or epp.rpartition(":")[0]
    assert ctx["validation_context"] == {
        "trusted_ca": {"filename": "/etc/ca.crt"},
        "match_typed_subject_alt_names": [{"san_type": san_type, "matcher": {"exact": name}}]}
    assert tls.get("sni") == sni
    assert ctx["alpn_protocols"] == ["h2"] and "tls_certificates" not in ctx


def test_client_certificate_for_mutual_tls() -> None:
    ctx = epp_tls_context(build_config(8081, "p:9002", upstream_ca_file="/ca", upstream_client_cert="/c.crt",
                                       upstream_client_key="/c.key"))["common_tls_context"]
    assert ctx["tls_certificates"] == [{"certificate_chain": {"filename": "/c.crt"},
                                        "private_key": {"filename": "/c.key"}}]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"upstream_client_cert": "/c.crt"}, "go together"),
    ({"upstream_server_name": "p"}, "needs --upstream-ca-file"),
    ({"epp_tls": False, "upstream_ca_file": "/ca"}, "need --epp-tls"),
])
def test_inconsistent_tls_flags_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config(8081, "p:9002", **kwargs)


def test_control_headers_are_stripped_before_any_filter() -> None:
    hcm = build_config(8081, "127.0.0.1:9002")["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    [mutation] = hcm["typed_config"]["early_header_mutation_extensions"]
    removed = {m["remove"] for m in mutation["typed_config"]["mutations"]}
    assert removed == {"test-epp-endpoint-selection", "x-gateway-destination-endpoint",
                       "x-gateway-destination-endpoint-subset", "x-gateway-destination-endpoint-served",
                       "x-prefiller-host-port"}
    off = build_config(8081, "127.0.0.1:9002", strip_control_headers=False)
    assert "early_header_mutation_extensions" not in off["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]


def test_real_envoy_accepts_the_verifying_mtls_config(tmp_path: Path) -> None:
    ca = Authority.create(tmp_path, "picker")
    client = ca.issue(tmp_path, "envoy", dns=("envoy",), client=True)
    path = tmp_path / "envoy.yaml"
    path.write_text(render(build_config(18081, "prefix-epp.ns.svc:9002", 19901, upstream_ca_file=str(ca.ca_file),
                                        upstream_client_cert=str(client / "tls.crt"),
                                        upstream_client_key=str(client / "tls.key"))))
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_cli_prints_the_verifying_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--epp", "prefix-epp.ns.svc:9002", "--upstream-ca-file", "/ca.crt",
                 "--strip-control-headers=false"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert epp_tls_context(cfg)["common_tls_context"]["validation_context"]["trusted_ca"] == {"filename": "/ca.crt"}
    assert epp_tls_context(cfg)["sni"] == "prefix-epp.ns.svc"


def test_the_cli_fails_open_and_adds_a_fallback_where_the_cluster_takes_a_list(
        capsys: pytest.CaptureFixture[str]) -> None:
    for extra, retries in (([], None), (["--endpoints", ",".join(ENDPOINTS)], 1),
                           (["--endpoints", ",".join(ENDPOINTS), "--max-endpoints", "1"], None)):
        assert main(["envoy-config", "--epp-tls=false", *extra]) == 0
        cfg = yaml.safe_load(capsys.readouterr().out)
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        assert ext["typed_config"]["failure_mode_allow"] is True
        policy = route(cfg)["route"].get("retry_policy")
        assert (policy and policy["num_retries"]) == retries or (policy is None and retries is None)
