"""KV cache tiers end to end through real ZeroMQ: recorded event streams in vLLM's wire format
(GPU prefix cache, offloading connector placeholders and self-describing events) published to the
picker's subscribers, and the decisions and metrics that follow.

vLLM's CPU build (the tests' engine) refuses native offloading, so no engine here offloads: the
streams are the bytes vLLM publishes (testkit/kvevents.py `vllm_batch`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import zmq.asyncio

from extproc.config.settings import EppConfig, KVEventsConfig, PrefixConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.kvevents.keys import chain_keys, key_seed
from extproc.kvevents.manager import KVEventsManager
from extproc.kvevents.wire import CPU, GPU
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.telemetry.kv_events import KVEventsCollector
from testkit.kvevents import FAST, RawPublisher, vllm_batch, vllm_placeholder, vllm_removed, vllm_stored, wait_for

BS = 16
TOKENS = list(range(3000, 3000 + 10 * BS))  # a 10-block prompt
KEYS = chain_keys(TOKENS, BS, key_seed(None))
HASHES = [0xA000 + i for i in range(10)]
GPU_HOLDER, CPU_HOLDER, SELF_DESCRIBED, MISS = "127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11", "127.0.0.1:12"
ENDPOINTS = (GPU_HOLDER, CPU_HOLDER, SELF_DESCRIBED, MISS)


@dataclass
class Pool:
    manager: KVEventsManager
    datastore: Datastore
    publishers: dict[str, RawPublisher]
    seq: dict[str, int]

    async def publish(self, endpoint: str, *events: dict[str, object]) -> None:
        seq = self.seq[endpoint]
        self.seq[endpoint] = seq + 1
        await self.publishers[endpoint].publish(seq, vllm_batch(list(events)))

    def schedule(self, config: EppConfig, request_id: str) -> tuple[str, SchedulingRequest, str]:
        sched = build_scheduler(config, PrefixIndex(PrefixConfig().lru_capacity_per_server), precise=self.manager)
        req = SchedulingRequest(request_id, "m", token_keys=list(KEYS), prompt_tokens=len(TOKENS),
                                prompt_bytes=4 * len(TOKENS))
        decision = sched.schedule(req, list(self.datastore.snapshot()))
        return decision.primary.key, req, decision.explain()


@contextlib.asynccontextmanager
async def pool() -> AsyncIterator[Pool]:
    """A running manager subscribed to one RawPublisher per endpoint, every subscription arrived."""
    ctx = zmq.asyncio.Context()
    pubs = {ep: RawPublisher(ctx) for ep in ENDPOINTS}
    ds = Datastore()
    m = KVEventsManager(replace(FAST, prefix_scorer="precise", speculative_ttl_s=0.3), ds)
    task = asyncio.create_task(m.run())
    try:
        await asyncio.sleep(0)
        ds.set_endpoints([EndpointSpec("127.0.0.1", int(ep.rsplit(":", 1)[1]), kv_events_endpoint=pubs[ep].endpoint)
                          for ep in ENDPOINTS])
        await asyncio.gather(*(p.subscribed() for p in pubs.values()))
        yield Pool(m, ds, pubs, {ep: 0 for ep in ENDPOINTS})
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for p in pubs.values():
            p.close()
        ctx.destroy(linger=0)


def samples(m: KVEventsManager, name: str) -> dict[tuple[str, ...], float]:
    (family,) = [f for f in KVEventsCollector(m).collect() if f.name == name]
    return {tuple(s.labels.values()): s.value for s in family.samples if not s.name.endswith("_created")}


async def test_a_gpu_hit_is_preferred_to_a_cpu_hit_which_is_preferred_to_a_miss() -> None:
    weighted = EppConfig(seed=1, scheduler="weighted", kv_events=KVEventsConfig(prefix_scorer="precise"))
    predicted = replace(weighted, scheduler=EppConfig().scheduler)
    async with pool() as p:
        m = p.manager
        stored = vllm_stored(HASHES, None, TOKENS)
        await p.publish(GPU_HOLDER, stored)
        # Offloaded without self-describing events: one placeholder per block (chunks of one block,
        # the connector's default), then the GPU evicts the prompt; MISS stores another prompt.
        await p.publish(CPU_HOLDER, stored, *(vllm_placeholder(h, "CPU") for h in HASHES))
        await p.publish(CPU_HOLDER, vllm_removed(HASHES))
        await p.publish(SELF_DESCRIBED, vllm_stored(HASHES, None, TOKENS, "CPU"))
        await p.publish(MISS, vllm_stored([7, 8], None, list(range(40_000, 40_000 + 2 * BS))))
        await wait_for(lambda: m.index.held(CPU_HOLDER, GPU) == 0 and m.index.held(CPU_HOLDER, CPU) == 10
                       and m.index.held(SELF_DESCRIBED, CPU) == 10 and m.index.held(MISS) == 2)
        assert m.index.resolved == 10 and m.index.orphaned == 0
        assert all(m.usable(ep, m.now()) for ep in ENDPOINTS)

        chosen, req, explain = p.schedule(weighted, "r1")
        assert chosen == GPU_HOLDER and "precise=10/10;" in explain
        assert req.precise_match == {GPU_HOLDER: 10, CPU_HOLDER: 10, SELF_DESCRIBED: 10}
        assert dict(req.precise_weighted) == {GPU_HOLDER: 10.0, CPU_HOLDER: 8.0, SELF_DESCRIBED: 8.0}
        # predicted-ttft charges a CPU hit a fifth of its prefill, between a GPU hit and a miss.
        chosen, req, _ = p.schedule(predicted, "r2")
        ttft = {ep: req.predictions[ep][0] for ep in ENDPOINTS}
        assert chosen == GPU_HOLDER and ttft[GPU_HOLDER] < ttft[CPU_HOLDER] < ttft[MISS]
        assert req.predictions[CPU_HOLDER][1] == len(TOKENS) * 0.2  # uncached tokens

        # The GPU holder evicts half the prompt: five on GPU weigh less than ten on CPU.
        await p.publish(GPU_HOLDER, vllm_removed(HASHES[5:]))
        # ... once the speculative records of r1 and r2 have expired.
        await wait_for(lambda: m.index.held(GPU_HOLDER) == 5 and m.index.speculative(GPU_HOLDER) == 0)
        chosen, req, explain = p.schedule(weighted, "r3")
        assert chosen in (CPU_HOLDER, SELF_DESCRIBED) and "precise=10/10 (tier-weighted 8);" in explain
        # The CPU tier removes its blocks: the chain now breaks at its first block there.
        for ep in (CPU_HOLDER, SELF_DESCRIBED):
            await p.publish(ep, vllm_removed(HASHES, "CPU"))
        await wait_for(lambda: m.index.held(CPU_HOLDER, CPU) == m.index.held(SELF_DESCRIBED, CPU) == 0)
        other = SELF_DESCRIBED if chosen == CPU_HOLDER else CPU_HOLDER
        assert other not in m.index.match(KEYS, [CPU_HOLDER, SELF_DESCRIBED], m.now())  # (chosen: r3's record)

        tier_blocks = samples(m, "prefix_epp_kv_events_tier_blocks")
        assert tier_blocks[(GPU_HOLDER, "gpu")] == 5 and tier_blocks[(CPU_HOLDER, "cpu")] == 0
        assert tier_blocks[(MISS, "gpu")] == 2 and len(tier_blocks) == 3 * len(ENDPOINTS)
        hits = samples(m, "prefix_epp_kv_events_tier_hit_blocks")
        assert hits == {("gpu",): 20.0, ("cpu",): 10.0, ("storage",): 0.0}
        assert m.hits[CPU] == 10
