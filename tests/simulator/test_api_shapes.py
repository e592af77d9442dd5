"""The simulator's other API shapes, as vLLM 0.32 writes them: Anthropic Messages, OpenAI Responses
(with previous_response_id), embeddings; and process_start_time_seconds on /metrics."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from extproc.scraping.scraper import parse_vllm_metrics
from extproc.tokenization.builtin import count, encode, render_chat
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.embeddings import DIMENSIONS
from prefix_epp_sim.server import Replica, run_replicas

CFG = SimConfig(time_scale=100.0, kv_events=False, kv_cache_blocks=2048, max_model_len=8192)
SYSTEM = "You answer from the manual, briefly. " * 30
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
PROMPT_TOKENS = len(encode(render_chat(CHAT)))
CACHED = (PROMPT_TOKENS - 1) // 16 * 16  # the second time: every full block but the last token's


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[Replica, aiohttp.ClientSession]]:
    async with run_replicas(CFG, 1, base_port=0) as [replica], aiohttp.ClientSession() as session:
        yield replica, session


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, orjson.loads(await resp.read())


async def events(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[list[str], list[Any]]:
    """(event names, data objects) of an SSE answer; every event has both lines, in that order."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    names, data = [], []
    for block in raw.split("\n\n")[:-1]:
        kind, payload = block.split("\n")
        assert kind.startswith("event: ") and payload.startswith("data: "), block
        names.append(kind[len("event: "):])
        data.append(orjson.loads(payload[len("data: "):]))
        assert data[-1]["type"] == names[-1]
    assert raw.endswith("\n\n") and "[DONE]" not in raw
    return names, data


async def test_messages_answer_is_an_anthropic_message_with_cache_reads() -> None:
    async with serving() as (rep, s):
        body = {"model": "sim-model", "max_tokens": 5, "system": SYSTEM,
                "messages": [{"role": "user", "content": "hi"}]}
        status, first = await post(s, rep.url + "/v1/messages", body)
        assert status == 200
        assert first["id"].startswith("chatcmpl-")  # vLLM keeps the chat completion's id
        assert {k: v for k, v in first.items() if k != "id"} == {
            "type": "message", "role": "assistant", "model": "sim-model", "stop_reason": "max_tokens",
            "content": [{"type": "text", "text": "The quick brown fox jumps"}],
            "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": 5, "cache_read_input_tokens": 0}}
        _, second = await post(s, rep.url + "/v1/messages", body)  # Messages and chat cache alike
        assert second["usage"] == {"input_tokens": PROMPT_TOKENS - CACHED, "output_tokens": 5,
                                   "cache_read_input_tokens": CACHED}


async def test_messages_stream_in_anthropics_events() -> None:
    async with serving() as (rep, s):
        body = {"model": "sim-model", "max_tokens": 5, "stream": True, "system": SYSTEM,
                "messages": [{"role": "user", "content": "hi"}]}
        names, data = await events(s, rep.url + "/v1/messages", body)
        deltas = len(names) - 5
        assert deltas >= 1 and names == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                                         "content_block_stop", "message_delta", "message_stop"]
        start = data[0]["message"]
        assert start["content"] == [] and start["stop_reason"] is None and start["stop_sequence"] is None
        assert start["usage"] == {"input_tokens": PROMPT_TOKENS, "output_tokens": 0}
        assert data[1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
        assert "".join(d["delta"]["text"] for d in data[2:2 + deltas]) == "The quick brown fox jumps"
        assert {d["delta"]["type"] for d in data[2:2 + deltas]} == {"text_delta"}
        assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert data[-2]["usage"] == {"input_tokens": PROMPT_TOKENS, "output_tokens": 5, "cache_read_input_tokens": 0}


async def test_messages_errors() -> None:
    async with serving() as (rep, s):
        status, body = await post(s, rep.url + "/v1/messages", {"model": "sim-model", "messages": [
            {"role": "user", "content": "hi"}]})  # no max_tokens: the request does not validate
        assert status == 400 and body["error"]["param"] == "max_tokens"
        status, body = await post(s, rep.url + "/v1/messages", {"model": "nope", "max_tokens": 3, "messages": [
            {"role": "user", "content": "hi"}]})
        assert status == 404 and body["type"] == "error" and body["error"]["type"] == "NotFoundError"


async def test_responses_answer_is_vllms_response_object() -> None:
    async with serving() as (rep, s):
        body = {"model": "sim-model", "instructions": SYSTEM, "input": "hi", "max_output_tokens": 5}
        status, first = await post(s, rep.url + "/v1/responses", body)
        assert status == 200
        assert next(iter(first)) == "id" and first["id"].startswith("resp_")  # the picker reads it first
        assert first["object"] == "response" and first["model"] == "sim-model"
        assert first["status"] == "incomplete" and first["incomplete_details"] == {"reason": "max_output_tokens"}
        assert first["instructions"] == SYSTEM and first["max_output_tokens"] == 5
        assert (first["tools"], first["tool_choice"], first["parallel_tool_calls"]) == ([], "auto", True)
        [item] = first["output"]
        assert item["id"].startswith("msg_") and (item["type"], item["role"], item["status"]) == (
            "message", "assistant", "completed")
        assert item["content"] == [{"annotations": [], "text": "The quick brown fox jumps", "type": "output_text",
                                    "logprobs": None}]
        usage = first["usage"]
        assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (
            PROMPT_TOKENS, 5, PROMPT_TOKENS + 5)
        assert usage["input_tokens_details"]["cached_tokens"] == 0
        assert usage["output_tokens_details"]["reasoning_tokens"] == 0
        _, second = await post(s, rep.url + "/v1/responses", {**body, "store": False})
        assert second["usage"]["input_tokens_details"]["cached_tokens"] == CACHED  # as the same chat request
        status, gone = await post(s, rep.url + "/v1/responses", {**body, "previous_response_id": second["id"]})
        assert status == 404 and gone["error"]["param"] == "response_id"  # store: false kept nothing


async def test_previous_response_id_continues_the_stored_conversation() -> None:
    async with serving() as (rep, s):
        _, first = await post(s, rep.url + "/v1/responses", {"model": "sim-model", "instructions": SYSTEM,
                                                              "input": "hi", "max_output_tokens": 5})
        _, second = await post(s, rep.url + "/v1/responses", {
            "model": "sim-model", "instructions": SYSTEM, "input": "and then?", "max_output_tokens": 5,
            "previous_response_id": first["id"]})
        chat = [*CHAT, {"role": "assistant", "content": "The quick brown fox jumps"},
                {"role": "user", "content": "and then?"}]
        n = len(encode(render_chat(chat)))
        assert second["previous_response_id"] == first["id"] and second["usage"]["input_tokens"] == n
        # The first turn's prompt and answer were cached: every full block of them is a hit.
        assert second["usage"]["input_tokens_details"]["cached_tokens"] == (PROMPT_TOKENS + 5) // 16 * 16


async def test_responses_stream_in_openais_events() -> None:
    async with serving() as (rep, s):
        body = {"model": "sim-model", "instructions": SYSTEM, "input": "hi", "max_output_tokens": 5, "stream": True}
        names, data = await events(s, rep.url + "/v1/responses", body)
        deltas = len(names) - 8
        assert deltas >= 1 and names == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed"]
        assert [d["sequence_number"] for d in data] == list(range(len(data)))
        created, done = data[0]["response"], data[-1]["response"]
        assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
        assert created["id"] == done["id"] and done["status"] == "incomplete"
        text = "".join(d["delta"] for d in data[4:4 + deltas])
        assert text == data[4 + deltas]["text"] == done["output"][0]["content"][0]["text"]
        assert text == "The quick brown fox jumps"
        assert {d["item_id"] for d in data[3:-2]} == {done["output"][0]["id"]}
        assert done["usage"]["input_tokens"] == PROMPT_TOKENS and done["usage"]["output_tokens"] == 5
        _, again = await post(s, rep.url + "/v1/responses", {
            "model": "sim-model", "instructions": SYSTEM, "input": "next", "previous_response_id": done["id"],
            "max_output_tokens": 1})
        assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0  # a streamed answer is stored too


async def test_embeddings_float_and_base64_agree_and_are_deterministic() -> None:
    async with serving() as (rep, s):
        url = rep.url + "/v1/embeddings"
        status, floats = await post(s, url, {"model": "sim-model", "input": ["a red fox", "a blue fox"]})
        assert status == 200 and floats["object"] == "list" and floats["id"].startswith("embd-")
        assert [(d["object"], d["index"], len(d["embedding"])) for d in floats["data"]] == [
            ("embedding", 0, DIMENSIONS), ("embedding", 1, DIMENSIONS)]
        vec = floats["data"][0]["embedding"]
        assert abs(sum(v * v for v in vec) - 1.0) < 1e-5 and vec != floats["data"][1]["embedding"]
        tokens = count("a red fox") + count("a blue fox")
        assert floats["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                   "prompt_tokens_details": None, "completion_tokens_details": None}
        _, b64 = await post(s, url, {"model": "sim-model", "input": encode("a red fox"), "encoding_format": "base64"})
        raw = base64.b64decode(b64["data"][0]["embedding"])
        assert list(struct.unpack(f"<{DIMENSIONS}f", raw)) == vec  # the same input as token ids
        _, short = await post(s, url, {"model": "sim-model", "input": "a red fox", "dimensions": 8})
        assert len(short["data"][0]["embedding"]) == 8
        for bad in ({"model": "sim-model", "input": ""}, {"model": "sim-model", "input": []},
                    {"model": "sim-model", "input": "x", "encoding_format": "bytes"},
                    {"model": "sim-model", "input": "x", "dimensions": DIMENSIONS + 1}):
            status, err = await post(s, url, bad)
            assert status == 400 and err["error"]["type"] == "BadRequestError", bad


async def test_embeddings_are_costed_and_cached_on_the_engine() -> None:
    async with serving() as (rep, s):
        text = "The embedded document. " * 20
        await post(s, rep.url + "/v1/embeddings", {"model": "sim-model", "input": text})
        await post(s, rep.url + "/v1/embeddings", {"model": "sim-model", "input": text})
        stats = rep.engine.stats
        assert stats.prompt_tokens == 2 * count(text)
        assert stats.prefix_hits == (count(text) - 1) // 16 * 16


async def test_process_start_time_seconds_is_the_replicas_start() -> None:
    before = time.time()
    async with serving() as (rep, s):
        after = time.time()
        async with s.get(rep.url + "/metrics") as resp:
            text = await resp.text()
    [family] = [f for f in text_string_to_metric_families(text) if f.name == "process_start_time_seconds"]
    [sample] = family.samples
    assert family.type == "gauge" and sample.labels == {} and before <= sample.value <= after
    assert "process_start_time_seconds " in text  # no labels, as prometheus_client's process collector
    assert parse_vllm_metrics(text.encode(), time.time()).started_at == sample.value  # as the picker reads it
