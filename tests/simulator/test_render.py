"""vLLM's render routes: token ids as the generation routes count them, in vLLM 0.32's shapes.

The key sets and the sampling parameters below are what vLLM 0.32.0's CPU build answered
(`--enable-scale-out`) for the same bodies; test_real_vllm.py compares the two servers live.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import orjson

from extproc.tokenization.builtin import encode
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.render import MAX_BATCH
from prefix_epp_sim.server import run_replicas

CFG = SimConfig(time_scale=100.0, kv_events=False, kv_cache_blocks=512, max_model_len=4096)
PROMPT = "hello world " * 20

GENERATE_REQUEST_KEYS = ["request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
                         "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
                         "stream", "stream_options", "cache_salt", "priority", "kv_transfer_params",
                         "ec_transfer_params"]
# vLLM 0.32's answer to {"prompt", "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}.
STREAMED_SAMPLING = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                     "temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "stop": [], "stop_token_ids": [],
                     "max_tokens": 5, "output_kind": 1, "skip_clone": True, "bad_words": [],
                     "skip_reading_prefix_cache": False}


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
        return resp.status, orjson.loads(await resp.read())


async def test_completions_render_matches_vllm_and_tokenize() -> None:
    async with run_replicas(CFG, 1, base_port=0) as [rep], aiohttp.ClientSession() as s:
        status, body = await post(s, rep.url + "/v1/completions/render", {
            "model": "sim-model", "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}})
        _, tokenized = await post(s, rep.url + "/tokenize", {"model": "sim-model", "prompt": PROMPT})
        _, plain = await post(s, rep.url + "/v1/completions/render", {"model": "sim-model", "prompt": [1, 2, 3]})
        cached_after = rep.cache.num_cached_blocks
    assert status == 200 and isinstance(body, list) and len(body) == 1
    [item] = body
    assert list(item) == GENERATE_REQUEST_KEYS
    assert item["token_ids"] == tokenized["tokens"] == encode(PROMPT)
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", item["request_id"])
    assert item["sampling_params"] == STREAMED_SAMPLING and list(item["sampling_params"]) == list(STREAMED_SAMPLING)
    assert item["stream"] is True and item["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert item["model"] == "sim-model" and item["output_mode"] == "tokens" and item["priority"] == 0
    # Non-streaming, no max_tokens: output_kind 2 and no max_tokens key, as vLLM answers.
    [ids] = plain
    assert ids["token_ids"] == [1, 2, 3] and ids["stream"] is False and ids["stream_options"] is None
    assert "max_tokens" not in ids["sampling_params"] and ids["sampling_params"]["output_kind"] == 2
    assert cached_after == 0  # rendering queues nothing and stores no block


async def test_sampling_params_follow_vllms_rules_for_greedy_and_set_fields() -> None:
    """vLLM 0.32's answers for these bodies (captured from the real engine)."""
    async with run_replicas(CFG, 1, base_port=0) as [rep], aiohttp.ClientSession() as s:
        _, [greedy] = await post(s, rep.url + "/v1/completions/render", {
            "model": "sim-model", "prompt": "hello world", "max_tokens": 2, "temperature": 0})
        _, [tuned] = await post(s, rep.url + "/v1/completions/render", {
            "model": "sim-model", "prompt": "hello", "temperature": 0.7, "top_k": 5, "seed": 3, "ignore_eos": True,
            "n": 1, "stop": ["x"]})
    assert greedy["sampling_params"] == {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 0.0, "stop": [],
        "stop_token_ids": [], "max_tokens": 2, "output_kind": 2, "skip_clone": True, "bad_words": [],
        "skip_reading_prefix_cache": False}
    assert list(tuned["sampling_params"]) == [
        "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
        "seed", "stop", "stop_token_ids", "ignore_eos", "output_kind", "skip_clone", "bad_words",
        "skip_reading_prefix_cache"]
    assert tuned["sampling_params"]["top_k"] == 5 and tuned["sampling_params"]["seed"] == 3
    assert tuned["sampling_params"]["stop"] == ["x"] and tuned["sampling_params"]["temperature"] == 0.7


async def test_chat_render_applies_the_template_like_chat_completions() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    async with run_replicas(CFG, 1, base_port=0) as [rep], aiohttp.ClientSession() as s:
        status, body = await post(s, rep.url + "/v1/chat/completions/render", {
            "model": "sim-model", "messages": messages, "max_completion_tokens": 7, "stream": True})
        _, tokenized = await post(s, rep.url + "/tokenize", {"model": "sim-model", "messages": messages})
        async with s.post(rep.url + "/v1/chat/completions", json={
                "model": "sim-model", "messages": messages, "max_tokens": 1}) as resp:
            generated = await resp.json()
    assert status == 200 and isinstance(body, dict) and list(body) == GENERATE_REQUEST_KEYS
    assert body["token_ids"] == tokenized["tokens"] and len(body["token_ids"]) == generated["usage"]["prompt_tokens"]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["request_id"])
    assert body["sampling_params"]["max_tokens"] == 7 and body["sampling_params"]["output_kind"] == 1
    assert body["stream_options"] is None  # streaming without stream_options, as vLLM answers


async def test_batch_render_one_request_per_prompt_and_bounded() -> None:
    async with run_replicas(CFG, 1, base_port=0) as [rep], aiohttp.ClientSession() as s:
        status, body = await post(s, rep.url + "/v1/completions/render", {
            "model": "sim-model", "prompt": ["one two", [5, 6]]})
        too_many, error = await post(s, rep.url + "/v1/completions/render", {
            "model": "sim-model", "prompt": ["x"] * (MAX_BATCH + 1)})
    assert status == 200 and [b["token_ids"] for b in body] == [encode("one two"), [5, 6]]
    base = body[0]["request_id"].rsplit("-", 1)[0]
    assert [b["request_id"] for b in body] == [f"{base}-0", f"{base}-1"]
    assert too_many == 400 and error["error"]["param"] == "prompt"


async def test_render_errors_have_vllm_shape() -> None:
    async with run_replicas(CFG, 1, base_port=0) as [rep], aiohttp.ClientSession() as s:
        unknown, e1 = await post(s, rep.url + "/v1/completions/render", {"model": "nope", "prompt": "x"})
        no_prompt, e2 = await post(s, rep.url + "/v1/completions/render", {"model": "sim-model"})
        no_messages, e3 = await post(s, rep.url + "/v1/chat/completions/render", {"model": "sim-model"})
        async with s.post(rep.url + "/v1/completions/render", data=b"{not json") as resp:
            bad_json = resp.status
    assert unknown == 404 and e1["error"]["type"] == "NotFoundError" and e1["error"]["code"] == 404
    assert no_prompt == 400 and e2["error"]["param"] == "prompt" and e2["error"]["type"] == "BadRequestError"
    assert no_messages == 400 and e3["error"]["param"] == "messages"
    assert bad_json == 400
