"""Support for the scheduler's unit tests: a clock the test moves by hand, and a one-endpoint pool."""

from __future__ import annotations

from extproc.core.datastore import Datastore, Endpoint, EndpointSpec


class Clock:
    """A monotonic clock (seconds) that moves only when the test sets `now`."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def one_endpoint() -> tuple[Datastore, Endpoint]:
    """A datastore holding one endpoint (10.0.0.1:8000), and that endpoint."""
    ds = Datastore()
    ds.set_endpoints([EndpointSpec("10.0.0.1", 8000)])
    return ds, ds.snapshot()[0]
