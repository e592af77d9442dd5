"""KV transfer between simulated replicas (prefix_epp_sim/kv_transfer.py): NixlConnector's
kv_transfer_params round trip and ExampleConnector's shared directory, and what each reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson

from extproc.tokenization.builtin import count, encode
from prefix_epp_sim.cli import build_parser, config_from_args
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas
from prefix_epp_sim.vllm_metrics import render
from testkit.vllm import metric_total

CFG = SimConfig(time_scale=100.0, kv_events=False, kv_cache_blocks=2048, max_model_len=8192)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40
TOKENS = count(PROMPT)
BS = CFG.block_size


async def complete(session: aiohttp.ClientSession, url: str, **extra: Any) -> Any:
    body = {"model": CFG.model, "prompt": PROMPT, "max_tokens": 4, **extra}
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body)) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def cached(answer: Any) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_nixl_a_prefill_names_its_blocks_and_the_decode_loads_them() -> None:
    async with run_replicas(CFG.replace(kv_connector="nixl"), 2, base_port=0) as (p, d), \
            aiohttp.ClientSession() as session:
        prefill = await complete(session, p.url, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = prefill["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert len(params["remote_block_ids"]) == TOKENS // BS
        assert f"{params['remote_host']}:{params['remote_port']}" == p.address
        assert params["remote_engine_id"] == p.kv_transfer.engine_id != d.kv_transfer.engine_id
        plain = await complete(session, p.url)  # no remote decode asked: vLLM answers null
        assert plain["kv_transfer_params"] is None

        decode = await complete(session, d.url, kv_transfer_params=params)
        reusable = (TOKENS - 1) // BS * BS
        assert cached(decode) == reusable
        exposition = render(d.registry)
        assert metric_total(exposition, "vllm:external_prefix_cache_hits_total") == reusable
        assert metric_total(exposition, "vllm:external_prefix_cache_queries_total") == TOKENS
        assert metric_total(exposition, "vllm:prefix_cache_hits_total") == 0
        # Loaded blocks are the decode engine's own now: the next request hits them locally.
        assert cached(await complete(session, d.url)) == reusable
        assert metric_total(render(d.registry), "vllm:prefix_cache_hits_total") == reusable


async def test_shared_storage_a_consumer_loads_the_leading_blocks_a_producer_wrote(tmp_path: Path) -> None:
    shared = CFG.replace(kv_connector="shared-storage", kv_shared_storage_path=str(tmp_path))
    half = "The quick brown fox jumps over the lazy dog. " * 20
    same = next(i for i, (a, b) in enumerate(zip([*encode(half), -1], encode(PROMPT), strict=False)) if a != b)
    found = min(same, count(half)) // BS  # the leading blocks both prompts share
    async with run_replicas(shared.replace(kv_role="kv_producer"), 1, base_port=0) as [producer], \
            run_replicas(shared.replace(kv_role="kv_consumer"), 1, base_port=0) as [consumer], \
            aiohttp.ClientSession() as session:
        assert cached(await complete(session, producer.url, prompt=half)) == 0
        assert len(list(tmp_path.iterdir())) == count(half) // BS
        # The consumer finds the first half's blocks, then a miss: it computes the rest.
        assert found > 0 and cached(await complete(session, consumer.url)) == found * BS
        assert len(list(tmp_path.iterdir())) == count(half) // BS  # a consumer writes nothing
        assert consumer.engine.stats.external_hits == found * BS


def test_vllms_kv_transfer_config_sets_the_connector() -> None:
    args = build_parser().parse_args(["--kv-transfer-config", orjson.dumps({
        "kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}).decode()])
    config = config_from_args(args)
    assert (config.kv_connector, config.kv_role, config.kv_shared_storage_path) == ("shared-storage", "kv_consumer",
                                                                                     "/tmp/kv")
    nixl = config_from_args(build_parser().parse_args(["--kv-transfer-config", '{"kv_connector":"NixlConnector",'
                                                       '"kv_role":"kv_both"}']))
    assert (nixl.kv_connector, nixl.kv_role) == ("nixl", "kv_both")
    assert config_from_args(build_parser().parse_args([])).kv_connector == ""
