"""Flow control through real Envoy (`prefix-epp envoy-config`, BUFFERED bodies) and the picker, in
front of two simulated vLLM engines that run 2 sequences each.

With a concurrency detector at 2 requests per engine the picker holds what the engines cannot run:
their own waiting queues stay empty while the picker's queue grows, and held requests go out as
slots free, each with the time it was held. Each outcome happens for real: a full band (429
rejected-saturated), a TTL that passes (429 rejected-ttl-expired), a client that leaves (its
request leaves the queue), a pool without endpoints (503 rejected-no-endpoints, discovered through
a Kubernetes API; a request waiting when a pod turns Ready goes to it), and a request held for
seconds is dispatched, not cut by Envoy.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas
from testkit.envoy import run_envoy
from testkit.kube import PODS, POOL_V1, KubeApi, pod, pool_v1
from testkit.picker import Picker, Samples, picker_for, until, value
from testkit.procs import free_ports, prefix_epp

pytestmark = pytest.mark.e2e

SIM = SimConfig(kv_events=False, max_num_seqs=2)  # 8 ms a token: 400 tokens hold a slot ~3.2 s
# The gate is the pool's (4 requests in flight); which engine takes a dispatched request is the
# scheduler's choice, here the one with the fewest in flight, so neither engine gets a third.
CONFIG = """\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: inflight-load-scorer
- type: concurrency-detector
  parameters: {maxConcurrency: 2}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: inflight-load-scorer}]
flowControl:
  defaultRequestTTL: 30s
  saturationDetector: {pluginRef: concurrency-detector}
  defaultPriorityBand: {maxRequests: 8}
"""


def queued(m: Samples) -> float:
    return sum(v for (name, _), v in m.items() if name == "prefix_epp_flow_control_queue_size")


def outcome(m: Samples, name: str) -> float:
    return value(m, "prefix_epp_flow_control_requests_total", outcome=name, priority="0")


def engine_load(port: int) -> float:
    """An engine's requests, running and waiting. A request waits for the engine's next step even
    with a slot free, so `waiting` alone blinks to 1; beyond its 2 slots a request waits for a slot."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name in ("vllm:num_requests_waiting", "vllm:num_requests_running"))


@contextlib.asynccontextmanager
async def flow_stack(tmp: Path, config: str = CONFIG) -> AsyncIterator[tuple[Picker, str, list[int]]]:
    async with run_replicas(SIM, 2, base_port=0) as reps:
        ports = [r.port for r in reps]
        picker = picker_for(tmp, [f"127.0.0.1:{p}" for p in ports], "--refresh-metrics-interval", "0",
                            "--config-text", config)
        await asyncio.to_thread(picker.start)  # the simulated engines keep running in this loop meanwhile
        try:
            with contextlib.ExitStack() as stack:
                _, listen, _ = await asyncio.to_thread(stack.enter_context, run_envoy(tmp, picker.grpc_port))
                yield picker, f"http://127.0.0.1:{listen}/v1/completions", ports
        finally:
            await asyncio.to_thread(picker.stop)


async def post(s: aiohttp.ClientSession, url: str, tokens: int, **headers: str) -> tuple[int, dict[str, str], bytes]:
    body = {"model": "sim-model", "prompt": f"tell me {tokens} things", "max_tokens": tokens}
    async with s.post(url, json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_held_requests_wait_in_the_picker_not_the_engines_and_every_outcome_happens(tmp_path: Path) -> None:
    async with flow_stack(tmp_path) as (picker, url, ports), aiohttp.ClientSession() as s:
        most = 0.0
        done = asyncio.Event()

        async def watch_engines() -> None:  # samples the engines' own load for the whole run
            nonlocal most
            while not done.is_set():
                for port in ports:
                    most = max(most, await asyncio.to_thread(engine_load, port))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch_engines())
        # Four long generations fill both engines' two slots: the pool is saturated.
        long = [asyncio.create_task(post(s, url, 400)) for _ in range(4)]
        await until(picker, lambda m: value(m, "prefix_epp_flow_control_requests_total", outcome="Dispatched",
                                            priority="0") == 4)
        # A request that may wait only 300 ms is evicted when they pass: 429 rejected-ttl-expired.
        status, headers, body = await post(s, url, 5, **{"x-llm-d-inference-ttl": "300ms"})
        assert status == 429 and headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
        assert b'"type":"RateLimitError"' in body
        # A client that leaves: its request leaves the queue at once.
        gone = asyncio.create_task(post(s, url, 5, **{"x-llm-d-inference-fairness-id": "leaver"}))
        await until(picker, lambda m: queued(m) == 1)
        gone.cancel()
        m = await until(picker, lambda m: queued(m) == 0 and outcome(m, "EvictedContextCancelled") == 1)
        # Eight more fill the band (maxRequests 8); the ninth is refused at once.
        held = [asyncio.create_task(post(s, url, 20, **{"x-llm-d-inference-fairness-id": f"tenant-{i % 2}"}))
                for i in range(8)]
        m = await until(picker, lambda m: queued(m) == 8)
        assert value(m, "prefix_epp_flow_control_queue_size", fairness_id="tenant-0", priority="0") == 4
        status, headers, body = await post(s, url, 5)
        assert status == 429 and headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        # The long generations end; the held requests go out as their slots free, after seconds held.
        results = await asyncio.wait_for(asyncio.gather(*long, *held), 60)
        done.set()
        await watcher
        assert [r[0] for r in results] == [200] * 12
        assert [r[1]["x-llm-d-flow-queue-duration-ms"] for r in results[:4]] == ["0"] * 4
        waited = [int(r[1]["x-llm-d-flow-queue-duration-ms"]) for r in results[4:]]
        assert min(waited) >= 2000, waited  # held for seconds behind the 3.2 s generations, not cut by Envoy
        assert most == 2  # no engine ever held more than its 2 slots: the picker held the rest
        m = await until(picker, lambda m: outcome(m, "Dispatched") == 12 and queued(m) == 0)
        assert outcome(m, "RejectedCapacity") == 1 and outcome(m, "EvictedTTL") == 1
        assert value(m, "prefix_epp_flow_control_pool_saturation") == 0


async def test_without_flow_control_the_engines_queue_instead(tmp_path: Path) -> None:
    config = "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\n"
    async with flow_stack(tmp_path, config) as (_picker, url, ports), aiohttp.ClientSession() as s:
        requests = [asyncio.create_task(post(s, url, 100)) for _ in range(10)]
        most = 0.0
        while most < 4 and not all(r.done() for r in requests):  # sampled until seen, or all done
            most = max([most, *[await asyncio.to_thread(engine_load, p) for p in ports]])
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*requests)
        assert [r[0] for r in results] == [200] * 10
        assert "x-llm-d-flow-queue-duration-ms" not in results[0][1]
        assert most >= 4  # 10 requests on 4 slots: the engines hold the rest, 2 or more waiting for a slot


async def test_an_empty_pool_holds_requests_until_an_endpoint_comes_then_answers_503(tmp_path: Path) -> None:
    # Kubernetes discovery (a real HTTP API, testkit/kube.py) of a pool whose pods are not there yet.
    config = ("apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nfeatureGates: [flowControl]\n"
              "flowControl: {noEndpointRequestTTL: 1s, saturationDetector: {pluginRef: concurrency-detector}}\n")
    api = KubeApi().start()
    grpc_port, health_port, metrics_port = free_ports(3)
    args = prefix_epp("serve", "--pool-name", "pool", "--pool-namespace", "default", "--kubeconfig",
                      str(api.write_kubeconfig(tmp_path / "kubeconfig")), "--secure-serving=false",
                      "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port",
                      str(health_port), "--metrics-port", str(metrics_port), "--refresh-metrics-interval", "0",
                      "--config-text", config)
    picker = Picker(grpc_port, health_port, metrics_port, args, tmp_path / "picker.log")
    try:
        async with run_replicas(SIM, 1, base_port=0) as reps:
            api.create(POOL_V1, pool_v1("pool", {"app": "vllm"}, [reps[0].port]))
            await asyncio.to_thread(picker.start)
            with contextlib.ExitStack() as stack:
                _, listen, _ = await asyncio.to_thread(stack.enter_context, run_envoy(tmp_path, grpc_port))
                url = f"http://127.0.0.1:{listen}/v1/completions"
                async with aiohttp.ClientSession() as s:
                    start = asyncio.get_running_loop().time()
                    status, headers, body = await post(s, url, 5)
                    assert status == 503 and headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
                    assert asyncio.get_running_loop().time() - start >= 1.0 and b"ServiceUnavailableError" in body
                    # A request waiting when the first pod turns Ready goes to it.
                    waiting = asyncio.create_task(post(s, url, 5))
                    await until(picker, lambda m: queued(m) == 1)
                    await asyncio.to_thread(api.create, PODS, pod("pod-0", {"app": "vllm"}))
                    status, headers, _ = await asyncio.wait_for(waiting, 30)
                    assert status == 200 and int(headers["x-llm-d-flow-queue-duration-ms"]) > 0
                m = await until(picker, lambda m: outcome(m, "EvictedNoEndpoints") == 1
                                and outcome(m, "Dispatched") == 1)
                assert queued(m) == 0
    finally:
        await asyncio.to_thread(picker.stop)
        api.close()


# A profile that weighs nothing but the prompt's prefix sends one prompt to one engine however
# loaded; under flow control the scheduler chooses only among the engines below the detector's
# limit, so each engine still gets no more than its 2.
PREFIX_ONLY = CONFIG.replace("- type: inflight-load-scorer\n", "- type: prefix-cache-scorer\n").replace(
    "plugins: [{pluginRef: inflight-load-scorer}]", "plugins: [{pluginRef: prefix-cache-scorer}]")


async def test_dispatch_goes_only_to_endpoints_below_their_own_limit(tmp_path: Path) -> None:
    async with flow_stack(tmp_path, PREFIX_ONLY) as (picker, url, ports), aiohttp.ClientSession() as s:
        first = await post(s, url, 1)  # the prompt is now recorded on one engine
        assert first[0] == 200
        calls = [asyncio.create_task(post(s, url, 400)) for _ in range(4)]
        m = await until(picker, lambda m: outcome(m, "Dispatched") == 5)
        per_engine = [value(m, "prefix_epp_inflight_requests", endpoint=f"127.0.0.1:{p}") for p in ports]
        assert sorted(per_engine) == [2, 2], per_engine  # the prefix's engine took 2, the other the rest
        assert max([await asyncio.to_thread(engine_load, p) for p in ports]) <= 2  # the engines run in this loop
        assert [status for status, _, _ in await asyncio.gather(*calls)] == [200] * 4
