"""Graceful drain: on SIGTERM, stop being chosen, finish every open stream, then exit.

Sequence (driven by extproc/commands/serve.py, steps in `App.drain`):
1. readiness and the ext_proc gRPC health service turn NOT_SERVING at once, so Envoy's active
   health checks and the kubelet stop sending new streams;
2. the ext_proc server keeps accepting streams meanwhile (those already on their way are served)
   and every open stream, including long streamed generations, runs to its end: Envoy keeps the
   ext_proc stream open until the upstream response ends, so an open stream is a live request;
3. the drain ends once no stream has been open for `idle_s` (1 s: a gap between two requests does
   not end it), or at `timeout_s` (`--drain-timeout`, 30 s, the chart's
   terminationGracePeriodSeconds), whichever comes first. A second SIGTERM/SIGINT ends it at once.

`StreamTracker` counts open streams; the gRPC servicer opens and closes them, nothing else.
"""

from __future__ import annotations

import asyncio
import time


class StreamTracker:
    def __init__(self) -> None:
        self.open = 0
        self.total = 0
        self.last_closed = time.monotonic()

    def opened(self) -> None:
        self.open += 1
        self.total += 1

    def closed(self) -> None:
        self.open -= 1
        self.last_closed = time.monotonic()

    async def drained(self, idle_s: float, timeout_s: float, interrupt: asyncio.Event | None = None) -> bool:
        """Wait until no stream has been open for `idle_s`; False when `timeout_s` or `interrupt` came first."""
        start = time.monotonic()
        deadline = start + timeout_s
        self.last_closed = max(self.last_closed, start)
        while True:
            now = time.monotonic()
            if self.open == 0 and now - self.last_closed >= idle_s:
                return True
            if now >= deadline or (interrupt is not None and interrupt.is_set()):
                return False
            await asyncio.sleep(min(0.05, max(0.0, deadline - now)))
