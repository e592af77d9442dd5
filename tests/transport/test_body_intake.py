"""Request-body intake against a client who tries harder (extproc/transport/body_intake.py):
declared lengths reserve nothing, a body has a deadline, and an open stream holds nothing of its
body once the request is routed. Through the real gRPC server where the transport matters."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import AsyncIterator, Sequence

import grpc
import orjson
import pytest

from extproc.pb import external_processor_pb2 as pb
from extproc.request.openai import ParsedRequest
from extproc.transport.body_budget import BodyBudget
from extproc.transport.body_intake import BodyIntake
from extproc.transport.processor import StreamProcessor
from testkit.extproc_grpc import open_stream, serving, wait_until
from testkit.extproc_stream import (
    BUFFERED,
    DUPLEX,
    body_msgs,
    completion,
    destination,
    drive,
    error_body,
    headers_msg,
    make_app,
)

MiB = 1 << 20


def with_length(msg: pb.ProcessingRequest, n: int) -> pb.ProcessingRequest:
    h = msg.request_headers.headers.headers.add()
    h.key, h.raw_value = "content-length", str(n).encode()
    return msg


def trailers(response: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    (msg.response_trailers if response else msg.request_trailers).SetInParent()
    return msg


def body_msg(chunk: bytes, eos: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_body.body = chunk
    msg.request_body.end_of_stream = eos
    return msg


# -- BodyIntake itself ---------------------------------------------------------------------------
async def test_intake_charges_chunks_refuses_declared_lengths_and_waits_until_its_deadline() -> None:
    budget = BodyBudget(100)
    other = BodyIntake(budget, 80, 10.0)
    assert other.add(b"x" * 30) is None and budget.used == 30
    intake = BodyIntake(budget, 80, 0.05)
    err = intake.admit_declared(81)
    assert err is not None and err.http_status == 413
    err = intake.admit_declared(71)  # 30 of 100 are taken
    assert err is not None and err.http_status == 429 and err.retry_after_s == 1
    assert intake.admit_declared(70) is None and budget.used == 30  # admitted, nothing reserved
    assert intake.add(b"y" * 40) is None and budget.used == 70 and intake.held == 40
    assert intake.peek(b"z") == b"y" * 40 + b"z"
    err = intake.add(b"y" * 31)
    assert err is not None and err.http_status == 429
    intake.release()
    assert budget.used == 30 and intake.done and intake.deadline is None

    async def silent() -> AsyncIterator[int]:
        await asyncio.Event().wait()
        yield 1

    async def two() -> AsyncIterator[int]:
        yield 1
        yield 2

    fresh = BodyIntake(budget, 80, 0.05)
    assert fresh.deadline is None
    fresh.start()
    assert fresh.deadline is not None
    assert await fresh.next_message(silent()) is None  # the deadline passed first
    err = fresh.timed_out()
    assert err.http_status == 408 and err.message == "the request body did not arrive within 0.05 s"
    fresh.take()  # body complete: no deadline any more
    stream = two()
    assert fresh.deadline is None and await fresh.next_message(stream) == 1
    assert await fresh.next_message(stream) == 2
    with pytest.raises(StopAsyncIteration):
        await fresh.next_message(stream)


# -- budget: what is received, never what is declared ----------------------------------------------
async def test_silent_streams_declaring_the_largest_body_hold_no_budget() -> None:
    """The attack: streams declare the largest allowed content-length and send nothing. With the
    declared length reserved, eight of them took the whole 512 MiB and a 31-byte request got 429."""
    app = make_app()
    cfg = app.config
    async with serving(app) as served:
        silent = []
        for _ in range(cfg.max_buffered_bytes // cfg.max_request_body_bytes + 2):
            call = open_stream(served)
            await call.write(with_length(headers_msg(body_mode=BUFFERED), cfg.max_request_body_bytes))
            reply = await call.read()
            assert reply.WhichOneof("response") == "request_headers"  # admitted, then silent
            silent.append(call)
        assert app.body_budget.used == 0
        small = b'{"model":"m","prompt":"hello"}'
        call = open_stream(served)
        await call.write(with_length(headers_msg(body_mode=BUFFERED), len(small)))
        await call.write(body_msg(small, eos=True))
        assert (await call.read()).WhichOneof("response") == "request_headers"
        destination(await call.read())  # routed
        await call.done_writing()
        for c in silent:
            c.cancel()
        await wait_until(lambda: app.streams.open == 0)
    assert app.body_budget.used == 0


async def test_received_bytes_are_charged_and_a_declared_length_larger_than_the_free_budget_is_429() -> None:
    app = make_app(max_request_body_bytes=100_000, max_buffered_bytes=150_000)
    body = completion("y" * 90_000)
    async with serving(app) as served:
        holder = open_stream(served)
        await holder.write(headers_msg())
        await holder.write(body_msg(body[:80_000], eos=False))
        await wait_until(lambda: app.body_budget.used == 80_000)  # what arrived, not what was declared
        late = open_stream(served)
        await late.write(with_length(headers_msg(), len(body)))  # cannot fit now: refused, nothing reserved
        imm = (await late.read()).immediate_response
        assert imm.status.code == 429 and error_body(imm)["type"] == "RateLimitError"
        assert {o.header.key: o.header.raw_value for o in imm.headers.set_headers}["retry-after"] == b"1"
        assert app.body_budget.used == 80_000
        await holder.write(body_msg(body[80_000:], eos=True))
        assert destination(await holder.read())
        await holder.done_writing()
        await wait_until(lambda: app.body_budget.used == 0)
    ok = await drive(app, [with_length(headers_msg(), len(body)), *body_msgs(body)])
    assert ok[0].WhichOneof("response") == "request_headers"


# -- deadline: a body that does not come ----------------------------------------------------------
@pytest.mark.parametrize("mode", [BUFFERED, DUPLEX], ids=["buffered", "full-duplex"])
async def test_a_stalled_body_gets_408_and_releases_everything(mode: int) -> None:
    """The attack: headers and part of a body, then nothing. Without a deadline the stream held
    its budget and its in-flight slot for as long as the client liked."""
    app = make_app(request_body_timeout_s=0.3)
    async with serving(app) as served:
        call = open_stream(served)
        await call.write(headers_msg(body_mode=mode))
        if mode == BUFFERED:
            assert (await call.read()).WhichOneof("response") == "request_headers"
        else:
            await call.write(body_msg(b'{"model": "m", "prompt": "stalled', eos=False))
            await wait_until(lambda: app.body_budget.used > 0)
        reply = await call.read()
        imm = reply.immediate_response
        assert imm.status.code == 408
        err = error_body(imm)
        assert err["type"] == "RequestTimeoutError" and err["message"] == "the request body did not arrive within 0.3 s"
        assert await call.read() is grpc.aio.EOF  # the picker ended the stream
        assert await call.code() == grpc.StatusCode.OK
        await wait_until(lambda: app.streams.open == 0)
        assert app.body_budget.used == 0
        assert all(ep.inflight == 0 for ep in app.datastore.snapshot())
    samples = app.metrics.registry.get_sample_value("prefix_epp_requests_total", {"outcome": "error", "status": "408"})
    assert samples == 1


async def test_a_trickled_body_gets_408_at_the_deadline_from_the_headers() -> None:
    """The attack: a byte at a time, each in time for any per-message timeout; the deadline runs
    from the headers, so it ends the body all the same."""
    app = make_app(request_body_timeout_s=0.3)
    sent = 0

    async def trickle() -> AsyncIterator[pb.ProcessingRequest]:
        nonlocal sent
        yield headers_msg()
        for _ in range(10_000):  # 500 s at this pace
            await asyncio.sleep(0.05)  # the slow client being simulated, not a wait for a condition
            sent += 1
            yield body_msg(b" ", eos=False)

    out = [r async for r in StreamProcessor(app.director, app.metrics, False, app.body_budget).run(trickle())]
    assert len(out) == 1 and out[0].immediate_response.status.code == 408
    assert sent < 100
    assert app.body_budget.used == 0


async def test_no_deadline_once_the_body_is_complete() -> None:
    """The deadline bounds the body only: a long response after it keeps its stream."""
    app = make_app(request_body_timeout_s=0.2)
    async with serving(app) as served:
        call = open_stream(served)
        await call.write(headers_msg(body_mode=BUFFERED))
        await call.write(body_msgs(completion())[0])
        assert (await call.read()).WhichOneof("response") == "request_headers"
        destination(await call.read())
        routed_at = asyncio.get_running_loop().time()
        await wait_until(lambda: asyncio.get_running_loop().time() > routed_at + 0.4)  # twice the deadline
        await call.write(trailers(response=True))
        assert (await call.read()).WhichOneof("response") == "response_trailers"
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF


# -- memory: what an open stream still holds after the decision ------------------------------------
def many_part_chat(size: int) -> bytes:
    """A chat body of about `size` bytes made of many small content parts (a large parsed tree)."""
    part = {"type": "text", "text": "lorem ipsum dolor sit amet " * 3}
    n = size // len(orjson.dumps(part))
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [part] * n}]})


class Feed:
    """Hands out `first` one message at a time, keeping none, then waits (`waiting` set) until
    `release` before handing out `then`: the stream is open and idle in between."""

    def __init__(self, first: Sequence[pb.ProcessingRequest], then: Sequence[pb.ProcessingRequest]) -> None:
        self._first = list(reversed(first))
        self._then = list(reversed(then))
        self.waiting = asyncio.Event()
        self.release = asyncio.Event()

    def __aiter__(self) -> Feed:
        return self

    async def __anext__(self) -> pb.ProcessingRequest:
        if self._first:
            return self._first.pop()
        self.waiting.set()
        await self.release.wait()
        if self._then:
            return self._then.pop()
        raise StopAsyncIteration


def large_live_messages() -> list[str]:
    """Live protobuf messages over 1 MiB, and parsed bodies (upb memory is not traced by tracemalloc)."""
    gc.collect()
    out = []
    messages = (pb.ProcessingRequest, pb.ProcessingResponse, pb.HttpBody)
    for o in gc.get_objects():
        # type(), not isinstance(): isinstance reads `__class__`, and a lazy module proxy (the
        # openai package's, once imported by another test) imports modules when asked, which
        # tracemalloc would count as held by the stream.
        kind = type(o)
        if kind is ParsedRequest:
            out.append("ParsedRequest")
        elif kind in messages and o.ByteSize() > MiB:
            out.append(kind.__name__)
    return out


@pytest.mark.parametrize("mode", [BUFFERED, DUPLEX], ids=["buffered", "full-duplex"])
async def test_an_open_stream_holds_nothing_of_its_body_after_the_decision(mode: int) -> None:
    """The attack: long generations with large many-part bodies. The parsed tree, the body's
    message and the echoed chunks stayed referenced until the response ended, after the budget
    was released: a 7 MiB body kept ~85 MiB, a few dozen such streams the pod's memory."""
    app = make_app()
    await drive(app, [headers_msg(body_mode=mode), *body_msgs(completion())])  # lazy state, once
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        body = many_part_chat(8 * MiB)
        size = len(body)
        chunk = size if mode == BUFFERED else MiB  # BUFFERED: one message, as Envoy sends it
        feed = Feed([headers_msg("/v1/chat/completions", body_mode=mode), *body_msgs(body, chunk=chunk)],
                    [trailers(response=True)])
        del body
        kinds: list[str | None] = []

        async def consume() -> None:
            async for resp in StreamProcessor(app.director, app.metrics, False, app.body_budget).run(feed):
                kinds.append(resp.WhichOneof("response"))
                if resp.HasField("immediate_response"):
                    kinds.append(resp.immediate_response.body.decode())

        task = asyncio.create_task(consume())
        await feed.waiting.wait()  # routed, everything answered; the response is "streaming"
        assert "request_headers" in kinds and "immediate_response" not in kinds, kinds[:3]
        live = large_live_messages()
        held = tracemalloc.get_traced_memory()[0] - base
        assert held < MiB and live == [], f"{held} bytes and {live} still held for a {size}-byte body"
        assert app.body_budget.used == 0
        feed.release.set()
        await task
    finally:
        tracemalloc.stop()
    assert kinds[-1] == "response_trailers"
    assert all(ep.inflight == 0 for ep in app.datastore.snapshot())


async def test_the_grpc_servicer_keeps_no_message_of_an_open_stream() -> None:
    """Through the real gRPC server: gRPC's own request iterator kept the last message (the body)
    referenced until the next one came, i.e. until the response ended."""
    app = make_app()
    async with serving(app) as served:
        call = open_stream(served)
        await call.write(headers_msg("/v1/chat/completions", body_mode=BUFFERED))
        await call.write(body_msgs(many_part_chat(8 * MiB), chunk=64 * MiB)[0])
        assert (await call.read()).WhichOneof("response") == "request_headers"
        destination(await call.read())
        assert large_live_messages() == []
        await call.write(trailers(response=True))
        assert (await call.read()).WhichOneof("response") == "response_trailers"
        await call.done_writing()
        await wait_until(lambda: app.streams.open == 0)
    assert all(ep.inflight == 0 for ep in app.datastore.snapshot())
