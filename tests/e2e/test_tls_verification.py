"""Envoy verifies the picker, and the picker may verify Envoy: `prefix-epp envoy-config
--upstream-ca-file` (chain, SNI and SAN) and `prefix-epp serve --client-ca-file` (mutual TLS),
through real Envoy and real gRPC.

The attacks: a process that takes the picker's address (here: another picker with its default
self-signed certificate, or one with a certificate of the right CA for another name) receives the
ext_proc stream, i.e. every prompt, unless Envoy verifies; a client without a certificate the
picker's client CA signed opens ext_proc streams unless the picker requires one. ext_proc is
fail-closed, so a refused handshake is a 500 from Envoy, never an unrouted request. And a client's
`test-epp-endpoint-selection` header reaches the picker unless Envoy strips it first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from extproc.commands.envoy_config import build_config, render
from extproc.pb import external_processor_pb2 as pb
from extproc.pb import external_processor_pb2_grpc as pb_grpc
from testkit.certs import Authority
from testkit.envoy import envoy_binary
from testkit.http_client import Reply, completion, post
from testkit.picker import Picker, picker_for
from testkit.procs import free_port, running
from testkit.stack import echo_backends

pytestmark = pytest.mark.e2e

NAME = "picker.prefix-epp.test"  # the name the picker's certificate is issued for


@contextlib.contextmanager
def started(picker: Picker) -> Iterator[Picker]:
    picker.start()
    try:
        yield picker
    finally:
        picker.stop()


async def through_envoy(tmp: Path, picker: Picker, label: str, **tls: Any) -> Reply:
    """One completion through a fresh Envoy whose picker cluster has the given TLS settings."""
    listen = free_port()
    path = tmp / f"envoy-{label}.yaml"
    # Fail closed: a picker Envoy cannot verify answers 500, not an unsteered 503.
    path.write_text(render(build_config(listen, f"127.0.0.1:{picker.grpc_port}", epp_tls=True,
                                        failure_mode_allow=False, **tls)))
    args = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--base-id", str(listen), "--log-level", "warning"]
    with running(args, tmp / f"envoy-{label}.log", wait_port=listen):
        async with aiohttp.ClientSession() as s:
            return await post(s, f"http://127.0.0.1:{listen}/v1/completions", completion(f"secret prompt {label}"))


def serving(tmp: Path, backends: list[str], authority: Authority, name: str, *flags: str,
            dns: tuple[str, ...] = (NAME,)) -> Picker:
    cert = authority.issue(tmp / "certs", name, dns=dns)
    return picker_for(tmp, backends, "--cert-path", str(cert), *flags, secure=True, name=name)


async def test_envoy_verifies_the_picker_certificate(tmp_path: Path) -> None:
    ca = Authority.create(tmp_path / "ca", "picker")
    verify = {"upstream_ca_file": str(ca.ca_file), "upstream_server_name": NAME}
    with echo_backends(tmp_path, 1) as backends:
        with started(serving(tmp_path, backends, ca, "real")) as real:
            ok = await through_envoy(tmp_path, real, "real", **verify)
        # An impostor on the picker's address with the picker's default (self-signed) certificate:
        # the unverified reference configuration hands it the prompt; the verifying one does not.
        with started(picker_for(tmp_path, backends, secure=True, name="self-signed")) as impostor:
            unverified = await through_envoy(tmp_path, impostor, "unverified")
            refused = await through_envoy(tmp_path, impostor, "impostor", **verify)
        # A certificate of the right CA issued for another name fails the SAN match.
        with started(serving(tmp_path, backends, ca, "other-name", dns=("other.prefix-epp.test",))) as other:
            wrong_name = await through_envoy(tmp_path, other, "wrong-name", **verify)
    assert ok.status == 200 and ok.served_by == backends[0], ok.body[:300]
    assert unverified.status == 200, unverified.body[:300]
    assert refused.status == 500, refused.body[:300]
    assert wrong_name.status == 500, wrong_name.body[:300]


def ext_proc_call(port: int, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    """Open one ext_proc stream with request headers; the status it ends with (OK: it was served)."""
    options = [("grpc.ssl_target_name_override", NAME)]
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=True))
        try:
            for _ in stub.Process(iter([headers]), timeout=5):
                return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


async def test_picker_requires_the_client_certificate(tmp_path: Path) -> None:
    server_ca = Authority.create(tmp_path / "ca", "picker")
    client_ca = Authority.create(tmp_path / "ca", "envoy")
    envoy_cert = client_ca.issue(tmp_path / "certs", "envoy-client", dns=("envoy",), client=True)
    # A certificate from a CA the picker does not trust is no better than none.
    stranger_ca = Authority.create(tmp_path / "ca", "stranger")
    stranger = stranger_ca.issue(tmp_path / "certs", "stranger-client", dns=("envoy",), client=True)
    verify = {"upstream_ca_file": str(server_ca.ca_file), "upstream_server_name": NAME}
    mtls = ("--client-ca-file", str(client_ca.ca_file))
    with echo_backends(tmp_path, 1) as backends, started(serving(tmp_path, backends, server_ca, "mtls", *mtls)) as p:
        without = await through_envoy(tmp_path, p, "no-client-cert", **verify)
        foreign = await through_envoy(tmp_path, p, "foreign-cert", **verify,
                                      upstream_client_cert=str(stranger / "tls.crt"),
                                      upstream_client_key=str(stranger / "tls.key"))
        with_cert = await through_envoy(tmp_path, p, "client-cert", **verify,
                                        upstream_client_cert=str(envoy_cert / "tls.crt"),
                                        upstream_client_key=str(envoy_cert / "tls.key"))
        # Any in-cluster client straight to the port, without a certificate: no stream.
        trust = server_ca.ca_file.read_bytes()
        direct = ext_proc_call(p.grpc_port, grpc.ssl_channel_credentials(root_certificates=trust))
        direct_ok = ext_proc_call(p.grpc_port, grpc.ssl_channel_credentials(
            root_certificates=trust, private_key=(envoy_cert / "tls.key").read_bytes(),
            certificate_chain=(envoy_cert / "tls.crt").read_bytes()))
    assert without.status == 500, without.body[:300]
    assert foreign.status == 500, foreign.body[:300]
    assert with_cert.status == 200 and with_cert.served_by == backends[0], with_cert.body[:300]
    assert direct == grpc.StatusCode.UNAVAILABLE
    assert direct_ok == grpc.StatusCode.OK


def test_client_ca_without_tls_is_refused(tmp_path: Path) -> None:
    ca = Authority.create(tmp_path / "ca", "envoy")
    picker = picker_for(tmp_path, ["127.0.0.1:1"], "--client-ca-file", str(ca.ca_file), secure=False)
    with pytest.raises(RuntimeError, match="--client-ca-file needs --secure-serving"):
        picker.start()


@pytest.mark.parametrize(("strip", "status"), [(True, 200), (False, 503)], ids=["stripped", "passed-through"])
async def test_client_set_endpoint_selection_is_stripped(tmp_path: Path, strip: bool, status: int) -> None:
    """A client names an endpoint the pool does not have, and the picker honours the header
    (--enable-test-endpoint-selection, as for conformance tests): passed through it is obeyed
    (503, no candidate); stripped before any filter, the picker routes as usual."""
    picker_args = ("--enable-test-endpoint-selection",)
    with echo_backends(tmp_path, 1) as backends, started(picker_for(tmp_path, backends, *picker_args)) as picker:
        listen = free_port()
        path = tmp_path / "envoy.yaml"
        path.write_text(render(build_config(listen, f"127.0.0.1:{picker.grpc_port}", epp_tls=False,
                                            strip_control_headers=strip)))
        args = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--base-id", str(listen),
                "--log-level", "warning"]
        with running(args, tmp_path / "envoy.log", wait_port=listen):
            async with aiohttp.ClientSession() as s:
                r = await post(s, f"http://127.0.0.1:{listen}/v1/completions", completion("steer me"),
                               headers={"test-epp-endpoint-selection": "10.255.0.1:8000",
                                        "x-gateway-destination-endpoint": "10.255.0.1:8000"})
    assert r.status == status, r.body[:300]
    if strip:
        assert r.served_by == backends[0]
