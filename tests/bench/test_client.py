"""bench.lib.client against a tiny streaming server: TTFT is the first chunk with text, or, for a
stream whose tokens never decode to text (a random model on real vLLM), its first choice chunk."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from bench.lib.client import RequestResult, run, send
from bench.lib.workloads import Session, Workload
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas
from testkit.procs import free_ports

USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3}}\n\n'


async def _serve(chunks: list[bytes], path: str = "/v1/completions",
                 seen: list[str] | None = None, headers: dict[str, str] | None = None) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(request.path)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", **(headers or {})})
        await resp.prepare(request)
        for chunk in chunks:
            await asyncio.sleep(0.05)
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post(path, handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    [port] = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}" + ("/v1/completions" if path == "/v1/completions" else "")


async def _ttft(chunks: list[bytes], headers: dict[str, str] | None = None) -> RequestResult:
    runner, url = await _serve(chunks, headers=headers)
    try:
        result = RequestResult(0, 0, "t", 0.0, 0.0)
        async with aiohttp.ClientSession() as session:
            await send(session, url, {"prompt": "x"}, result, 1.0)
        return result
    finally:
        await runner.cleanup()


async def test_ttft_is_the_first_chunk_with_text() -> None:
    r = await _ttft([b'data: {"choices": [{"text": ""}]}\n\n', b'data: {"choices": [{"text": "hi"}]}\n\n', USAGE])
    assert r.ok and r.ttft_s is not None and r.ttft_s >= 0.09  # the second chunk, not the first


async def test_a_stream_without_text_times_its_first_choice_chunk() -> None:
    r = await _ttft([b'data: {"choices": [{"text": ""}]}\n\n', b'data: {"choices": [{"text": ""}]}\n\n', USAGE])
    assert r.ok and r.ttft_s is not None and 0.04 <= r.ttft_s < 0.09
    assert r.prompt_tokens == 40 and r.completion_tokens == 3


async def test_the_pickers_explanation_is_kept_with_the_request() -> None:
    """With --explain-decisions the picker answers why it chose the endpoint; the raw records keep it."""
    chunk = b'data: {"choices": [{"text": "hi"}]}\n\n'
    why = "endpoint=10.0.0.1:8000; matched=3/4; predicted_ttft_ms=10.0.0.1:8000:12.0"
    r = await _ttft([chunk, USAGE], {"x-served-by": "10.0.0.1:8000", "x-prefix-epp-decision": why})
    assert r.ok and r.served_by == "10.0.0.1:8000" and r.decision == why
    assert (await _ttft([chunk, USAGE])).decision == ""  # not asked for: nothing kept


async def test_several_gateways_take_a_conversations_turns_in_turn() -> None:
    """Turn k of session i goes to gateway (i + k) mod n, and each result names its gateway."""
    chat = b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n'
    seen: list[list[str]] = [[], [], []]
    servers = [await _serve([chat, USAGE], "/v1/chat/completions", seen[g]) for g in range(3)]
    try:
        sessions = (Session(0, 0.0, "chat", ("a", "b", "c", "d"), 4, think_s=(0.0, 0.0, 0.0)),
                    Session(1, 0.0, "chat", ("e",), 4))
        result = await run([url for _, url in servers], Workload("w", sessions))
    finally:
        for runner, _ in servers:
            await runner.cleanup()
    assert all(r.ok for r in result.requests)
    assert sorted((r.session, r.turn, r.gateway) for r in result.requests) == [
        (0, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 0), (1, 0, 1)]
    assert [len(s) for s in seen] == [2, 2, 1]


async def test_messages_and_responses_streams_give_text_and_usage_as_chat_does() -> None:
    """The mixed-shapes workload's /v1/messages and /v1/responses turns, streamed in their own
    events by a simulated replica: the same answer, prompt and cached tokens as the chat turn."""
    system = "Answer in the manual's words. " * 30
    common = {"model": "sim-model", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    bodies = {
        "/v1/chat/completions": {**common, "messages": [{"role": "system", "content": system},
                                                        {"role": "user", "content": "hi"}]},
        "/v1/messages": {**common, "system": system, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {**common, "instructions": system, "input": "hi"},
    }
    async with run_replicas(SimConfig(time_scale=100.0, kv_events=False), 1, base_port=0) as [rep], \
            aiohttp.ClientSession() as session:
        results = {}
        for path, payload in bodies.items():
            result = RequestResult(0, 0, path, 0.0, 0.0)
            answer = await send(session, rep.url + path, payload, result, 1.0)
            results[path] = (answer, result.prompt_tokens, result.completion_tokens)
            assert result.ok and result.ttft_s is not None, result.error
            if path != "/v1/chat/completions":  # the same prompt as the chat turn before it: cached
                assert result.cached_tokens == (result.prompt_tokens - 1) // 16 * 16 > 0
    assert len(set(results.values())) == 1 and results["/v1/messages"][0]
