"""A real prefill/decode pair: two engines of vLLM's CPU build over its ExampleConnector (one
directory both share; testkit/vllm.py `kv_transfer_args`), the sidecar in front of the decode one.

A long prompt sent to the sidecar with `x-prefiller-host-port` naming the prefill engine is
prefilled there (one token), its KV written to the directory; the decode engine loads it (its
`vllm:external_prefix_cache_hits_total` and the answer's cached tokens count it), its first token
comes far sooner than a cold prefill's, and at temperature 0 the text is what one engine computing
the whole prompt produces. The reference run asks for `prompt_logprobs`, which makes vLLM read no
cache at all, local or the connector's. Without the header the sidecar only forwards.

The picker's side (decode pick, decider, prefill pick, the header) is not in this test: it sends
the header as the picker would.
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp
import orjson
import pytest

from testkit.sidecar import sidecar, sse_events
from testkit.tiny_model import TEXT
from testkit.vllm import BLOCK_SIZE, Engine, engines, kv_transfer_args
from testkit.vllm_env import MODEL_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(600)]

WORDS = 6000  # ~6,000 tokens (one per word): a cold prefill ~0.2 s on one core, a load of its KV a fraction of it
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"


def prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = TEXT.split()
    return " ".join(rng.choice(words) for _ in range(WORDS))


def body(text: str, stream: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL_NAME, "prompt": text, "max_tokens": 12, "temperature": 0, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


async def through(session: aiohttp.ClientSession, port: int, text: str,
                  prefill: Engine | None) -> tuple[str, dict[str, Any]]:
    headers = {"x-prefiller-host-port": prefill.key} if prefill else {}
    out = ""
    usage: dict[str, Any] = {}
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body(text), headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for data in sse_events(resp):
            if data != b"[DONE]":
                chunk = orjson.loads(data)
                out += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return out, usage


def cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def test_the_decode_engine_loads_the_prefill_engines_kv_and_answers_the_same(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # A short directory: the engines' IPC socket paths under it must fit AF_UNIX's 108 bytes.
    tmp = tmp_path_factory.mktemp("pd")
    shared = tmp / "kv"
    roles = [kv_transfer_args("kv_producer", shared), kv_transfer_args("kv_consumer", shared)]
    with engines(tmp / "vllm", 2, engine_args=roles) as (producer, consumer):
        async with sidecar(decode_url=consumer.url, kv_connector="shared-storage") as s, \
                aiohttp.ClientSession() as session:
            # Without the header: forwarded, the decode engine computes the prompt itself (cold).
            before = consumer.counter(TTFT_SUM)
            _, usage = await through(session, s.port, prompt(1), None)
            cold_ttft = consumer.counter(TTFT_SUM) - before
            assert cached(usage) == 0 and consumer.counter("vllm:external_prefix_cache_hits_total") == 0
            assert producer.counter("vllm:request_success_total") == 0

            text = prompt(2)
            before = consumer.counter(TTFT_SUM)
            decoded, usage = await through(session, s.port, text, producer)
            pd_ttft = consumer.counter(TTFT_SUM) - before
            reusable = (int(usage["prompt_tokens"]) - 1) // BLOCK_SIZE * BLOCK_SIZE
            assert int(usage["prompt_tokens"]) > 5000
            # The prefill engine computed one token; the decode engine loaded the prompt's KV.
            assert producer.counter("vllm:request_success_total") == 1
            assert producer.counter("vllm:generation_tokens_total") == 1
            assert any(shared.iterdir())
            assert consumer.counter("vllm:external_prefix_cache_hits_total") == reusable
            assert cached(usage) == reusable
            assert pd_ttft < cold_ttft / 2, (pd_ttft, cold_ttft)  # measured: ~0.05 s against ~0.22 s

            alone = {**body(text, stream=False), "prompt_logprobs": 0}  # computed whole: no cache read
            async with session.post(f"{producer.url}/v1/completions", json=alone) as resp:
                assert resp.status == 200, await resp.text()
                reference = await resp.json()
            assert cached(reference["usage"]) == 0
            assert reference["choices"][0]["text"] == decoded and decoded
