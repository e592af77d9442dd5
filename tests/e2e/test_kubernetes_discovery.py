"""Kubernetes discovery end to end: kmock API, the picker as a real process, real Envoy, real backends.

Every pod has podIP 127.0.0.1 and picks its own backend port through the
`inference.networking.k8s.io/active-ports` annotation (one pool target port per backend), so all
traffic stays on 127.0.0.1. Requests carry distinct prompts, so routing follows load, not prefixes.
The measured reaction times (pod deleted -> no more traffic; pod ready -> traffic) are printed
and bounded.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import urllib3

from extproc.config.settings import DrainConfig
from extproc.pb import health_pb2, health_pb2_grpc
from testkit.envoy import run_envoy
from testkit.kube import OBJECTIVES, PODS, POOL_V1, KubeApi, objective, pod, pool_v1, ready_condition
from testkit.procs import Proc, free_ports, prefix_epp, python_module, running, wait_for_port

pytestmark = pytest.mark.e2e
HTTP = urllib3.PoolManager(maxsize=4)


@dataclass
class Stack:
    api: KubeApi
    ports: list[int]
    picker: Proc
    health_port: int
    metrics_port: int
    envoy_port: int
    counter: int = 0

    def ask(self, objective: str = "") -> tuple[int, str]:
        """One completion through Envoy with a fresh prompt: (status, backend port or "")."""
        self.counter += 1
        body = json.dumps({"model": "m", "prompt": f"request {self.counter} " * 20, "max_tokens": 1})
        headers = {"content-type": "application/json"}
        if objective:
            headers["x-gateway-inference-objective"] = objective
        r = HTTP.request("POST", f"http://127.0.0.1:{self.envoy_port}/v1/completions", body=body,
                         headers=headers, timeout=5.0, retries=False)
        return r.status, r.headers.get("x-served-by", "").rpartition(":")[2]

    def probe(self, port: int) -> int:
        """Status of a request pinned (test-epp-endpoint-selection) to 127.0.0.1:port: 200 while the
        picker knows that endpoint, 503 once it does not."""
        r = HTTP.request("POST", f"http://127.0.0.1:{self.envoy_port}/v1/completions",
                         body=b'{"model": "m", "prompt": "probe"}', timeout=5.0, retries=False,
                         headers={"content-type": "application/json",
                                  "test-epp-endpoint-selection": f"127.0.0.1:{port}"})
        return r.status

    def served(self, n: int) -> set[str]:
        out = set()
        for _ in range(n):
            status, port = self.ask()
            assert status == 200, status
            out.add(port)
        return out

    def readiness(self) -> int:
        """The readiness status; -1 when the check does not answer in time (a busy machine)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as ch:
            req = health_pb2.HealthCheckRequest(service="readiness")
            try:
                return int(health_pb2_grpc.HealthStub(ch).Check(req, timeout=5.0).status)
            except grpc.RpcError:
                return -1


SERVING = health_pb2.HealthCheckResponse.SERVING


def until(cond: Callable[[], bool], timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)
    return time.monotonic() - t0


def first_request_served_by(stack: Stack, port: str, timeout: float = 10.0) -> float:
    """Send requests back to back from now; seconds until one is served by `port`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if stack.ask()[1] == port:
            return time.monotonic() - t0
    raise TimeoutError(f"no request reached port {port}")


def last_request_served_by(stack: Stack, port: str, quiet: int = 30, timeout: float = 10.0) -> float:
    """Send requests from now until `quiet` in a row avoid `port`; seconds until the last that did not."""
    t0 = time.monotonic()
    last, streak = 0.0, 0
    while streak < quiet:
        assert time.monotonic() - t0 < timeout, f"port {port} kept receiving traffic"
        status, got = stack.ask()
        if got == port or status != 200:
            last, streak = time.monotonic() - t0, 0
        else:
            streak += 1
    return last


@contextlib.contextmanager
def kube_stack(tmp: Path, backend_module: str, n_backends: int = 3,
               api_started: bool = True) -> Iterator[Stack]:
    api = KubeApi()
    if api_started:
        api.start()
    ports = free_ports(n_backends)
    grpc_port, health_port, metrics_port = free_ports(3)
    kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
    args = prefix_epp("serve", "--pool-name", "pool", "--pool-namespace", "default", "--kubeconfig", str(kubeconfig),
                      "--secure-serving=false", "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port),
                      "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port),
                      "--explain-decisions", "--enable-test-endpoint-selection")  # probe() pins requests
    try:
        with running(python_module(backend_module, *map(str, ports)), tmp / "backends.log", wait_port=ports[-1]), \
                running(args, tmp / "picker.log", wait_port=health_port) as picker, \
                run_envoy(tmp, grpc_port) as (_, envoy_port, _admin):
            for p in ports:
                wait_for_port(p)
            yield Stack(api, ports, picker, health_port, metrics_port, envoy_port)
    finally:
        api.close()


def test_traffic_follows_pods_and_pool_through_envoy(tmp_path: Path) -> None:
    with kube_stack(tmp_path, "testkit.echo_backends", api_started=False) as s:
        p0, p1, p2 = (str(p) for p in s.ports)
        # The API is down at start-up: once the picker has tried it, not ready, and requests fail.
        deadline = time.monotonic() + 30
        while "kubernetes API request failed" not in s.picker.log_text() and time.monotonic() < deadline:
            assert s.picker.alive(), s.picker.log_text()
            time.sleep(0.05)
        assert "kubernetes API request failed" in s.picker.log_text()
        assert s.readiness() != SERVING
        assert s.ask()[0] == 503
        s.api.start()
        t_api = time.monotonic()
        s.api.create(POOL_V1, pool_v1("pool", {"app": "vllm"}, s.ports))
        s.api.create(PODS, pod("pod-a", {"app": "vllm"}, active_ports=[s.ports[0]]))
        s.api.create(PODS, pod("pod-b", {"app": "vllm"}, active_ports=[s.ports[1]], ready=False))
        until(lambda: s.readiness() == SERVING)
        print(f"\nAPI up -> picker ready: {time.monotonic() - t_api:.2f} s")
        s.api.wait_watching(POOL_V1, PODS, OBJECTIVES)
        assert s.served(15) == {p0}

        s.api.patch(PODS, "pod-b", {"status": {"conditions": [ready_condition(True)]}})
        t_ready = first_request_served_by(s, p1)
        s.api.patch(PODS, "pod-b", {"metadata": {"labels": {"app": "other"}}})
        t_unlabel = last_request_served_by(s, p1)
        s.api.patch(PODS, "pod-b", {"metadata": {"labels": {"app": "vllm"}}})
        first_request_served_by(s, p1)
        s.api.delete(PODS, "pod-a")
        t_delete = last_request_served_by(s, p0)
        assert t_ready < 1.0 and t_unlabel < 1.0 and t_delete < 1.0
        assert s.served(10) == {p1}

        # Reaction times, probed with requests pinned to the pod's endpoint (~3 ms resolution).
        to_routed, to_gone = [], []
        for i in range(5):
            s.api.create(PODS, pod(f"pod-x{i}", {"app": "vllm"}, active_ports=[s.ports[2]]))
            t0 = time.monotonic()
            until(lambda: s.probe(s.ports[2]) == 200)
            to_routed.append(time.monotonic() - t0)
            s.api.delete(PODS, f"pod-x{i}")
            t0 = time.monotonic()
            until(lambda: s.probe(s.ports[2]) == 503)
            to_gone.append(time.monotonic() - t0)
        for what, times in (("new ready pod -> routed", to_routed), ("pod deleted -> not routed", to_gone)):
            print(f"{what}: median {sorted(times)[2] * 1000:.1f} ms, max {max(times) * 1000:.1f} ms")
        assert max(to_routed) < 0.5 and max(to_gone) < 0.5
        assert s.served(10) == {p1}

        # Pool edits: a new selector and new ports take effect without restart.
        s.api.create(PODS, pod("pod-c", {"app": "next"}, active_ports=[s.ports[1]]))
        s.api.create(PODS, pod("pod-d", {"app": "next"}, active_ports=[s.ports[2]]))
        s.api.patch(POOL_V1, "pool", {"spec": {"selector": {"matchLabels": {"app": "next"}},
                                               "targetPorts": [{"number": s.ports[2]}]}})
        until(lambda: s.served(5) == {p2})
        assert s.served(10) == {p2}
        s.api.patch(POOL_V1, "pool", {"spec": {"targetPorts": [{"number": s.ports[1]}, {"number": s.ports[2]}]}})
        until(lambda: s.served(10) == {p1, p2})

        # The pods watch is cut and the re-watch answered 410 Gone; pod-d's deletion was "lost"
        # meanwhile (no event): the relist must drop it, and traffic must follow.
        s.api.gone_on_next_watch(PODS)
        s.api.forget(PODS, "pod-d")
        s.api.cut_watches(PODS)
        t_gone = last_request_served_by(s, p2)
        print(f"410 Gone -> relist -> last request routed to the vanished pod: {t_gone * 1000:.1f} ms")
        assert s.served(10) == {p1}
        assert "watch expired (410 Gone)" in s.picker.log_text()
        # A pool-watch cut without 410 is a plain re-watch: nothing changes.
        watches = s.api.watch_count(POOL_V1)
        s.api.cut_watches(POOL_V1)
        deadline = time.monotonic() + 15
        while s.api.watch_count(POOL_V1) == watches and time.monotonic() < deadline:  # watching again
            time.sleep(0.01)
        assert s.api.watch_count(POOL_V1) > watches
        assert s.served(10) == {p1} and s.readiness() == SERVING
        metrics = HTTP.request("GET", f"http://127.0.0.1:{s.metrics_port}/metrics").data.decode()
        assert 'inference_pool_ready_pods{name="pool"} 1.0' in metrics
        assert f'prefix_epp_endpoint_metrics_stale{{endpoint="127.0.0.1:{p1}"}} 1.0' in metrics  # echo: no vLLM
        # SIGTERM: after the drain's quiet period (no stream is open), the watch threads are stopped
        # and joined; the process exits cleanly and promptly.
        t0 = time.monotonic()
        s.picker.stop(timeout=5.0 + DrainConfig().idle_s)
        assert s.picker.popen.returncode == 0 and time.monotonic() - t0 < 3.0 + DrainConfig().idle_s


def test_objectives_and_saturation_shed_only_sheddable_requests(tmp_path: Path) -> None:
    with kube_stack(tmp_path, "testkit.vllm_stubs", n_backends=2) as s:
        s.api.create(POOL_V1, pool_v1("pool", {"app": "vllm"}, s.ports))
        for i, port in enumerate(s.ports):
            s.api.create(PODS, pod(f"pod-{i}", {"app": "vllm"}, active_ports=[port]))
        s.api.create(OBJECTIVES, objective("batch", "pool", -1))
        s.api.create(OBJECTIVES, objective("chat", "pool", 5))

        def set_load(waiting: float, kv: float) -> None:
            for port in s.ports:
                HTTP.request("POST", f"http://127.0.0.1:{port}/control", body=json.dumps(
                    {"waiting": waiting, "running": 1, "kv": kv}).encode())

        set_load(0, 0.1)
        until(lambda: s.readiness() == SERVING)
        s.api.wait_watching(POOL_V1, PODS, OBJECTIVES)
        until(lambda: s.ask("batch")[0] == 200)  # scraped: not saturated, sheddable passes
        metrics = HTTP.request("GET", f"http://127.0.0.1:{s.metrics_port}/metrics").data.decode()
        assert 'inference_pool_average_kv_cache_utilization{name="pool"} 0.1' in metrics
        assert 'inference_pool_per_pod_queue_size{model_server_pod="pod-0-rank-0",name="pool"} 0.0' in metrics
        set_load(6, 0.5)  # queue 6 > 5: saturated
        until(lambda: s.ask("batch")[0] == 429)
        assert [s.ask(o)[0] for o in ("chat", "unknown", "")] == [200, 200, 200]
        s.api.patch(OBJECTIVES, "batch", {"spec": {"priority": 0}})
        until(lambda: s.ask("batch")[0] == 200)
        s.api.patch(OBJECTIVES, "batch", {"spec": {"priority": -5}})
        until(lambda: s.ask("batch")[0] == 429)
        set_load(1, 0.2)
        until(lambda: s.ask("batch")[0] == 200)
