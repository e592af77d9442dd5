"""Fixtures for end-to-end tests: echo backends, the picker as a real process, real Envoy."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from extproc.pb import health_pb2, health_pb2_grpc
from tests.support.envoy import run_envoy
from tests.support.procs import Proc, free_ports, prefix_epp, python_module, running, wait_for_port


@dataclass
class Picker:
    grpc_port: int
    health_port: int
    metrics_port: int
    args: list[str]
    log: Path
    proc: Proc | None = None

    def start(self) -> None:
        self.proc = Proc(self.args, self.log)
        wait_ready(self.health_port, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


@dataclass
class Stack:
    backends: list[str]
    picker: Picker
    envoy_port: int
    admin_port: int
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"


def wait_ready(health_port: int, proc: Proc, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"picker exited:\n{proc.log_text()[-3000:]}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=0.5).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"picker not ready:\n{proc.log_text()[-3000:]}")


@contextlib.contextmanager
def echo_backends(tmp: Path, n: int, delay: float = 0.0) -> Iterator[list[str]]:
    ports = free_ports(n)
    args = python_module("tests.support.echo_backends", *map(str, ports), "--delay", str(delay))
    with running(args, tmp / "backends.log", wait_port=ports[-1]):
        for port in ports:
            wait_for_port(port)
        yield [f"127.0.0.1:{p}" for p in ports]


def picker_for(tmp: Path, endpoints: list[str], *extra: str, secure: bool = False, name: str = "picker") -> Picker:
    grpc_port, health_port, metrics_port = free_ports(3)
    args = prefix_epp(
        "serve", "--endpoints", ",".join(endpoints), "--grpc-port", str(grpc_port),
        "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
        f"--secure-serving={'true' if secure else 'false'}", "--bind-address", "127.0.0.1", *extra,
    )
    return Picker(grpc_port, health_port, metrics_port, args, tmp / f"{name}.log")


@contextlib.contextmanager
def stack(tmp: Path, n_backends: int = 3, *picker_args: str, secure: bool = False, delay: float = 0.0,
          envoy_endpoints: bool = False, dead_endpoints: tuple[str, ...] = (),
          request_body_mode: str = "BUFFERED", response_processing: str = "end",
          failure_mode_allow: bool = False) -> Iterator[Stack]:
    with echo_backends(tmp, n_backends, delay) as backends:
        endpoints = [*dead_endpoints, *backends]
        picker = picker_for(tmp, endpoints, *picker_args, secure=secure)
        picker.start()
        try:
            with run_envoy(tmp, picker.grpc_port, epp_tls=secure, request_body_mode=request_body_mode,
                           response_processing=response_processing,
                           endpoints=tuple(endpoints) if envoy_endpoints else (),
                           max_endpoints=_max_endpoints(picker_args),
                           failure_mode_allow=failure_mode_allow) as (_, listen, admin):
                yield Stack(backends, picker, listen, admin)
        finally:
            picker.stop()


def _max_endpoints(picker_args: tuple[str, ...]) -> int:
    """The picker's --max-endpoints, so Envoy's retry policy walks as many endpoints."""
    args = list(picker_args)
    return int(args[args.index("--max-endpoints") + 1]) if "--max-endpoints" in args else 1


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Three echo backends, a plaintext picker with decision explanations, Envoy in full-duplex mode."""
    with stack(tmp_path_factory.mktemp("stack"), 3, "--explain-decisions", "--seed", "7") as s:
        yield s
