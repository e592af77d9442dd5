"""The HTTP surface: OpenAI/vLLM shapes, streaming, errors, faults, metrics, many replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.tokenization.builtin import count, encode, render_chat
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import Replica, replica_address, run_replicas

CFG = SimConfig(time_scale=100.0, kv_events=False, kv_cache_blocks=2048, max_model_len=8192)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40  # 401 tokens


@asynccontextmanager
async def serving(config: SimConfig = CFG, n: int = 1) -> AsyncIterator[tuple[list[Replica], aiohttp.ClientSession]]:
    async with run_replicas(config, n, base_port=0) as replicas, aiohttp.ClientSession() as session:
        yield replicas, session


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any, aiohttp.ClientResponse]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if raw else None), resp


async def sse(session: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    events: list[Any] = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data: "):
                payload = text[len("data: "):]
                events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def metrics(session: aiohttp.ClientSession, replica: Replica) -> dict[str, float]:
    async with session.get(replica.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if sample.name.endswith("_bucket"):
                key += "{le=" + sample.labels["le"] + "}"
            out[key] = sample.value
    return out


async def test_completion_usage_cached_tokens_and_served_by() -> None:
    async with serving() as ([rep], s):
        url = rep.url + "/v1/completions"
        status, first, resp = await post(s, url, {"model": "sim-model", "prompt": PROMPT, "max_tokens": 7})
        assert status == 200 and resp.headers["x-served-by"] == rep.address == f"127.0.0.1:{rep.port}"
        assert first["object"] == "text_completion"
        assert first["choices"][0]["finish_reason"] == "length"
        assert count(first["choices"][0]["text"]) == 7
        n = count(PROMPT)
        assert first["usage"] == {"prompt_tokens": n, "completion_tokens": 7, "total_tokens": n + 7,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
        _, second, _ = await post(s, url, {"model": "sim-model", "prompt": PROMPT, "max_tokens": 7})
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n // 16 * 16


async def test_default_max_tokens_and_token_id_prompt() -> None:
    async with serving() as ([rep], s):
        _, body, _ = await post(s, rep.url + "/v1/completions", {"model": "sim-model", "prompt": [5, 6, 7]})
        assert body["usage"]["completion_tokens"] == CFG.default_max_tokens
        assert body["usage"]["prompt_tokens"] == 3


async def test_chat_renders_template_and_tokenize_agrees() -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}]
    async with serving() as ([rep], s):
        status, body, _ = await post(s, rep.url + "/v1/chat/completions",
                                     {"model": "sim-model", "messages": messages, "max_completion_tokens": 3})
        assert status == 200 and body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["role"] == "assistant"
        expected = len(encode(render_chat(messages)))
        assert body["usage"]["prompt_tokens"] == expected
        _, tok, _ = await post(s, rep.url + "/tokenize", {"model": "sim-model", "messages": messages})
        assert tok["count"] == expected and tok["tokens"] == encode(render_chat(messages))
        assert tok["max_model_len"] == CFG.max_model_len
        _, tok, _ = await post(s, rep.url + "/tokenize", {"model": "sim-model", "prompt": "hello there"})
        assert tok["count"] == 2


async def test_streaming_completion_sse_with_usage_in_last_chunk() -> None:
    async with serving() as ([rep], s):
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}
        events = await sse(s, rep.url + "/v1/completions", body)
        assert events[-1] == "[DONE]"
        usage_chunk, chunks = events[-2], events[:-2]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 12
        assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert all(c["usage"] is None for c in chunks)
        assert len(chunks) == 12  # one delta per decode step with --stream-interval 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        text = "".join(c["choices"][0]["text"] for c in chunks)
        _, whole, _ = await post(s, rep.url + "/v1/completions", {**body, "stream": False})
        assert text == whole["choices"][0]["text"]


async def test_streaming_chat_without_usage() -> None:
    async with serving() as ([rep], s):
        events = await sse(s, rep.url + "/v1/chat/completions", {
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True})
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)
        assert count("".join(c["choices"][0]["delta"]["content"] for c in chunks)) == 4


async def test_errors_have_openai_shape() -> None:
    async with serving() as ([rep], s):
        url = rep.url + "/v1/completions"
        status, body, resp = await post(s, url, b"{not json")
        assert status == 400 and body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
        assert "JSON" in body["error"]["message"] and resp.headers["x-served-by"] == rep.address
        status, body, _ = await post(s, url, {"model": "nope", "prompt": "x"})
        assert status == 404 and body["error"]["message"] == "The model `nope` does not exist."
        status, body, _ = await post(s, url, {"model": "sim-model", "prompt": "x", "max_tokens": 10**6})
        assert status == 400 and "maximum context length" in body["error"]["message"]
        for prompt in ({"a": 1}, "", [], [-1]):
            status, body, _ = await post(s, url, {"model": "sim-model", "prompt": prompt})
            assert status == 400, prompt
        status, body, _ = await post(s, rep.url + "/v1/chat/completions", {"model": "sim-model", "messages": []})
        assert status == 400
        async with s.get(rep.url + "/nope") as resp:
            assert resp.status == 404 and resp.headers["x-served-by"] == rep.address
            assert await resp.json() == {"detail": "Not Found"}
        async with s.get(url) as resp:
            assert resp.status == 405 and resp.headers["x-served-by"] == rep.address


async def test_models_health_and_lora_request() -> None:
    cfg = CFG.replace(served_model_name=("m1", "m1-alias"), lora_modules=('{"name": "food-review"}', "sql=/x"),
                      max_loras=2, time_scale=20.0)
    async with serving(cfg) as ([rep], s):
        async with s.get(rep.url + "/health") as resp:
            assert resp.status == 200
        async with s.get(rep.url + "/v1/models") as resp:
            ids = [m["id"] for m in (await resp.json())["data"]]
        assert ids == ["m1", "m1-alias", "food-review", "sql"]
        task = asyncio.create_task(post(s, rep.url + "/v1/completions",
                                        {"model": "food-review", "prompt": "x", "max_tokens": 200}))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if rep.engine.running:
                break
        scraped = await scrape_text(s, rep)
        assert 'running_lora_adapters="food-review"' in scraped and 'max_lora="2"' in scraped
        status, body, _ = await task
        assert status == 200 and body["model"] == "food-review"
        status, _, _ = await post(s, rep.url + "/v1/completions", {"model": "m1-alias", "prompt": "x"})
        assert status == 200


async def scrape_text(s: aiohttp.ClientSession, rep: Replica) -> str:
    async with s.get(rep.url + "/metrics") as resp:
        return await resp.text()


async def test_metrics_move_with_load() -> None:
    cfg = CFG.replace(time_scale=10.0, max_num_seqs=4)
    async with serving(cfg) as ([rep], s):
        idle = await metrics(s, rep)
        assert idle["vllm:num_requests_running"] == 0 and idle["vllm:kv_cache_usage_perc"] == 0
        assert idle["vllm:cache_config_info"] == 1
        url = rep.url + "/v1/completions"
        tasks = [asyncio.create_task(post(s, url, {"model": "sim-model", "prompt": f"{i} {PROMPT}",
                                                   "max_tokens": 30})) for i in range(10)]
        busy: dict[str, float] = {}
        for _ in range(200):
            await asyncio.sleep(0.005)
            busy = await metrics(s, rep)
            if busy["vllm:num_requests_waiting"] > 0 and busy["vllm:num_requests_running"] == 4:
                break
        assert busy["vllm:num_requests_running"] == 4 and busy["vllm:num_requests_waiting"] > 0
        assert 0 < busy["vllm:kv_cache_usage_perc"] < 1
        await asyncio.gather(*tasks)
        done = await metrics(s, rep)
        assert done["vllm:num_requests_running"] == 0 and done["vllm:kv_cache_usage_perc"] == 0
        assert done["vllm:time_to_first_token_seconds_count"] == 10
        assert done["vllm:request_success_total"] == 10
        n = count(f"3 {PROMPT}")
        assert done["vllm:prefix_cache_queries_total"] == 10 * n
        assert done["vllm:prefix_cache_hits_total"] == 0  # the leading number makes every block 0 differ
        await post(s, url, {"model": "sim-model", "prompt": f"3 {PROMPT}", "max_tokens": 1})
        again = await metrics(s, rep)
        assert again["vllm:prefix_cache_queries_total"] == 11 * n
        assert again["vllm:prefix_cache_hits_total"] == n // 16 * 16
        # Every request is counted once in the queue and TTFT histograms. Their sums are model time,
        # and a replica that falls behind its schedule (a loaded machine) does not charge the lag
        # as queueing (prefix_epp_sim/engine.py), so the sums are not asserted here.
        assert again["vllm:request_queue_time_seconds_count"] == 11
        assert again["vllm:time_to_first_token_seconds_count"] == 11


async def test_failure_rate_answers_500_in_vllm_shape() -> None:
    async with serving(CFG.replace(failure_rate=0.5, seed=3)) as ([rep], s):
        statuses = []
        for _ in range(60):
            status, body, _ = await post(s, rep.url + "/v1/completions",
                                         {"model": "sim-model", "prompt": "hi", "max_tokens": 1})
            statuses.append(status)
            if status == 500:
                assert body["error"]["type"] == "InternalServerError" and body["error"]["code"] == 500
        assert set(statuses) == {200, 500}
        assert 15 <= statuses.count(500) <= 45
        assert rep.failures == statuses.count(500)
    async with serving(CFG.replace(failure_rate=1.0)) as ([rep], s):
        status, _, _ = await post(s, rep.url + "/v1/completions", {"model": "sim-model", "prompt": "hi"})
        assert status == 500


async def test_startup_delay_keeps_health_unready() -> None:
    async with serving(CFG.replace(startup_delay=3.0)) as ([rep], s):
        async with s.get(rep.url + "/health") as resp:
            assert resp.status == 503
        status, body, _ = await post(s, rep.url + "/v1/completions", {"model": "sim-model", "prompt": "x"})
        assert status == 503 and body["error"]["code"] == 503
        deadline = asyncio.get_running_loop().time() + 15
        while True:  # ready once the delay has passed
            async with s.get(rep.url + "/health") as resp:
                if resp.status == 200:
                    break
            assert asyncio.get_running_loop().time() < deadline, "never turned healthy"
            await asyncio.sleep(0.05)


async def test_reset_prefix_cache() -> None:
    async with serving() as ([rep], s):
        url = rep.url + "/v1/completions"
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
        await post(s, url, body)
        async with s.post(rep.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        _, out, _ = await post(s, url, body)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_many_replicas_have_independent_caches_and_registries() -> None:
    async with serving(CFG, n=3) as (reps, s):
        assert len({r.port for r in reps}) == 3
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 2}
        for _ in range(2):
            _, out, resp = await post(s, reps[0].url + "/v1/completions", body)
            assert resp.headers["x-served-by"] == reps[0].address
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        _, out, resp = await post(s, reps[1].url + "/v1/completions", body)
        assert resp.headers["x-served-by"] == reps[1].address
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        m0, m2 = await metrics(s, reps[0]), await metrics(s, reps[2])
        assert m0["vllm:request_success_total"] == 2 and m2["vllm:request_success_total"] == 0


def test_replica_addresses() -> None:
    assert replica_address(CFG, 2, 8001) == ("127.0.0.1", 8003)
    assert replica_address(CFG, 2, 0) == ("127.0.0.1", 0)
    assert replica_address(CFG.replace(spread_hosts=True), 2, 8000) == ("127.0.0.3", 8000)


async def test_a_minimal_metrics_surface_and_a_slow_replica() -> None:
    cfg = CFG.replace(replicas=2, metrics_surface="minimal", slow_replicas=1, slow_factor=4.0)
    async with serving(cfg, n=2) as (reps, s):
        status, _, _ = await post(s, reps[1].url + "/v1/completions", {"model": "sim-model", "prompt": PROMPT,
                                                                       "max_tokens": 2})
        assert status == 200
        got = await metrics(s, reps[1])
        assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:cache_config_info"} == set(got)  # no TTFT histogram, no token counters
        fast, slow = reps[0].engine.config, reps[1].engine.config  # the last replica is the slow one
        assert (fast.prefill_time_per_token, fast.inter_token_latency) == (0.06, 8.0)
        assert slow.prefill_time_per_token == pytest.approx(0.24) and slow.inter_token_latency == 32.0
        assert slow.decode_time_per_seq == pytest.approx(0.6) and slow.prefill_overhead == 8.0
    with pytest.raises(ValueError, match="slow_replicas"):
        CFG.replace(slow_replicas=2)


def test_without_slow_replicas_every_replica_keeps_the_costs_however_many_run() -> None:
    assert CFG.replicas == 1 and CFG.for_replica(3) is CFG  # run_replicas may start more than `replicas`
