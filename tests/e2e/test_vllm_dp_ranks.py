"""Data-parallel ranks of one real vLLM engine as the endpoints of one pod, in precise mode.

The engine is vLLM's CPU build started with `--data-parallel-size 2` (testkit/vllm.py): two
engine processes, one core each, behind vLLM's own balancer on one HTTP port. Rank r publishes
its KV events on the base port + r (and replays on the replay base + r), each batch tagged with
`data_parallel_rank` r. vLLM's per-rank HTTP servers (`--data-parallel-rank`, external balancing)
refuse a dense model on this build ("Non-MoE models do not support external data parallel
mode"), so each rank gets its port from a small forwarder that pins requests to it with vLLM's
`X-data-parallel-rank` header (`testkit.vllm.rank_ports`), as llm-d's sidecar gives each rank one.
The pod (address 127.0.0.2) is selected by an InferencePool whose targetPorts are those two
ports, served by a Kubernetes API (kmock); the picker discovers both endpoints, ranks 0 and 1,
and subscribes to base + rank; requests go through real Envoy.

Shown: a prompt sent to rank 1's port is recorded for rank 1's endpoint only (the index holds its
blocks once), the next request with that prefix is routed to rank 1's endpoint, and it is rank
1's cache that serves it (`vllm:prefix_cache_hits_total{engine="1"}`); the same for rank 0.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.envoy import run_envoy
from testkit.http_client import post
from testkit.kube import PODS, POOL_V1, KubeApi, pod, pool_v1
from testkit.picker import Picker, scrape, until, value
from testkit.procs import free_ports, prefix_epp
from testkit.tiny_model import TEXT
from testkit.vllm import BLOCK_SIZE, Engine, engines, rank_ports
from testkit.vllm_env import MODEL_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(600)]

SERVED = "x-gateway-destination-endpoint-served"
DECISION = "x-prefix-epp-decision"


def prompt(seed: int, words: int = 900) -> str:
    rng = random.Random(seed)
    words_ = TEXT.split()
    return " ".join(rng.choice(words_) for _ in range(words))


async def complete(session: aiohttp.ClientSession, url: str, text: str) -> tuple[dict[str, str], Any]:
    reply = await post(session, f"{url}/v1/completions",
                       {"model": MODEL_NAME, "prompt": text, "max_tokens": 2, "temperature": 0})
    assert reply.status == 200, reply.body[:500]
    return reply.headers, reply.json()


def rank_hits(engine: Engine) -> dict[str, float]:
    """vllm:prefix_cache_hits_total per engine rank (its `engine` label)."""
    text = engine.get("/metrics").decode()
    return {s.labels["engine"]: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "vllm:prefix_cache_hits_total"}


def picker_for_pool(tmp: Path, api: KubeApi, engine: Engine) -> Picker:
    grpc_port, health_port, metrics_port = free_ports(3)
    args = prefix_epp(
        "serve", "--pool-name", "pool", "--pool-namespace", "default",
        "--kubeconfig", str(api.write_kubeconfig(tmp / "kubeconfig")), "--secure-serving=false",
        "--bind-address", "127.0.0.1", "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
        "--metrics-port", str(metrics_port), "--prefix-scorer", "precise", "--tokenizer",
        str(engine.env.tokenizer_json), "--kv-events-port", str(engine.events_port),
        "--kv-events-replay-port", str(engine.replay_port), "--explain-decisions")
    return Picker(grpc_port, health_port, metrics_port, args, tmp / "picker.log")


async def test_each_rank_is_an_endpoint_whose_events_and_hits_are_its_own(tmp_path: Path) -> None:
    with engines(tmp_path / "vllm", 1, dp_size=2) as [engine]:
        ports = free_ports(2)
        keys = [f"{engine.address}:{p}" for p in ports]
        async with rank_ports(engine, ports), aiohttp.ClientSession() as session:
            with KubeApi() as api:
                api.start()
                api.create(POOL_V1, pool_v1("pool", {"app": "vllm"}, ports))
                api.create(PODS, pod("vllm-0", {"app": "vllm"}, ip=engine.address))
                picker = picker_for_pool(tmp_path, api, engine)
                picker.start()
                try:
                    # Both ranks discovered, heard from on base + rank (replayed from 0 on connect).
                    await until(picker, lambda s: value(s, "prefix_epp_kv_events_block_size") == BLOCK_SIZE
                                and all(value(s, "prefix_epp_kv_events_endpoint_usable", endpoint=k) == 1
                                        for k in keys), timeout=60)
                    with run_envoy(tmp_path, picker.grpc_port) as (_, listen, _):
                        url = f"http://127.0.0.1:{listen}"
                        for rank in (1, 0):
                            text = prompt(40 + rank)
                            entries = value(scrape(picker), "prefix_epp_kv_events_index_entries")
                            _, first = await complete(session, f"http://{keys[rank]}", text)  # past the picker
                            k = int(first["usage"]["prompt_tokens"]) // BLOCK_SIZE
                            samples = await until(picker, lambda s, n=entries + k: value(
                                s, "prefix_epp_kv_events_index_entries") >= n, timeout=30)
                            if rank == 1:  # recorded once, for rank 1: rank 0's publisher said nothing of it
                                assert value(samples, "prefix_epp_kv_events_index_entries") == k
                            before = rank_hits(engine)
                            headers, again = await complete(session, url, text)
                            fields = dict(p.split("=", 1) for p in headers[DECISION].split("; ") if "=" in p)
                            assert headers[SERVED] == keys[rank] and fields["precise"] == f"{k}/{k}", headers
                            reusable = (int(again["usage"]["prompt_tokens"]) - 1) // BLOCK_SIZE * BLOCK_SIZE
                            assert int(again["usage"]["prompt_tokens_details"]["cached_tokens"]) == reusable
                            after = rank_hits(engine)  # rank's own cache served it, the other's did not
                            assert (after[str(rank)] - before[str(rank)], after[str(1 - rank)]) == (
                                reusable, before[str(1 - rank)])
                    samples = scrape(picker)
                    assert value(samples, "prefix_epp_kv_events_other_rank_batches_total", outcome="dropped") == 0
                    assert value(samples, "prefix_epp_kv_events_resyncs_total", reason="gap") == 0
                finally:
                    picker.stop()
