"""Request-body intake: what one ext_proc stream may hold of a request body, and for how long.

The picker routes on the prompt, so it holds each request body until the body is complete.
One `BodyIntake` per stream keeps that hold bounded three ways:

- Bytes: every chunk is charged to the process-wide `BodyBudget` (extproc/transport/body_budget.py,
  `--max-buffered-bytes`) as it arrives; a body grows past `--max-request-body-bytes` -> 413, past
  what the budget has left -> 429 with Retry-After. Only bytes received are charged, never the
  declared `content-length`: a client that declares 64 MiB and sends nothing holds nothing. A
  declared length is only a reason to refuse early, at the headers, without reserving anything:
  above the per-request limit -> 413; above what the budget has free right now -> 429 (it could
  not be buffered now; a retry may fit). An admitted body can therefore still get 429 half-way
  when other streams fill the budget meanwhile.
- Time: `--request-body-timeout` (default 30 s) from the request headers to the body's end
  (`end_of_stream`, or the request trailers). Past it the stream ends with 408 and everything it
  held is released, so a client that trickles or stalls its body cannot keep budget, memory or an
  ext_proc stream for longer. `deadline` is the event-loop time by which the next message must
  come (None: nothing is awaited, no deadline runs).
- Lifetime: `take()` hands the chunks over for the decision and the echo and forgets them;
  `release()` (decision made, error, stream end) returns the budget and drops everything.

Everything runs on the event loop; nothing here blocks or locks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from extproc.core.errors import EppError, ErrorCode
from extproc.transport.body_budget import RETRY_AFTER_S, BodyBudget, Reservation

T = TypeVar("T")


def _too_large(limit: int) -> EppError:
    return EppError(ErrorCode.PAYLOAD_TOO_LARGE, f"request body exceeds {limit} bytes")


def _budget_full() -> EppError:
    return EppError(ErrorCode.RESOURCE_EXHAUSTED,
                    "the endpoint picker is buffering too many request bytes; retry later",
                    retry_after_s=RETRY_AFTER_S)


class BodyIntake:
    __slots__ = ("_budget", "_chunks", "_limit", "_reservation", "_timeout_s", "deadline", "done", "received")

    def __init__(self, budget: BodyBudget | None, max_body_bytes: int, timeout_s: float) -> None:
        self._budget = budget
        self._reservation = Reservation(budget)
        self._limit = max_body_bytes
        self._timeout_s = timeout_s
        self._chunks: list[bytes] = []
        self.received = 0
        self.done = False  # no (more) body is wanted: complete, refused, or the request had none
        self.deadline: float | None = None

    def start(self) -> None:
        """The request headers came and a body follows: its deadline runs from now (event-loop time)."""
        if not self.done:
            self.deadline = asyncio.get_running_loop().time() + self._timeout_s

    async def next_message(self, stream: AsyncIterator[T]) -> T | None:
        """The stream's next message, waited for until the deadline at most; None: it passed first.

        A stream with `next_before(deadline)` waits itself (extproc/transport/call.py's `Call`: a
        gRPC read cancelled at the deadline would leave its native operations behind); any other
        stream's wait is cancelled at the deadline (a timer, no extra task). StopAsyncIteration
        passes through.
        """
        deadline = self.deadline
        if deadline is None:
            return await anext(stream)
        before = getattr(stream, "next_before", None)
        if before is not None:
            msg: T | None = await before(deadline)
            return msg
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout:
                return await anext(stream)
        except TimeoutError:
            if timeout.expired():
                return None
            raise

    def timed_out(self) -> EppError:
        return EppError(ErrorCode.REQUEST_TIMEOUT, f"the request body did not arrive within {self._timeout_s:g} s")

    def admit_declared(self, declared: int) -> EppError | None:
        """A declared content-length that can never be, or cannot now be, buffered; nothing is reserved."""
        if declared > self._limit:
            return _too_large(self._limit)
        budget = self._budget
        if budget is not None and declared > budget.limit - budget.used:
            return _budget_full()
        return None

    def add(self, chunk: bytes) -> EppError | None:
        """Buffer one received chunk, charging it to the budget; an error: nothing more is held."""
        if not chunk:
            return None
        self.received += len(chunk)
        if self.received > self._limit:
            return _too_large(self._limit)
        if not self._reservation.grow_to(self.received):
            return _budget_full()
        self._chunks.append(chunk)
        return None

    def reserve_last(self, size: int) -> EppError | None:
        """Charge the budget for a last chunk of `size` bytes not added yet (it waits in its message
        while flow control holds the request; `add` later finds it paid); refused as `add` would."""
        if self.received + size > self._limit:
            return _too_large(self._limit)
        if not self._reservation.grow_to(self.received + size):
            return _budget_full()
        return None

    def fits(self, last: bytes) -> bool:
        """Whether the body with `last` appended stays within the per-request limit."""
        return self.received + len(last) <= self._limit

    def peek(self, last: bytes) -> bytes:
        """The whole body so far with `last` appended, as one bytes object (a copy when it has parts)."""
        chunks = [*self._chunks, last] if last else self._chunks
        if not chunks:
            return b""
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def take(self) -> list[bytes]:
        """The received chunks, handed over: the intake keeps no reference (the budget stays charged)."""
        self.done = True
        self.deadline = None
        chunks, self._chunks = self._chunks, []
        return chunks

    def release(self) -> None:
        """Nothing more of the body is held: the budget is returned, the chunks dropped, no deadline."""
        self.done = True
        self.deadline = None
        self._chunks = []
        self._reservation.release()

    @property
    def held(self) -> int:
        """Bytes this stream has charged to the budget now."""
        return self._reservation.held
