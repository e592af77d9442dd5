"""One ext_proc call, read and written so that its end leaves no native memory behind.

The servicer reads with `context.read()` and writes with `context.write()` (`Call`), not through
gRPC's request iterator and an async-generator handler: that iterator is an async generator whose
frame keeps the last message until the next one arrives (a request's body message would stay
referenced for as long as its response streams), and grpc.aio's writes for a generator handler
cannot be shielded (below).

grpc.aio keeps a batch's native operations for good (~100 bytes) when the batch fails or the task
awaiting it is cancelled (grpc/grpc#43360). A proxy that resets finished streams (Envoy without
its graceful ext_proc close: a half-close, then RST_STREAM at once) hits both at every stream's
end: grpc.aio cancels the handler as soon as it reads the reset, most often before the handler
has resumed from the read that got the half-close, sometimes before the write of its last reply
completed, and a handler that returns at the half-close makes grpc.aio send a status on the
reset call (a failed batch). So:

- Once the request has ended (a message that ends its headers, body or trailers, or any response
  message) or the handler refuses it (an immediate response), reads and writes are shielded
  (`asyncio.shield`): a cancellation stops the wait, not the batch, which completes and frees its
  operations. Before that they are plain: only a client going away mid-upload resets them, and a
  shield costs a task.
- At the half-close, once the handler has accounted the response's end, it sleeps up to
  `EOF_WAIT_S` (`Call.finish`, `EndWait`): the reset cancels the sleep when it arrives (the stream
  counts as reset, no status is sent). A shielded batch that fails after the cancellation has its
  error retrieved (`_consume`): asyncio would log it as never retrieved. Through Envoy on a loaded
  2-core machine resets came within a few milliseconds of the half-close, the slowest well under
  `EOF_WAIT_S`; a fixed three event-loop turns had let some through under load.
- A handler that stopped before the half-close (an immediate response) reads on to it first
  (`Call.finish`, at most `FINISH_S` in all), so it ends the same way.
- A read that waits for the request body under its deadline (`--request-body-timeout`,
  extproc/transport/body_intake.py) runs in a task of its own (`Call.next_before`): the deadline
  stops the wait, not the read, and the next read (`finish`, reading on to the half-close after
  the 408) takes over the read still in flight, so a stalled body's stream ends as any refused one.
  Cancelling the read at the deadline left its operations behind, one batch per timed-out stream.

A proxy that closes gracefully sends nothing after its half-close and waits for the picker's
status: there the sleep would only hold every stream open for `EOF_WAIT_S`, and the shields and
the reading on would cost CPU for nothing. So `EndWait` learns which kind of proxy it serves, from
the ends it waited for: an average of whether the reset came within the wait (each end weighs
1/16; it starts at 1, the generated config resets). While that average is below one half
(`expects_resets` false) reads and writes are plain, a refused stream is closed at once, and the
half-close ends the stream at once, except every `PROBE_EVERY`-th, which still waits, so a proxy
that starts resetting (a new config, another Envoy) is found again.
One average serves the whole process: a picker behind proxies of both kinds follows the majority
of the ends it probes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from typing import Any

import grpc

from extproc.pb import external_processor_pb2 as pb

# Longest wait for a reset after the half-close (docstring): a loop lag of this much is an overloaded picker.
EOF_WAIT_S = 0.05
# Weight of one end in the average of whether resets follow (an exponential moving average).
_END_WEIGHT = 1.0 / 16
# While no resets are expected, one end in this many still waits: the probe.
PROBE_EVERY = 64
# Longest wait for the proxy's half-close after the handler stopped early (an immediate response).
FINISH_S = 5.0
# Response messages: reading one means the request has ended.
_RESPONSE_KINDS = frozenset({"response_headers", "response_body", "response_trailers"})


class EndWait:
    """Whether and how long the half-close waits for a reset (module docstring)."""

    __slots__ = ("_since_probe", "resets")

    def __init__(self) -> None:
        self.resets = 1.0  # moving average of "the reset came within the wait", over the ends waited for
        self._since_probe = 0

    def seconds(self) -> float:
        """The wait for the next end: EOF_WAIT_S while resets are expected or a probe is due, else 0."""
        if self.expects_resets:
            return EOF_WAIT_S
        self._since_probe += 1
        if self._since_probe < PROBE_EVERY:
            return 0.0
        self._since_probe = 0
        return EOF_WAIT_S

    @property
    def expects_resets(self) -> bool:
        return self.resets >= 0.5

    def observe(self, reset: bool) -> None:
        self.resets += ((1.0 if reset else 0.0) - self.resets) * _END_WEIGHT

    async def after_end(self) -> None:
        """Sleep for the next end's wait; a reset arriving meanwhile cancels it (CancelledError)."""
        wait = self.seconds()
        if not wait:
            return
        try:
            await asyncio.sleep(wait)
        except asyncio.CancelledError:
            self.observe(True)
            raise
        self.observe(False)


def ends_request(msg: pb.ProcessingRequest) -> bool:
    """Whether `msg` is the request's last message, or comes after it (a response message)."""
    kind = msg.WhichOneof("request")
    if kind == "request_headers":
        return bool(msg.request_headers.end_of_stream)
    if kind == "request_body":
        return bool(msg.request_body.end_of_stream)
    return kind == "request_trailers" or kind in _RESPONSE_KINDS


class Call:
    """The call's messages, one `context.read()` each (nothing is kept once a message is returned),
    and its replies, one `context.write()` each."""

    __slots__ = ("_context", "_end", "_eof", "_guarded", "_pending")

    def __init__(self, context: grpc.aio.ServicerContext, end: EndWait) -> None:
        self._context = context
        self._end = end
        self._guarded = False  # the request has ended (or is refused): reads and writes are shielded
        self._eof = False
        self._pending: asyncio.Future[Any] | None = None  # a read a deadline left running (next_before)

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> pb.ProcessingRequest:
        pending = self._pending
        if pending is not None:  # the read a deadline left running: its message is the next one
            self._pending = None
            return self._received(await asyncio.shield(pending))
        return self._received(await self._read())

    async def next_before(self, deadline: float) -> pb.ProcessingRequest | None:
        """The next message, or None when `deadline` (event-loop time) passes first; StopAsyncIteration
        at the half-close, as `__anext__`. The read runs in a task that the deadline does not cancel
        (module docstring): the next read takes it over. The wait is one future and one timer:
        asyncio.timeout_at around asyncio.shield cost twice the CPU that this adds to a body read."""
        pending = self._pending
        if pending is None:
            pending = self._pending = _running(self._context.read())
        if not pending.done():
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            wake = functools.partial(_wake, waiter)
            timer = loop.call_at(deadline, wake, None)
            pending.add_done_callback(wake)
            try:
                await waiter  # a reset cancels this wait, not the read
            finally:
                timer.cancel()
                pending.remove_done_callback(wake)
            if not pending.done():
                return None  # the deadline passed first
        self._pending = None
        return self._received(pending.result())

    def _received(self, msg: Any) -> pb.ProcessingRequest:
        if msg is grpc.aio.EOF:
            self._eof = True  # `finish` waits for a reset, once the handler has accounted the end
            raise StopAsyncIteration
        if not self._guarded:
            self._guarded = ends_request(msg)
        return msg  # type: ignore[no-any-return]

    def _read(self) -> Any:
        return self._batch(self._context.read())

    async def write(self, reply: pb.ProcessingResponse) -> None:
        if not self._guarded and reply.HasField("immediate_response"):
            self._guarded = True  # the proxy ends the stream on it, as after the request's end
        await self._batch(self._context.write(reply))

    def _batch(self, batch: Coroutine[Any, Any, Any]) -> Any:
        """`batch` shielded from a reset once the request has ended and this proxy resets streams."""
        return _shielded(batch) if self._guarded and self._end.expects_resets else batch

    async def finish(self) -> int:
        """The end, once the handler is done with the requests: read on to the half-close if the
        handler stopped before it and the proxy resets streams, then wait for the reset after it.
        Returns the messages dropped meanwhile (a proxy sends none after an immediate response)."""
        dropped = 0
        try:
            async with asyncio.timeout(FINISH_S):
                if not self._eof and self._end.expects_resets:
                    self._guarded = True
                    async for _ in self:
                        dropped += 1
                if self._eof:
                    await self._end.after_end()  # a reset that follows the half-close cancels us here
        except TimeoutError:
            pass  # the proxy kept the stream open: the handler ends it with a status
        return dropped


def _running(batch: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    """`batch` in a task of its own, which runs to its end whoever stops waiting for it; a failure
    after the handler is gone (a reset) is retrieved (`_consume`)."""
    task = asyncio.ensure_future(batch)
    task.add_done_callback(_consume)
    return task


def _shielded(batch: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    """`batch` run to its end even if the awaiting task is cancelled (module docstring)."""
    return asyncio.shield(_running(batch))


def _wake(waiter: asyncio.Future[None], _: object) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _consume(task: asyncio.Future[Any]) -> None:
    # A batch that failed after the handler was cancelled (the call was reset): nobody awaits it
    # any more, and asyncio.shield drops its own callback then; retrieved so asyncio does not log it.
    if not task.cancelled():
        task.exception()
