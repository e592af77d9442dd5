"""A process-wide budget for buffered request-body bytes, shared by every ext_proc stream.

The picker holds each request body until it is complete (it routes on the prompt), so memory
grows with concurrent bodies, not with one. `--max-request-body-bytes` bounds one body;
`--max-buffered-bytes` (default 512 MiB: a quarter of the chart's 2 GiB memory limit, leaving
room for the prefix index, the transient copy of a body while it is parsed and gRPC's buffers)
bounds them all together.

A stream's reservation (one `Reservation` each, held by its `BodyIntake`,
extproc/transport/body_intake.py) grows chunk by chunk to the bytes received, never to a declared
`content-length`, so a stream that has sent nothing holds nothing. A chunk that does not fit gets
429 with `Retry-After`; other streams' reservations are untouched. The reservation is returned
when the body has been handed back to Envoy or the stream ends, whichever comes first.

Everything runs on the event loop, so the counter needs no lock.
"""

from __future__ import annotations

RETRY_AFTER_S = 1  # bodies drain in milliseconds to seconds; a short back-off is enough


class BodyBudget:
    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("the buffered-bytes budget must be >= 1")
        self.limit = limit
        self.used = 0

    def try_reserve(self, n: int) -> bool:
        """Reserve n bytes; False (nothing reserved) when they do not fit."""
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)


class Reservation:
    """One stream's share of a `BodyBudget` (none: nothing is counted)."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: BodyBudget | None) -> None:
        self.budget = budget
        self.held = 0

    def grow_to(self, total: int) -> bool:
        """Hold at least `total` bytes. False when the rest does not fit: then nothing is held."""
        budget = self.budget
        if budget is None or total <= self.held:
            return True
        if budget.try_reserve(total - self.held):
            self.held = total
            return True
        self.release()
        return False

    def release(self) -> None:
        if self.held and self.budget is not None:
            self.budget.release(self.held)
        self.held = 0
