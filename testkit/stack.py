"""A whole request path on 127.0.0.1 for end-to-end tests: echo backends, the picker, real Envoy.

- `echo_backends(tmp, n, delay)`: `n` backends (`python -m testkit.echo_backends`) on free
  ports; yields their ip:port once every one accepts connections.
- `stack(tmp, n_backends, *picker_flags, ...)`: the backends, a picker serving them
  (`testkit.picker`) and Envoy configured by `prefix-epp envoy-config` in front of it
  (`testkit.envoy.run_envoy`); yields a `Stack` whose `url` is Envoy's listener. Envoy's retry
  policy walks as many endpoints as the picker's `--max-endpoints`. `gateway` makes Envoy behave
  as that gateway does (testkit/gateways.py: body modes, trailers, served metadata, upstream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from testkit.envoy import run_envoy
from testkit.gateways import Gateway
from testkit.picker import Picker, picker_for
from testkit.procs import free_ports, python_module, running, wait_for_port


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


@contextlib.contextmanager
def echo_backends(tmp: Path, n: int, delay: float = 0.0) -> Iterator[list[str]]:
    ports = free_ports(n)
    args = python_module("testkit.echo_backends", *map(str, ports), "--delay", str(delay))
    with running(args, tmp / "backends.log", wait_port=ports[-1]):
        for port in ports:
            wait_for_port(port)
        yield [f"127.0.0.1:{p}" for p in ports]


@contextlib.contextmanager
def stack(tmp: Path, n_backends: int = 3, *picker_args: str, secure: bool = False, delay: float = 0.0,
          envoy_endpoints: bool = False, dead_endpoints: tuple[str, ...] = (),
          request_body_mode: str = "BUFFERED", response_processing: str = "end",
          failure_mode_allow: bool = False, gateway: Gateway | None = None) -> Iterator[Stack]:
    if gateway is not None:
        request_body_mode, envoy_endpoints = gateway.request_body_mode, gateway.fallbacks
    with echo_backends(tmp, n_backends, delay) as backends:
        endpoints = [*dead_endpoints, *backends]
        picker = picker_for(tmp, endpoints, *picker_args, secure=secure)
        picker.start()
        try:
            with run_envoy(tmp, picker.grpc_port, epp_tls=secure, request_body_mode=request_body_mode,
                           response_processing=response_processing,
                           endpoints=tuple(endpoints) if envoy_endpoints else (),
                           max_endpoints=_max_endpoints(picker_args),
                           failure_mode_allow=failure_mode_allow,
                           patch=gateway.patch if gateway is not None else None) as (_, listen, admin):
                yield Stack(backends, picker, listen, admin)
        finally:
            picker.stop()


def _max_endpoints(picker_args: tuple[str, ...]) -> int:
    """The picker's --max-endpoints, so Envoy's retry policy walks as many endpoints."""
    args = list(picker_args)
    return int(args[args.index("--max-endpoints") + 1]) if "--max-endpoints" in args else 1
