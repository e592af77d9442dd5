"""The sidecar against engine stand-ins that record what each leg carried (testkit/sidecar.py):
the exact bodies and headers of the prefill and the decode, error answers, bounds, graceful stop."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from testkit.certs import Authority
from testkit.procs import free_port
from testkit.sidecar import Recorder, Seen, json_answer, sidecar

PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9],
          "remote_engine_id": "engine-p", "remote_request_id": "cmpl-p", "remote_host": "10.0.0.7",
          "remote_port": 5600, "tp_size": 1}
SSE = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n', b"data: [DONE]\n\n"]
# The client's body as it wrote it: spacing and key order are its own, and shared-storage keeps them.
RAW = (b'{"prompt": "p",  "model": "m", "max_tokens": 5, "min_tokens": 2, "stream": true,\n'
       b' "stream_options": {"include_usage": true}}')
HEADERS = {"content-type": "application/json", "connection": "keep-alive, x-hop", "x-hop": "1", "x-end": "2",
           "te": "trailers", "authorization": "Bearer t"}


async def prefill_ok(seen: Seen) -> web.Response:
    return await json_answer(seen, body={"id": "cmpl-p", "choices": [{"text": "a"}], "kv_transfer_params": PARAMS})


async def decode_streams(seen: Seen) -> web.StreamResponse:
    return await stream(seen, asyncio.Event(), set_at_once=True)


async def stream(seen: Seen, gate: asyncio.Event, set_at_once: bool = False) -> web.StreamResponse:
    """SSE, the last event held until `gate` is set."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream", "x-engine": "decode"})
    await response.prepare(seen.request)
    for event in SSE[:-1]:
        await response.write(event)
    if not set_at_once:
        await gate.wait()
    await response.write(SSE[-1])
    await response.write_eof()
    return response


async def listener_closed(port: int) -> None:
    """Return once nothing accepts connections on `port` any more."""
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return
        writer.close()
        await asyncio.sleep(0.01)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def url(port: int, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{port}{path}"


@pytest.mark.parametrize("connector", ["nixlv2", "shared-storage"])
async def test_each_leg_carries_its_protocols_body_and_only_end_to_end_headers(
        session: aiohttp.ClientSession, connector: str) -> None:
    metrics_port = free_port()
    async with Recorder(prefill_ok) as prefill, Recorder(decode_streams) as decode, \
            sidecar(decode_url=decode.url, kv_connector=connector, metrics_port=metrics_port) as s:
        headers = {**HEADERS, "x-prefiller-host-port": prefill.host_port}
        async with session.post(url(s.port, "/v1/completions?q=1"), data=RAW, headers=headers) as resp:
            assert resp.status == 200
            assert resp.headers["x-engine"] == "decode" and resp.content_type == "text/event-stream"
            assert await resp.read() == b"".join(SSE)  # the decode's answer, byte for byte
        [p], [d] = prefill.seen, decode.seen
        client = orjson.loads(RAW)
        expected = {"prompt": "p", "model": "m", "max_tokens": 1, "stream": False}
        if connector == "nixlv2":
            expected["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None}
            assert d.json() == {**client, "kv_transfer_params": PARAMS}
        else:
            assert d.body == RAW
        assert p.json() == expected
        request_id = p.header("x-request-id")
        for leg in (p, d):
            assert (leg.method, leg.path) == ("POST", "/v1/completions?q=1")
            assert leg.header("x-prefiller-host-port") == leg.header("x-hop") == leg.header("te") == []
            assert leg.header("x-end") == ["2"] and leg.header("authorization") == ["Bearer t"]
            assert leg.header("content-type") == ["application/json"]
            assert len(request_id) == 1 and leg.header("x-request-id") == request_id  # one id, both engines
        async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as m:
            families = {f.name: f for f in text_string_to_metric_families(await m.text())}
        [ok] = [x for x in families["prefix_epp_sidecar_requests"].samples if x.name.endswith("_total")]
        assert (ok.labels, ok.value) == ({"mode": "disaggregated", "outcome": "ok"}, 1.0)
        counts = {x.labels["outcome"]: x.value for x in families["prefix_epp_sidecar_prefill_duration_seconds"].samples
                  if x.name.endswith("_count")}
        assert counts == {"ok": 1.0}


async def test_without_the_header_the_request_is_forwarded_as_it_came(session: aiohttp.ClientSession) -> None:
    async with Recorder() as decode, sidecar(decode_url=decode.url) as s:
        sent = URL(url(s.port, "/v1/completions?a=%2F"), encoded=True)  # the query exactly as written
        async with session.post(sent, data=RAW, headers=HEADERS) as resp:
            assert resp.status == 200 and await resp.json() == {"ok": True}
        async with session.get(URL(url(s.port, "/metrics?name[]=vllm:x"), encoded=True)) as resp:
            assert resp.status == 200
        # On a path that has no prefill the header is dropped and the engine serves the request alone.
        async with session.post(url(s.port, "/v1/embeddings"), data=b"{}",
                                headers={"x-prefiller-host-port": "10.0.0.7:8000"}) as resp:
            assert resp.status == 200
        first, scrape, embeddings = decode.seen
        assert (first.path, first.body) == ("/v1/completions?a=%2F", RAW)
        assert first.header("x-end") == ["2"] and first.header("x-hop") == first.header("te") == []
        assert first.header("content-length") == [str(len(RAW))]
        assert (scrape.method, scrape.path) == ("GET", "/metrics?name[]=vllm:x")
        assert embeddings.path == "/v1/embeddings" and embeddings.header("x-prefiller-host-port") == []


async def test_a_prefills_error_is_the_clients_answer_and_no_decode_runs(session: aiohttp.ClientSession) -> None:
    error = {"error": {"message": "too many", "type": "TooManyRequests", "param": None, "code": 429}}

    async def busy(seen: Seen) -> web.Response:
        return await json_answer(seen, 429, error)

    async with Recorder(busy) as prefill, Recorder() as decode, sidecar(decode_url=decode.url) as s:
        async with session.post(url(s.port), data=RAW, headers={"x-prefiller-host-port": prefill.host_port}) as resp:
            assert resp.status == 429 and await resp.json() == error
        assert len(prefill.seen) == 1 and decode.seen == []


@pytest.mark.parametrize("value", ["prefill-0:8000", "10.0.0.7", "10.0.0.7:8000,10.0.0.8:8000", "[::1"])
async def test_a_malformed_prefill_header_is_refused(session: aiohttp.ClientSession, value: str) -> None:
    async with Recorder() as decode, sidecar(decode_url=decode.url) as s:
        async with session.post(url(s.port), data=RAW, headers={"x-prefiller-host-port": value}) as resp:
            assert resp.status == 400
            assert "x-prefiller-host-port" in (await resp.json())["error"]["message"]
        assert decode.seen == []


async def test_an_unreachable_or_slow_prefill_is_a_gateway_error(session: aiohttp.ClientSession) -> None:
    release = asyncio.Event()

    async def stalls(seen: Seen) -> web.Response:
        await release.wait()
        return await json_answer(seen)

    async with Recorder(stalls) as slow, Recorder() as decode, \
            sidecar(decode_url=decode.url, prefill_timeout_s=0.3) as s:
        try:
            nobody = f"127.0.0.1:{free_port()}"
            async with session.post(url(s.port), data=RAW, headers={"x-prefiller-host-port": nobody}) as resp:
                body = await resp.json()
                assert resp.status == 502 and body["error"]["code"] == 502 and nobody in body["error"]["message"]
            async with session.post(url(s.port), data=RAW, headers={"x-prefiller-host-port": slow.host_port}) as resp:
                assert resp.status == 504 and (await resp.json())["error"]["type"] == "GatewayTimeoutError"
            assert decode.seen == []
        finally:
            release.set()


async def test_tls_from_the_client_and_to_a_prefill_the_ca_vouches_for(
        session: aiohttp.ClientSession, tmp_path: Path) -> None:
    ca, other = Authority.create(tmp_path / "ca"), Authority.create(tmp_path / "other", "other")
    served = ca.issue(tmp_path, "sidecar", ips=("127.0.0.1",))
    trusted, stranger = server_context(ca.issue(tmp_path, "engine", ips=("127.0.0.1",))), \
        server_context(other.issue(tmp_path, "stranger", ips=("127.0.0.1",)))
    client = ssl.create_default_context(cafile=ca.ca_file)
    async with Recorder(prefill_ok, tls=trusted) as prefill, Recorder(prefill_ok, tls=stranger) as unknown, \
            Recorder(decode_streams) as decode, \
            sidecar(decode_url=decode.url, enable_tls=("prefiller",), ca_file=str(ca.ca_file),
                    secure_serving=True, cert_path=str(served)) as s:
        https = f"https://127.0.0.1:{s.port}/v1/completions"
        async with session.post(https, data=RAW, headers={"x-prefiller-host-port": prefill.host_port},
                                ssl=client) as resp:
            assert resp.status == 200 and await resp.read() == b"".join(SSE)
        async with session.post(https, data=RAW, headers={"x-prefiller-host-port": unknown.host_port},
                                ssl=client) as resp:
            assert resp.status == 502 and unknown.host_port in (await resp.json())["error"]["message"]
        assert (len(prefill.seen), unknown.seen, len(decode.seen)) == (1, [], 1)


def server_context(directory: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(directory / "tls.crt", directory / "tls.key")
    return ctx


async def test_bodies_are_bounded(session: aiohttp.ClientSession) -> None:
    big = b'{"prompt": "' + b"x" * 400 + b'"}'

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"x" * 100

    async with Recorder(prefill_ok) as prefill, Recorder() as decode, \
            sidecar(decode_url=decode.url, max_request_body_bytes=300) as s:
        for headers, data in (({"x-prefiller-host-port": prefill.host_port}, big), ({}, big), ({}, chunked())):
            async with session.post(url(s.port), data=data, headers=headers) as resp:
                assert resp.status == 413 and (await resp.json())["error"]["code"] == 413
        assert prefill.seen == [] and decode.seen == []


async def test_a_graceful_stop_finishes_the_answers_in_flight_and_takes_no_new_ones(
        session: aiohttp.ClientSession) -> None:
    gate = asyncio.Event()

    async def held(seen: Seen) -> web.StreamResponse:
        return await stream(seen, gate)

    async with Recorder(held) as decode, sidecar(decode_url=decode.url, shutdown_grace_s=30.0) as s:
        async with session.post(url(s.port), data=RAW, headers=HEADERS) as resp:
            assert await resp.content.readuntil(b"\n\n") == SSE[0]
            stopping = asyncio.create_task(s.stop())
            await asyncio.wait_for(listener_closed(s.port), 10)
            assert not stopping.done()
            gate.set()
            assert SSE[0] + await resp.read() == b"".join(SSE)  # the whole answer, after the stop began
        await asyncio.wait_for(stopping, 10)
