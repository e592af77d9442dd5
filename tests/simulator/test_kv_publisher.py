"""KV events over ZeroMQ: vLLM's three-frame messages, both encodings, replay.

The map encoding's field sets and the replay framing are what vLLM 0.32.0's CPU build sent
(captured from the real engine: one BlockStored batch live, replay over a DEALER with and without
the empty delimiter)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from extproc.tokenization.builtin import encode
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.kv_publisher import END_OF_REPLAY
from prefix_epp_sim.kvcache import block_hash_seed, hash_blocks
from prefix_epp_sim.server import Replica, run_replicas

# vLLM 0.32's map-encoded events carry exactly these fields (defaults omitted).
VLLM_FIELDS = {
    "BlockStored": ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"],
    "BlockRemoved": ["type", "block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": ["type"],
}

# 40 blocks of cache; each request below needs 13, so the third distinct prompt evicts.
CFG = SimConfig(time_scale=100.0, kv_cache_blocks=40, max_model_len=640, kv_events_port_base=0,
                kv_events_replay_port_base=0)
PROMPTS = [f"request {i}: " + "lorem ipsum dolor sit amet " * 35 for i in range(4)]


def normalise(event: Any) -> dict[str, Any]:
    """Decode one event of either encoding into a dict with a 'type' key."""
    if isinstance(event, dict):
        return event
    names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                             "medium", "lora_name"],
             "BlockRemoved": ["block_hashes", "medium"], "AllBlocksCleared": []}[event[0]]
    return {"type": event[0], **dict(zip(names, event[1:], strict=False))}


async def drive(replica: Replica) -> None:
    async with aiohttp.ClientSession() as s:
        for prompt in [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]:
            async with s.post(replica.url + "/v1/completions",
                              json={"model": "sim-model", "prompt": prompt, "max_tokens": 20}) as resp:
                assert resp.status == 200
        async with s.post(replica.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200


async def collect(sub: zmq.asyncio.Socket) -> list[list[bytes]]:
    messages: list[list[bytes]] = []
    while True:
        frames = await asyncio.wait_for(sub.recv_multipart(), 5)
        messages.append(frames)
        batch = msgpack.unpackb(frames[2])
        if any(normalise(e)["type"] == "AllBlocksCleared" for e in batch[1]):
            return messages


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_subscriber_decodes_events_with_contiguous_sequence(encoding: str) -> None:
    cfg = CFG.replace(kv_events_encoding=encoding)
    ctx = zmq.asyncio.Context()
    try:
        async with run_replicas(cfg, 1, base_port=0) as [rep]:
            assert rep.publisher is not None
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(rep.publisher.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            deadline = asyncio.get_running_loop().time() + 15
            while rep.publisher.subscriptions < 1:  # messages sent before the subscription are dropped
                assert asyncio.get_running_loop().time() < deadline, "no subscriber"
                await asyncio.sleep(0.01)
            messages = await asyncio.gather(collect(sub), drive(rep))
            msgs = messages[0]
            sub.close()
    finally:
        ctx.destroy(linger=0)

    assert {m[0] for m in msgs} == {f"kv@{rep.address}@sim-model".encode()}
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert seqs == list(range(len(msgs)))
    batches = [msgpack.unpackb(m[2]) for m in msgs]
    # [ts, events, data_parallel_rank]: a single engine is rank 0, as vLLM sends it.
    assert all(len(b) == 3 and isinstance(b[0], float) and b[2] == 0 for b in batches)
    if encoding == "array":
        assert all(isinstance(e, list) for b in batches for e in b[1])
    else:
        assert all(isinstance(e, dict) and list(e) == VLLM_FIELDS[e["type"]] for b in batches for e in b[1])
        stored_maps = [e for b in batches for e in b[1] if e["type"] == "BlockStored"]
        assert all(e["extra_keys"] == [None] * len(e["block_hashes"]) and e["group_idx"] == 0
                   and e["kv_cache_spec_kind"] == "full_attention" and e["lora_name"] is None for e in stored_maps)
    events = [normalise(e) for b in batches for e in b[1]]

    tokens = encode(PROMPTS[0])
    expected = hash_blocks(tokens, 16, block_hash_seed("sim-model"))
    first = events[0]
    assert first["type"] == "BlockStored" and first["block_hashes"] == expected
    assert first["parent_block_hash"] is None and first["token_ids"] == tokens[:len(expected) * 16]
    assert first["block_size"] == 16 and first["medium"] == "GPU" and first["lora_id"] is None
    # At finish the first request stores the block its output completed, chained to the prompt.
    assert (len(tokens) + 19) // 16 == len(expected) + 1
    second = events[1]
    assert second["type"] == "BlockStored" and second["parent_block_hash"] == expected[-1]
    assert len(second["block_hashes"]) == 1
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    stored = [h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]]
    assert removed and set(removed) <= set(stored)
    assert events[-1]["type"] == "AllBlocksCleared"


async def test_replay_returns_buffered_batches_then_end_marker() -> None:
    ctx = zmq.asyncio.Context()
    try:
        async with run_replicas(CFG, 1, base_port=0) as [rep]:
            assert rep.publisher is not None and rep.publisher.replay_endpoint
            await drive(rep)
            total = rep.publisher.next_sequence
            assert total >= 5
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(rep.publisher.replay_endpoint)
            replies: list[list[bytes]] = []
            await dealer.send_multipart([b"", (2).to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
                replies.append(frames)
                if frames[2] == END_OF_REPLAY:
                    break
            dealer.close()
    finally:
        ctx.destroy(linger=0)
    # vLLM's framing: ["", topic, seq, payload] per batch, then ["", "", -1, ""].
    topic = rep.publisher.topic.encode()
    assert all(f[0] == b"" and len(f) == 4 for f in replies)
    assert all(f[1] == topic for f in replies[:-1]) and replies[-1][1] == b""
    assert [int.from_bytes(f[2], "big") for f in replies[:-1]] == list(range(2, total))
    assert replies[-1][3] == b""
    last = msgpack.unpackb(replies[-2][3])
    assert last[1] == [{"type": "AllBlocksCleared"}]


async def test_replay_answers_only_the_delimited_request_as_vllm_does() -> None:
    """vLLM takes [identity, "", start] only: a DEALER that omits the delimiter gets no answer."""
    ctx = zmq.asyncio.Context()
    try:
        async with run_replicas(CFG, 1, base_port=0) as [rep]:
            assert rep.publisher is not None and rep.publisher.replay_endpoint
            await drive(rep)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(rep.publisher.replay_endpoint)
            # The ROUTER serves requests in order: if the first were answered, its replies
            # (without the delimiter) would arrive before the second one's.
            await dealer.send_multipart([(0).to_bytes(8, "big")])
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            first = await asyncio.wait_for(dealer.recv_multipart(), 5)
            dealer.close()
    finally:
        ctx.destroy(linger=0)
    assert first[0] == b"" and first[1] == rep.publisher.topic.encode() and first[2] == (0).to_bytes(8, "big")


async def test_disabled_events_open_no_socket() -> None:
    async with run_replicas(CFG.replace(kv_events=False), 1, base_port=0) as [rep]:
        assert rep.publisher is None
