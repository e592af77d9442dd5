"""A prefill/decode pair of simulated engines with the sidecar in front of the decode one: the
KV reaches the decode engine (its cached tokens and external hits), the answer streams through
chunk by chunk, a client that leaves aborts the decode, errors come back as the client's.

The simulator moves the KV as vLLM's connectors do (prefix_epp_sim/kv_transfer.py): `nixlv2` on
NixlConnector's kv_transfer_params round trip, `shared-storage` on ExampleConnector's directory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from extproc.tokenization.builtin import count
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import Replica, run_replicas
from prefix_epp_sim.vllm_metrics import render
from testkit.procs import until
from testkit.sidecar import sidecar, sse_events
from testkit.vllm import metric_total

CFG = SimConfig(time_scale=100.0, kv_events=False, kv_cache_blocks=2048, max_model_len=8192, kv_connector="nixl")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40
TOKENS = count(PROMPT)
REUSABLE = (TOKENS - 1) // CFG.block_size * CFG.block_size  # the last prompt token is always computed


def request(prompt: str = PROMPT, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": CFG.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


async def stream_through(session: aiohttp.ClientSession, port: int, body: dict[str, Any],
                         prefill: Replica | None) -> tuple[str, dict[str, Any]]:
    """The streamed answer's text and usage, sent to the sidecar (naming `prefill` in the header)."""
    headers = {"x-prefiller-host-port": prefill.address} if prefill else {}
    text = ""
    usage: dict[str, Any] = {}
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for data in sse_events(resp):
            if data != b"[DONE]":
                chunk = orjson.loads(data)
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage


def external_hits(replica: Replica) -> float:
    return metric_total(render(replica.registry), "vllm:external_prefix_cache_hits_total")


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_nixlv2_the_decode_engine_loads_the_prefilled_prompt(session: aiohttp.ClientSession) -> None:
    async with run_replicas(CFG, 2, base_port=0) as (prefill, decode), \
            sidecar(decode_url=decode.url, kv_connector="nixlv2") as s:
        text, usage = await stream_through(session, s.port, request(), prefill)
        assert usage["prompt_tokens"] == TOKENS and usage["prompt_tokens_details"]["cached_tokens"] == REUSABLE
        assert (prefill.engine.stats.requests_success, prefill.engine.stats.generation_tokens) == (1, 1)
        d = decode.engine.stats
        assert (d.prefix_hits, d.external_hits, d.external_queries) == (0, REUSABLE, TOKENS)
        assert external_hits(decode) == REUSABLE
        # The same text as one engine computing it all.
        alone, _ = await stream_through(session, s.port, request(prompt=PROMPT), None)
        assert alone == text and len(text) > 0
        # Without the header the request was the decode engine's alone: its own cache served it.
        assert prefill.engine.stats.requests_success == 1 and decode.engine.stats.prefix_hits == REUSABLE


async def test_shared_storage_the_consumer_loads_what_the_producer_wrote(
        session: aiohttp.ClientSession, tmp_path: Path) -> None:
    shared = CFG.replace(kv_connector="shared-storage", kv_shared_storage_path=str(tmp_path / "kv"))
    async with run_replicas(shared.replace(kv_role="kv_producer"), 1, base_port=0) as [producer], \
            run_replicas(shared.replace(kv_role="kv_consumer"), 1, base_port=0) as [consumer], \
            sidecar(decode_url=consumer.url, kv_connector="shared-storage") as s:
        _, usage = await stream_through(session, s.port, request(), producer)
        assert len(list((tmp_path / "kv").iterdir())) == TOKENS // CFG.block_size  # the prompt's full blocks
        assert usage["prompt_tokens_details"]["cached_tokens"] == REUSABLE == consumer.engine.stats.external_hits
        other = "A different prompt that nobody prefilled, long enough for blocks. " * 10
        _, usage = await stream_through(session, s.port, request(prompt=other), None)  # forwarded
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert consumer.engine.stats.external_hits == REUSABLE and producer.engine.stats.requests_success == 1


async def test_the_answer_streams_through_and_a_client_leaving_aborts_the_decode(
        session: aiohttp.ClientSession) -> None:
    slow = CFG.replace(time_scale=1.0, inter_token_latency=20.0)  # 200 tokens: 4 s of decode
    async with run_replicas(slow, 2, base_port=0) as (prefill, decode), sidecar(decode_url=decode.url) as s:
        headers = {"x-prefiller-host-port": prefill.address}
        async with session.post(f"http://127.0.0.1:{s.port}/v1/completions", json=request(max_tokens=200),
                                headers=headers) as resp:
            events = sse_events(resp)
            first = orjson.loads(await anext(events))
            assert first["choices"][0]["text"]
            [running] = decode.engine.running  # the first chunk came while the decode was still generating
            assert running.generated < 200
            await events.aclose()
        await until(lambda: not decode.engine.running, timeout=10)  # the client left: vLLM-style abort
        assert decode.engine.stats.requests_success == 0


async def test_errors_of_the_prefill_engine_come_back_and_no_decode_runs(session: aiohttp.ClientSession) -> None:
    async with run_replicas(CFG, 1, base_port=0) as [prefill], \
            run_replicas(CFG.replace(failure_rate=1.0), 1, base_port=0) as [failing], \
            run_replicas(CFG, 1, base_port=0) as [decode], sidecar(decode_url=decode.url) as s:
        url = f"http://127.0.0.1:{s.port}/v1/completions"
        named = {"x-prefiller-host-port": prefill.address}
        async with session.post(url, json=request(model="nope"), headers=named) as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
        async with session.post(url, json=request(), headers={"x-prefiller-host-port": failing.address}) as r:
            assert r.status == 500 and "Injected failure" in (await r.json())["error"]["message"]
        assert decode.engine.stats.prefix_queries == 0 and failing.failures == 1
