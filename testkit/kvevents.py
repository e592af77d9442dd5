"""KV events for tests and benchmarks: simulated replicas publishing them, a running manager, batches.

- `events_stack(n, ...)`: `n` simulated replicas (`prefix_epp_sim.server.run_replicas`, the cache
  `SIM`: 40 blocks of 16 tokens, so the fourth distinct prompt of `PROMPTS` evicts) publishing KV
  events, and a `KVEventsManager` (intervals `FAST`) subscribed to them; yields `Events`.
- `spec_for(replica)`: the replica as an endpoint with its events (and replay) address;
  `post`/`complete`: requests sent to a replica directly, past any picker.
- `sim_blocks` / `precise_blocks`: leading blocks of a prompt the simulator's cache holds, and
  what the precise index says it holds; `agrees` waits until they match for every prompt,
  `subscribed` until every publisher has a subscriber, `wait_for` until any predicate holds.
- `kv_event_batches(n)`: `n` vLLM-like event batches as the simulator publishes them, one
  `blocks`-block prompt stored in each (the index tests and `bench.components`).
- `heard_from(manager, endpoints, now)`: each endpoint's event stream counted as connected and in
  order without ZeroMQ (in-process decisions): the manager's own usability check then passes.
- `RawPublisher`: a bare XPUB socket (it sees each subscription arrive) for publishers that
  misbehave: any frames, any sequence; `stored_batch` is one BlockStored batch of chosen size and
  data-parallel rank (`stored_tokens`: its prompt).
- Recorded KV cache tier streams (`vllm_batch` of `vllm_stored`, `vllm_placeholder`,
  `vllm_removed`): the bytes vLLM's msgspec encoder writes for its KVEventBatch (an array) of
  tagged event structs (maps, the tag first, fields in declaration order, defaults omitted), on
  any medium: GPU as vLLM 0.32's prefix cache publishes it, CPU and STORAGE as its offloading
  connector does, with `self_describing_kv_events` (tokens, parent, block size, group and kind)
  or without (a placeholder: the offloaded chunk's last hash, no tokens, block size 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from extproc.config.settings import KVEventsConfig
from extproc.core.datastore import Datastore, EndpointSpec
from extproc.kvevents.manager import KVEventsManager
from extproc.kvevents.subscriber import Loss, SourceState
from extproc.tokenization.builtin import encode
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.kv_publisher import encode_batch
from prefix_epp_sim.kvcache import BlockStored, block_hash_seed, hash_blocks
from prefix_epp_sim.server import Replica, run_replicas
from testkit.procs import until

# 40 blocks of 16 tokens; a PROMPTS[i] request needs about 13 blocks, so the fourth distinct one evicts.
SIM = SimConfig(time_scale=100.0, kv_cache_blocks=40, max_model_len=640, kv_events_port_base=0)
PROMPTS = [f"request {i}: " + "lorem ipsum dolor sit amet " * 35 for i in range(6)]
FAST = KVEventsConfig(maintenance_interval_s=0.05, replay_timeout_s=0.5, resync_window_s=0.3)

wait_for = until  # the name the KV-event tests import


def spec_for(rep: Replica, replay: bool = True) -> EndpointSpec:
    assert rep.publisher is not None
    events = rep.publisher.endpoint
    if replay and rep.publisher.replay_endpoint:
        events += "@" + rep.publisher.replay_endpoint
    return EndpointSpec("127.0.0.1", rep.port, kv_events_endpoint=events)


async def post(rep: Replica, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(rep.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json() if resp.content_type == "application/json" else {}


async def complete(rep: Replica, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    return await post(rep, "/v1/completions", {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens})


def sim_blocks(rep: Replica, prompt: str) -> int:
    """Leading blocks of `prompt` the simulator's cache holds right now (its own hashes)."""
    hashes = hash_blocks(encode(prompt), rep.cache.block_size, block_hash_seed("sim-model"))
    return rep.cache.match_prefix(hashes)


def precise_blocks(m: KVEventsManager, rep: Replica, prompt: str) -> int:
    keys = m.keys_for("sim-model", "", encode(prompt))
    assert keys is not None
    key = f"127.0.0.1:{rep.port}"
    return m.index.match(keys, [key], m.now()).get(key, 0)



async def agrees(m: KVEventsManager, rep: Replica, prompts: list[str] = PROMPTS) -> None:
    """Wait until the precise index reports, for every prompt, exactly what the cache holds."""
    await wait_for(lambda: all(precise_blocks(m, rep, p) == sim_blocks(rep, p) for p in prompts))


async def subscribed(reps: list[Replica]) -> None:
    """Wait until every replica's publisher has a subscriber (ZeroMQ drops what is sent before)."""
    await wait_for(lambda: all(r.publisher is not None and r.publisher.subscriptions >= 1 for r in reps))


@dataclass
class Events:
    replicas: list[Replica]
    datastore: Datastore
    manager: KVEventsManager

    def key(self, i: int = 0) -> str:
        return f"127.0.0.1:{self.replicas[i].port}"

    def usable(self, i: int = 0) -> bool:
        return self.manager.usable(self.key(i), self.manager.now())


@contextlib.asynccontextmanager
async def events_stack(n: int = 1, *, sim: SimConfig = SIM, config: KVEventsConfig = FAST, replay: bool = True,
                       loss: Loss | None = None, subscribe: bool = True) -> AsyncIterator[Events]:
    """`n` simulated replicas publishing KV events and a running manager subscribed to them."""
    sim = replace(sim, kv_events_replay_port_base=0 if replay else None)
    async with run_replicas(sim, n, base_port=0) as reps:
        ds = Datastore()
        manager = KVEventsManager(config, ds, loss=loss)
        task = asyncio.create_task(manager.run())
        await asyncio.sleep(0)
        if subscribe:
            ds.set_endpoints([spec_for(r, replay) for r in reps])
            await subscribed(reps)
        try:
            yield Events(reps, ds, manager)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def kv_event_batches(batches: int, blocks: int = 64, block_size: int = 16, seed: int = 2) -> list[bytes]:
    """vLLM-like KV-event batches as the simulator publishes them: one `blocks`-block prompt stored in each."""
    rng = random.Random(seed)
    payloads = []
    for _ in range(batches):
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        tokens = [rng.randrange(128_000) for _ in range(blocks * block_size)]
        payloads.append(encode_batch([BlockStored(hashes, None, tokens, block_size)], "array", 0.0))
    return payloads


def stored_tokens(first_hash: int, blocks: int, block_size: int = 16) -> list[int]:
    """The prompt tokens `stored_batch(first_hash, blocks, block_size)` stores."""
    return [(first_hash * 7 + i) % 100_000 for i in range(blocks * block_size)]


def stored_batch(first_hash: int, blocks: int, block_size: int = 16, parent: int | None = None,
                 rank: int | None = 0) -> bytes:
    """One EventBatch storing `blocks` chained blocks, hashes first_hash, first_hash + 1, ...,
    tagged with `data_parallel_rank` `rank`."""
    tokens = stored_tokens(first_hash, blocks, block_size)
    hashes = list(range(first_hash, first_hash + blocks))
    return encode_batch([BlockStored(hashes, parent, tokens, block_size)], "array", 0.0, data_parallel_rank=rank)


class RawPublisher:
    """A bare XPUB socket on 127.0.0.1 (a free port, or `endpoint`) that publishes whatever a test
    tells it to."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str = "tcp://127.0.0.1:*") -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # keep everything for a slow subscriber: nothing lost here
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def subscribed(self, timeout: float = 15.0) -> None:
        """Wait for the next subscription (a SUB socket that connected or reconnected)."""
        while (await asyncio.wait_for(self.sock.recv(), timeout))[:1] != b"\x01":
            pass

    async def publish(self, seq: int, payload: bytes, topic: bytes = b"kv@test") -> None:
        await self.sock.send_multipart([topic, seq.to_bytes(8, "big", signed=True), payload])

    def close(self) -> None:
        self.sock.close(linger=0)


def heard_from(manager: KVEventsManager, endpoints: Iterable[str], now: float) -> None:
    """Each endpoint's stream as its subscriber sees it once a publisher in order was heard at
    `now` (no socket: the request path reads only the state)."""
    for key in endpoints:
        manager._subs[key] = [SimpleNamespace(state=SourceState(next_seq=1, heard_at=now, reason=""))]  # type: ignore[list-item]


def vllm_stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU",
                block_size: int = 16) -> dict[str, Any]:
    """A BlockStored with its tokens: the GPU tier's (per-block extra_keys, all None), or an
    offloading connector's self-describing one (extra_keys left at its default, so omitted)."""
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                             "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": medium,
                             "lora_name": None}
    if medium == "GPU":
        event["extra_keys"] = [None] * len(hashes)
    event["group_idx"] = 0
    event["kv_cache_spec_kind"] = "full_attention"
    return event


def vllm_placeholder(chunk_hash: int, medium: str) -> dict[str, Any]:
    """The offloading connector's BlockStored without self-describing events: one offloaded chunk
    named by its last block's hash."""
    return {"type": "BlockStored", "block_hashes": [chunk_hash], "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}


def vllm_removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def vllm_batch(events: list[dict[str, Any]], ts: float = 1757500000.25, rank: int = 0) -> bytes:
    """A KVEventBatch as the engine sends it (ZmqEventPublisher sets data_parallel_rank)."""
    payload: bytes = msgpack.packb([ts, events, rank])
    return payload
