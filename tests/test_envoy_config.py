"""`prefix-epp envoy-config`: processing modes per wiring, each accepted by real Envoy."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from extproc.config import EppConfig
from extproc.envoy_config import RESPONSE_PROCESSING, build_config, processing_mode, render
from tests.support.envoy import envoy_binary


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
