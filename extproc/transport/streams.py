"""Graceful drain: on SIGTERM, stop being chosen, stop taking streams, finish the open ones, exit.

Sequence (driven by extproc/commands/serve.py, steps in `App.drain`):
1. readiness and the ext_proc gRPC health service turn NOT_SERVING at once, so Envoy's active
   health checks and the kubelet stop sending new streams (a Service drops the pod);
2. for `readiness_delay_s` (--drain-readiness-delay, 5 s; at most half of `timeout_s`, so the
   streams taken meanwhile have time to end) the ext_proc port keeps accepting streams, the time
   it takes that readiness to propagate: a request already on its way is
   routed. The delay ends early once no stream has been open for `idle_s` (1 s: nothing is
   coming); under steady traffic it runs in full;
3. then the ext_proc port closes: a new stream is refused (the proxy fails open where configured,
   `failure_mode_allow`), and every open stream, including long streamed generations, runs to its
   end: Envoy keeps the ext_proc stream open until the upstream response ends, so an open stream
   is a live request;
4. the drain ends when the last open stream ends, or at `timeout_s` after SIGTERM (--drain-timeout,
   30 s, the chart's terminationGracePeriodSeconds), which cuts the streams still open: the
   process logs a warning with their count and exits with status 1. A second SIGTERM/SIGINT ends
   the drain at once (what it cuts is counted the same way).

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
        """Wait until no stream has been open for `idle_s` (0: until none is open); False when
        `timeout_s` or `interrupt` came first."""
        start = time.monotonic()
        deadline = start + timeout_s
        if idle_s > 0:
            self.last_closed = max(self.last_closed, start)
        while True:
            now = time.monotonic()
            if self.open == 0 and now - self.last_closed >= idle_s:
                return True
            if now >= deadline or (interrupt is not None and interrupt.is_set()):
                return False
            await asyncio.sleep(min(0.05, max(0.0, deadline - now)))
