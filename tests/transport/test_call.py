"""EndWait: the end of a stream's requests waits for a reset while the proxy sends them, and learns
when it does not (extproc/transport/call.py). Through real Envoy: tests/e2e/test_response_path.py."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest

from extproc.pb import external_processor_pb2 as pb
from extproc.transport.call import EOF_WAIT_S, PROBE_EVERY, Call, EndWait


def test_resets_expected_until_ends_without_them_bring_the_average_below_half() -> None:
    w = EndWait()
    waits = []
    for _ in range(20):
        waits.append(w.seconds())
        if waits[-1]:
            w.observe(False)
    # 1 -> (15/16)^k: below one half after 11 graceful ends; the 12th end no longer waits.
    assert waits[:11] == [EOF_WAIT_S] * 11
    assert waits[11:] == [0.0] * 9


def test_a_graceful_proxy_is_probed_every_probe_every_th_end_and_a_resetting_one_found_again() -> None:
    w = EndWait()
    while w.seconds():
        w.observe(False)
    # The end that found the average below half did not wait; the next PROBE_EVERY - 2 do not.
    seq = [w.seconds() for _ in range(2 * PROBE_EVERY)]
    assert [i for i, s in enumerate(seq) if s] == [PROBE_EVERY - 2, 2 * PROBE_EVERY - 2]
    # The proxy starts resetting: each probe that sees a reset raises the average, until ends wait again.
    probes = 0
    while w.resets < 0.5:
        if w.seconds():
            probes += 1
            w.observe(True)
    assert probes == 1  # (15/16)^11 = 0.49; one reset: 0.49 + 0.51 / 16 = 0.52
    assert w.seconds() == EOF_WAIT_S


async def test_after_end_is_cancelled_by_a_reset_and_counts_it() -> None:
    w = EndWait()
    w.resets = 0.5
    task = asyncio.create_task(w.after_end())
    await asyncio.sleep(0)  # the task is sleeping now
    task.cancel()  # what grpc.aio does when the reset arrives
    with pytest.raises(asyncio.CancelledError):
        await task
    assert w.resets == pytest.approx(0.5 + 0.5 / 16)


async def test_after_end_returns_after_the_wait_when_nothing_follows() -> None:
    w = EndWait()
    loop = asyncio.get_running_loop()
    start = loop.time()
    await w.after_end()
    assert loop.time() - start >= EOF_WAIT_S * 0.9
    assert w.resets == pytest.approx(1 - 1 / 16)


class _Context:
    """The two calls `Call` makes on grpc.aio's servicer context, over futures the test resolves."""

    def __init__(self) -> None:
        self.pending: list[asyncio.Future[object]] = []
        self.completed = 0  # reads and writes that ran to their end

    async def _batch(self) -> object:
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        result = await fut
        self.completed += 1
        return result

    def read(self) -> Coroutine[Any, Any, object]:
        return self._batch()

    def write(self, reply: object) -> Coroutine[Any, Any, object]:
        return self._batch()


def _chunk(data: bytes, last: bool = False) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_body.body = data
    msg.request_body.end_of_stream = last
    return msg


async def _cancel_in_flight(call: Call, ctx: _Context) -> None:
    """A read after the request's end, cancelled while its batch is in flight, as a reset does."""
    first = asyncio.create_task(anext(call))
    await asyncio.sleep(0)
    ctx.pending.pop().set_result(_chunk(b"", last=True))
    assert (await first).request_body.end_of_stream
    reading = asyncio.create_task(anext(call))
    await asyncio.sleep(0)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    batch = ctx.pending.pop()
    if not batch.cancelled():  # cancelled with the handler when unshielded
        batch.set_result(grpc.aio.EOF)  # the batch completes after the handler was cancelled
    await asyncio.sleep(0)


async def test_a_reset_cancels_the_wait_not_the_read_once_the_request_has_ended() -> None:
    ctx = _Context()
    await _cancel_in_flight(Call(ctx, EndWait()), ctx)  # type: ignore[arg-type]
    assert ctx.completed == 2  # the cancelled read still ran to its end (its batch is freed)


async def test_behind_a_graceful_proxy_reads_are_plain_and_a_refused_stream_closes_at_once() -> None:
    end = EndWait()
    end.resets = 0.4  # learned: this proxy does not reset
    ctx = _Context()
    await _cancel_in_flight(Call(ctx, end), ctx)  # type: ignore[arg-type]
    assert ctx.completed == 1  # no shield: the cancelled read stopped where it was
    call = Call(_Context(), end)  # type: ignore[arg-type]
    assert await call.finish() == 0  # nothing read: the handler's status ends the stream


async def test_a_read_past_the_body_deadline_keeps_running_and_the_next_read_takes_it_over() -> None:
    ctx = _Context()
    call = Call(ctx, EndWait())  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    assert await call.next_before(loop.time() + 0.01) is None  # the deadline passed first
    assert len(ctx.pending) == 1 and not ctx.pending[0].done()  # the read was not cancelled
    # Waiting again under a deadline reads through the same batch, not a second one.
    waiting = asyncio.create_task(call.next_before(loop.time() + 5))
    await asyncio.sleep(0)
    assert len(ctx.pending) == 1
    ctx.pending.pop().set_result(_chunk(b"late"))
    msg = await waiting
    assert msg is not None and msg.request_body.body == b"late"
    # Past a deadline again: the handler refuses (408) and reads on to the half-close through it.
    assert await call.next_before(loop.time() + 0.01) is None
    reading = asyncio.create_task(anext(call))
    await asyncio.sleep(0)
    assert len(ctx.pending) == 1  # still the read the deadline left
    ctx.pending.pop().set_result(_chunk(b"", last=True))
    assert (await reading).request_body.end_of_stream
    assert ctx.completed == 2  # two batches, both run to their end


async def test_a_reset_while_waiting_under_the_deadline_cancels_the_wait_not_the_read() -> None:
    ctx = _Context()
    call = Call(ctx, EndWait())  # type: ignore[arg-type]
    waiting = asyncio.create_task(call.next_before(asyncio.get_running_loop().time() + 5))
    await asyncio.sleep(0)
    waiting.cancel()  # the client went away mid-upload: grpc.aio cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await waiting
    batch = ctx.pending.pop()
    assert not batch.cancelled()
    reported: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
    batch.set_exception(RuntimeError("call reset"))  # the batch fails after the handler is gone
    for _ in range(3):
        await asyncio.sleep(0)
    del call, waiting
    gc.collect()  # a task whose error nobody retrieved reports it when it is collected
    assert ctx.completed == 0 and reported == []  # ended by its error, which `_consume` retrieved
