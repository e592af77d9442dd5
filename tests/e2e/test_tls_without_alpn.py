"""TLS to the picker without ALPN, as Envoy AI Gateway's InferencePool cluster connects (TLS
without verification and without ALPN, explicit HTTP/2): the picker's TLS gRPC server must accept
it, through real Envoy. The same request with ALPN h2 (prefix-epp envoy-config's default) is the
control; offering only http/1.1 is refused (Envoy answers 500, ext_proc being fail-closed)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from extproc.commands.envoy_config import build_config, render
from testkit.envoy import envoy_binary
from testkit.http_client import completion, post
from testkit.picker import picker_for
from testkit.procs import free_port, running
from testkit.stack import echo_backends

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("alpn", "status"), [(None, 200), (["h2"], 200), (["http/1.1"], 500)],
                         ids=["no-alpn", "h2", "http1-only"])
async def test_picker_tls_with_and_without_alpn(tmp_path: Path, alpn: list[str] | None, status: int) -> None:
    with echo_backends(tmp_path, 1) as backends:
        picker = picker_for(tmp_path, backends, secure=True)
        picker.start()
        try:
            listen = free_port()
            cfg = build_config(listen, f"127.0.0.1:{picker.grpc_port}", epp_tls=True, failure_mode_allow=False)
            epp = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "epp")
            tls = epp["transport_socket"]["typed_config"]["common_tls_context"]
            assert tls["validation_context"] == {}  # no verification of the self-signed certificate
            if alpn is None:
                del tls["alpn_protocols"]
            else:
                tls["alpn_protocols"] = alpn
            path = tmp_path / "envoy.yaml"
            path.write_text(render(cfg))
            args = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--base-id", str(listen),
                    "--log-level", "warning"]
            with running(args, tmp_path / "envoy.log", wait_port=listen):
                async with aiohttp.ClientSession() as s:
                    r = await post(s, f"http://127.0.0.1:{listen}/v1/completions", completion("over tls"))
        finally:
            picker.stop()
    assert r.status == status, r.body[:300]
    if status == 200:
        assert r.served_by == backends[0]
