"""Flow control in front of real vLLM: two engines of vLLM's CPU build (testkit/vllm.py) that run
2 sequences each (`--max-num-seqs 2`), real Envoy, the picker discovering them through a Kubernetes
API (testkit/kube.py) with three InferenceObjectives: `premium` (priority 10), `batch` (-1) and
`background` (-5, a band of one request).

With a concurrency detector at 2 requests per engine, the picker holds what the engines cannot run:
their own `vllm:num_requests_waiting` stays near zero while the picker's queue grows, and without
flow control the engines queue instead. Premium requests sent while a batch flood is held go out
at the first free slot, ahead of the batch requests that came before them. Each outcome happens
against the real engines (a full band, a TTL that passes, a client that leaves, dispatch after
seconds held); the first three in the background band, below the held batch, so no slot freeing
meanwhile can dispatch them. Nothing is left open: every request completes or gets its error, the
picker ends with no stream open and the engines with nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from testkit.envoy import run_envoy
from testkit.kube import OBJECTIVES, PODS, POOL_V1, KubeApi, objective, pod, pool_v1
from testkit.picker import Picker, Samples, scrape, until, value
from testkit.procs import free_ports, prefix_epp
from testkit.vllm import Engine, engines
from testkit.vllm_env import MODEL_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(600)]

SEQS = 2  # --max-num-seqs of each engine
LONG = 800  # tokens: ~2 s of decoding on the tiny model, two sequences an engine
SCORER = """\
- type: inflight-load-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: inflight-load-scorer}]
"""
# The gate is the pool's (4 in flight); the load-aware scorer keeps each engine within its 2.
FLOW = f"""\
apiVersion: llm-d.ai/v1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {{maxConcurrency: {SEQS}}}
{SCORER}flowControl:
  defaultRequestTTL: 60s
  saturationDetector: {{pluginRef: concurrency-detector}}
  priorityBands:
  - {{priority: -5, maxRequests: 1}}
"""
NO_FLOW = f"apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins:\n{SCORER}"


@dataclass
class Pool:
    engines: list[Engine]
    kubeconfig: Path


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("vllm-flow")
    with engines(tmp, 2, extra_args=("--max-num-seqs", str(SEQS))) as started, KubeApi().start() as api:
        api.create(POOL_V1, pool_v1("pool", {"app": "vllm"}, [e.port for e in started]))
        for i, e in enumerate(started):
            api.create(PODS, pod(f"vllm-{i}", {"app": "vllm"}, ip=e.address, active_ports=[e.port]))
        api.create(OBJECTIVES, objective("premium", "pool", 10))
        api.create(OBJECTIVES, objective("batch", "pool", -1))
        api.create(OBJECTIVES, objective("background", "pool", -5))
        yield Pool(started, api.write_kubeconfig(tmp / "kubeconfig"))


@contextlib.asynccontextmanager
async def stack(tmp: Path, pool: Pool, config: str) -> AsyncIterator[tuple[Picker, str]]:
    grpc_port, health_port, metrics_port = free_ports(3)
    args = prefix_epp("serve", "--pool-name", "pool", "--pool-namespace", "default", "--kubeconfig",
                      str(pool.kubeconfig), "--secure-serving=false", "--bind-address", "127.0.0.1",
                      "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                      "--metrics-port", str(metrics_port), "--config-text", config)
    picker = Picker(grpc_port, health_port, metrics_port, args, tmp / "picker.log")
    await asyncio.to_thread(picker.start)
    try:
        await until(picker, lambda m: m.get(("inference_pool_ready_pods", (("name", "pool"),))) == 2)
        with contextlib.ExitStack() as es:
            _, listen, _ = await asyncio.to_thread(es.enter_context, run_envoy(tmp, grpc_port))
            yield picker, f"http://127.0.0.1:{listen}/v1/completions"
    finally:
        await asyncio.to_thread(picker.stop)


async def post(s: aiohttp.ClientSession, url: str, tokens: int, **headers: str) -> tuple[int, dict[str, str]]:
    body = {"model": MODEL_NAME, "prompt": f"tell me {tokens} things", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}
    async with s.post(url, json=body, headers=headers) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


def objective_header(name: str, **headers: str) -> dict[str, str]:
    return {"x-gateway-inference-objective": name, **headers}


class EngineWatch:
    """The most `vllm:num_requests_waiting` any engine reported while it ran (sampled). A scrape
    that times out is skipped, not fatal: on 2 shared cores an engine's server, busy streaming 16
    generations, once took over 10 s to render /metrics. `samples` counts the readings taken."""

    def __init__(self, pool: Pool) -> None:
        self.engines = pool.engines
        self.most = 0.0
        self.samples = 0
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            for e in self.engines:
                try:
                    waiting = await asyncio.to_thread(e.counter, "vllm:num_requests_waiting")
                except OSError:  # urllib's timeout (TimeoutError) or a refused read
                    continue
                self.most = max(self.most, waiting)
                self.samples += 1
            await asyncio.sleep(0.02)

    async def stop(self) -> float:
        self._stop.set()
        await self._task
        return self.most


def held(m: Samples, **labels: str) -> float:
    return sum(v for (name, ls), v in m.items() if name == "prefix_epp_flow_control_queue_size"
               and all(dict(ls).get(k) == want for k, want in labels.items()))


def outcome(m: Samples, name: str, priority: str) -> float:
    return value(m, "prefix_epp_flow_control_requests_total", outcome=name, priority=priority)


async def idle(pool: Pool) -> None:
    """Until no engine runs or queues anything (every stream the picker sent has ended)."""
    def busy() -> float:
        return sum(e.counter(n) for e in pool.engines for n in ("vllm:num_requests_running",
                                                                "vllm:num_requests_waiting"))
    for _ in range(600):
        if await asyncio.to_thread(busy) == 0:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the engines never went idle")


async def test_the_picker_holds_what_the_engines_cannot_run_premium_first_every_outcome(
        tmp_path: Path, pool: Pool) -> None:
    async with stack(tmp_path, pool, FLOW) as (picker, url), aiohttp.ClientSession() as s:
        watch = EngineWatch(pool)
        # 16 long batch generations: 4 run (2 an engine), 12 are held for three rounds of generations.
        flood = [asyncio.create_task(post(s, url, LONG, **objective_header("batch"))) for _ in range(16)]
        await until(picker, lambda m: held(m, priority="-1") == 12, timeout=30)
        # Two premium requests go out at the next free slots, before the batch requests held before them.
        premium = [asyncio.create_task(post(s, url, 4, **objective_header("premium"))) for _ in range(2)]
        # The background band (one request, below batch: nothing of it goes while batch is held):
        # a request that may wait 2 s fills it, the next is refused at once (429 rejected-saturated),
        # and the first is evicted when its TTL passes (429 rejected-ttl-expired).
        ttl = asyncio.create_task(post(s, url, 4, **objective_header("background", **{"x-llm-d-inference-ttl": "2s"})))
        await until(picker, lambda m: held(m, priority="-5") == 1)
        status, headers = await post(s, url, 4, **objective_header("background"))
        assert status == 429 and headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        status, headers = await ttl
        assert status == 429 and headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
        # A client that leaves: its request leaves the queue at once.
        gone = asyncio.create_task(post(s, url, 4, **objective_header("background")))
        await until(picker, lambda m: held(m, priority="-5") == 1)
        gone.cancel()
        await until(picker, lambda m: held(m, priority="-5") == 0
                    and outcome(m, "EvictedContextCancelled", "-5") == 1)
        assert held(await asyncio.to_thread(scrape, picker), priority="-1") > 0  # all of it while batch was held

        batch_results = await asyncio.wait_for(asyncio.gather(*flood), 120)
        premium_results = await asyncio.gather(*premium)
        most_waiting = await watch.stop()
        assert [r[0] for r in batch_results + premium_results] == [200] * 18
        batch_waits = [int(r[1]["x-llm-d-flow-queue-duration-ms"]) for r in batch_results]
        premium_waits = [int(r[1]["x-llm-d-flow-queue-duration-ms"]) for r in premium_results]
        assert sorted(batch_waits)[:4] == [0] * 4 and min(sorted(batch_waits)[4:]) > 0
        # Premium waited for one slot to free; the last batch requests for three rounds of generations.
        assert max(premium_waits) < max(batch_waits) / 2, (premium_waits, batch_waits)
        # The engines never queued more than a request waiting for the next step: the picker held the rest.
        assert most_waiting <= 1, most_waiting
        assert watch.samples >= 4 * len(pool.engines), watch.samples  # read all along, not once
        m = await until(picker, lambda m: value(m, "prefix_epp_open_streams") == 0)
        assert outcome(m, "Dispatched", "-1") == 16 and outcome(m, "Dispatched", "10") == 2
        assert outcome(m, "RejectedCapacity", "-5") == 1 and outcome(m, "EvictedTTL", "-5") == 1
        assert held(m) == 0 and value(m, "prefix_epp_flow_control_pool_saturation") == 0
        await idle(pool)


async def test_without_flow_control_the_engines_queue_instead(tmp_path: Path, pool: Pool) -> None:
    async with stack(tmp_path, pool, NO_FLOW) as (picker, url), aiohttp.ClientSession() as s:
        watch = EngineWatch(pool)
        requests = [asyncio.create_task(post(s, url, LONG // 2)) for _ in range(16)]
        results = await asyncio.wait_for(asyncio.gather(*requests), 120)
        most_waiting = await watch.stop()
        assert [r[0] for r in results] == [200] * 16
        assert "x-llm-d-flow-queue-duration-ms" not in results[0][1]
        assert most_waiting >= 4, most_waiting  # 8 an engine on 2 slots: the engine's own queue holds the rest
        await until(picker, lambda m: value(m, "prefix_epp_open_streams") == 0)
        await idle(pool)
