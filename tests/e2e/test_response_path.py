"""The picker off the token stream, through real Envoy configured by `prefix-epp envoy-config`.

Default wiring: only the response's headers (its status) and its end reach the picker (trailers,
or the stream's end), not its body chunks; the in-flight count lasts until the response's true end. The
picker asks for the response body of the requests its usage sampler picks (mode_override), and
only those feed the closed loop: the served hit rate and the prediction for it. How each stream's
end is counted (`end`, `closed_by`) for finished streams and for clients that leave.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.server import run_replicas
from testkit.envoy import run_envoy
from testkit.picker import Picker, picker_for, scrape, until, value

pytestmark = pytest.mark.e2e

# 200 decode steps of 8 ms / 4: the stream lasts ~0.4 s, long enough to look inside it.
SIM = SimConfig(time_scale=4.0, kv_events=False)


def messages(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], kind: str) -> float:
    return value(samples, "prefix_epp_extproc_messages_total", kind=kind)


def ends(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[tuple[str, str], float]:
    """prefix_epp_extproc_streams_total by (end, closed_by), the series counted so far."""
    return {(dict(labels)["end"], dict(labels)["closed_by"]): v for (name, labels), v in samples.items()
            if name == "prefix_epp_extproc_streams_total" and v}


def inflight(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(v for (name, _), v in samples.items() if name == "prefix_epp_inflight_requests")


@contextlib.asynccontextmanager
async def sim_stack(tmp: Path, *picker_args: str, request_body_mode: str = "BUFFERED",
                    graceful_ext_proc_close: bool = False) -> AsyncIterator[tuple[Picker, str]]:
    async with run_replicas(SIM, 1, base_port=0) as reps:
        picker = picker_for(tmp, [f"127.0.0.1:{reps[0].port}"], "--refresh-metrics-interval", "0", *picker_args)
        await asyncio.to_thread(picker.start)  # the simulated engine keeps running in this loop meanwhile
        try:
            with contextlib.ExitStack() as stack:
                _, listen, _ = await asyncio.to_thread(
                    stack.enter_context,
                    run_envoy(tmp, picker.grpc_port, request_body_mode=request_body_mode,
                              graceful_ext_proc_close=graceful_ext_proc_close))
                yield picker, f"http://127.0.0.1:{listen}/v1/completions"
        finally:
            await asyncio.to_thread(picker.stop)


async def test_streamed_answer_passes_by_the_picker_which_still_sees_its_end(tmp_path: Path) -> None:
    async with sim_stack(tmp_path) as (picker, url), aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "prompt": "Tell a long story. " * 20, "max_tokens": 200, "stream": True}
        during = None
        events: list[bytes] = []
        async with s.post(url, json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                events.append(line[6:].strip())
                if len(events) == 20:  # mid-stream: the request is still in flight
                    during = await asyncio.to_thread(scrape, picker)
        assert events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0].get("text") is not None) == 200
        assert during is not None and inflight(during) == 1
        after = await until(picker, lambda m: inflight(m) == 0)
        assert messages(after, "response_body") == 0  # not one of the ~200 chunks went through the picker
        assert messages(after, "response_headers") == 1  # its status: the request's outcome
        assert messages(after, "request_headers") == 1
        # The stream ended complete (Envoy's half-close and reset: test_a_proxy_that_resets_... below).
        await until(picker, lambda m: ends(m) == {("complete", "proxy"): 1})


async def test_sampled_responses_feed_the_closed_loop_and_the_others_skip_the_picker(tmp_path: Path) -> None:
    # BUFFERED request bodies let Envoy honour mode_override; 0.5 samples every second request.
    async with sim_stack(tmp_path, "--usage-sample-rate", "0.5", request_body_mode="BUFFERED") as (picker, url), \
            aiohttp.ClientSession() as s:
        seen: list[tuple[float, float]] = []
        for i in range(4):
            body = {"model": "sim-model", "prompt": f"question {i}: " + "shared context " * 30, "max_tokens": 20,
                    "stream": i >= 2, "stream_options": {"include_usage": True}}
            async with s.post(url, json=body) as resp:
                assert resp.status == 200
                await resp.read()
            m = await until(picker, lambda m, n=i + 1: messages(m, "request_headers") == n and inflight(m) == 0)
            seen.append((messages(m, "response_body"),
                         value(m, "prefix_epp_cached_tokens_predictions_total", scorer="approximate")))
        bodies = [b for b, _ in seen]
        predictions = [p for _, p in seen]
        # Requests 1 and 3 are not sampled: no body message and no prediction came with them.
        assert bodies[0] == 0 and predictions[0] == 0
        assert bodies[1] > 0 and predictions[1] == 1  # sampled, non-streamed
        assert bodies[2] == bodies[1] and predictions[2] == 1
        # Sampled stream: its chunks (Envoy may coalesce some), then the usage chunk fed the loop.
        assert bodies[3] > bodies[2] and predictions[3] == 2


async def test_a_proxy_that_resets_finished_streams_closes_them_and_they_count_complete(tmp_path: Path) -> None:
    # The generated config: Envoy's reset follows its half-close; the picker lets it cancel the
    # stream rather than answer the half-close with a status (grpc.aio keeps a failed status
    # batch's native memory: extproc/transport/call.py). Refused requests too: after its
    # immediate response the picker reads on to Envoy's half-close instead of closing first.
    async with sim_stack(tmp_path) as (picker, url), aiohttp.ClientSession() as s:
        async def one(i: int) -> int:
            body = {"model": "sim-model", "prompt": f"question {i}: " + "shared context " * 30, "max_tokens": 4}
            async with s.post(url, json=body) as resp:
                await resp.read()
                return resp.status

        async def refused(i: int) -> int:
            async with s.post(url, data=b'{"model": "sim-model", "prompt": "cut ' + str(i).encode(),
                              headers={"content-type": "application/json"}) as resp:
                await resp.read()
                return resp.status

        assert await asyncio.gather(*(one(i) for i in range(40))) == [200] * 40
        assert await asyncio.gather(*(refused(i) for i in range(20))) == [400] * 20
        ended = await until(picker, lambda m: sum(ends(m).values()) == 60 and inflight(m) == 0)
        # Every one was answered, routed or refused: complete, whoever closed the call.
        assert {end for end, _ in ends(ended)} == {"complete"}
        # A reset reaches its stream within the picker's 50 ms wait after the half-close unless its
        # event loop lags longer (then the picker closes the stream as after a graceful half-close);
        # without the wait none was closed by the proxy, with 3 event-loop turns instead 34 of 40 were
        # on a loaded 2-core machine, and a refused stream was closed by the picker before Envoy's reset.
        assert ends(ended).get(("complete", "proxy"), 0) >= 54


async def test_with_the_graceful_close_the_picker_closes_each_stream(tmp_path: Path) -> None:
    # `prefix-epp envoy-config --graceful-ext-proc-close`: Envoy half-closes, the picker closes.
    async with sim_stack(tmp_path, graceful_ext_proc_close=True) as (picker, url), aiohttp.ClientSession() as s:
        for i in range(3):
            body = {"model": "sim-model", "prompt": f"question {i}", "max_tokens": 4}
            async with s.post(url, json=body) as resp:
                assert resp.status == 200
                await resp.read()
        await until(picker, lambda m: ends(m) == {("complete", "picker"): 3})


async def leave_mid_response(url: str) -> None:
    """A streamed completion whose client reads 10 chunks, then closes its connection."""
    async with aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "prompt": "Tell a long story. " * 20, "max_tokens": 200, "stream": True}
        async with s.post(url, json=body) as resp:
            assert resp.status == 200
            n = 0
            async for line in resp.content:
                n += line.startswith(b"data: ")
                if n == 10:
                    break
            resp.close()  # the connection is dropped, the ~190 chunks left unread


async def start_upload(url: str) -> asyncio.StreamWriter:
    """A request of which the client sent its headers and part of its body; the caller closes it."""
    _, writer = await asyncio.open_connection("127.0.0.1", urlsplit(url).port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b'content-length: 1000\r\n\r\n{"model": "sim-model", "prompt": "cut')
    await writer.drain()
    return writer


async def test_stream_ends_for_clients_that_leave_as_envoy_shows_them_to_the_picker(tmp_path: Path) -> None:
    # Envoy ends the ext_proc stream the same way (half-close, reset) when a response completes and
    # when its client leaves mid-response: only a response body the picker reads tells them apart.
    async with sim_stack(tmp_path, "--usage-sample-rate", "0.5") as (picker, url):
        await leave_mid_response(url)  # not sampled: the picker does not see the response
        await until(picker, lambda m: ends(m).get(("complete", "proxy"), 0) == 1 and inflight(m) == 0)
        await leave_mid_response(url)  # sampled: its body comes to the picker, and its end does not
        await until(picker, lambda m: ends(m).get(("reset", "proxy"), 0) == 1 and inflight(m) == 0)
        writer = await start_upload(url)
        # The picker reads the headers, then waits for the body: the client leaves before its end.
        await until(picker, lambda m: messages(m, "request_headers") == 3)
        writer.close()
        await writer.wait_closed()
        m = await until(picker, lambda m: ends(m).get(("reset", "proxy"), 0) == 2)
        assert ends(m) == {("complete", "proxy"): 1, ("reset", "proxy"): 2}
        assert messages(m, "response_body") > 0  # the sampled one's chunks up to the client's leaving


async def test_served_hit_rate_counts_the_engines_usage_beside_the_prediction(tmp_path: Path) -> None:
    async with sim_stack(tmp_path, "--usage-sample-rate", "1") as (picker, url), aiohttp.ClientSession() as s:
        usages = []
        for i in range(3):
            # The same long prefix each time: the simulated engine caches it after the first request.
            body = {"model": "sim-model", "prompt": "shared context " * 60 + f"question {i}", "max_tokens": 4,
                    "stream": i == 2, "stream_options": {"include_usage": True}}
            async with s.post(url, json=body) as resp:
                assert resp.status == 200
                if i < 2:
                    usages.append((await resp.json())["usage"])
                else:
                    events = [line[6:].strip() async for line in resp.content if line.startswith(b"data: {")]
                    usages.append(orjson.loads(events[-1])["usage"])  # the include_usage chunk
        prompt = sum(u["prompt_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert cached > 0 and usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        m = await until(picker, lambda m: value(m, "prefix_epp_cached_tokens_predictions_total",
                                                scorer="approximate") == 3)
        assert value(m, "prefix_epp_served_prompt_tokens_total") == prompt
        assert value(m, "prefix_epp_served_cached_prompt_tokens_total") == cached
        # The prediction for the same responses: nothing for the first (cold), the shared prefix after.
        predicted = value(m, "prefix_epp_predicted_cached_prompt_tokens_total", scorer="approximate")
        assert 0 < predicted <= prompt - usages[0]["prompt_tokens"]
        assert value(m, "prefix_epp_predicted_prefix_hit_ratio_count") == 3
