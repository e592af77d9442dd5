"""Supervised background tasks: a crash is logged with its traceback and the task restarts.

`supervise(name, factory)` runs `await factory()` in a task. The background loops of the picker
(discovery, metrics scraping, KV-event subscriptions) are meant to run until cancelled, so any
return or exception is a fault: it is logged at ERROR with the traceback, counted in `restarts`,
and the loop is started again after a back-off that doubles from `initial_s` (0.1 s) up to
`max_s` (30 s), and falls back to `initial_s` once a run has lasted longer than `max_s`.
Cancellation (shutdown) stops the supervisor at once. With `restart_on_return=False` a normal
return ends supervision quietly (a loop that gives up on purpose, e.g. an unusable address).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("prefix_epp.supervise")

INITIAL_BACKOFF_S = 0.1
MAX_BACKOFF_S = 30.0


@dataclass
class Supervised:
    name: str
    factory: Callable[[], Awaitable[object]]
    initial_s: float = INITIAL_BACKOFF_S
    max_s: float = MAX_BACKOFF_S
    restart_on_return: bool = True
    restarts: int = 0
    task: asyncio.Task[None] = field(init=False, repr=False)

    async def _loop(self) -> None:
        backoff = self.initial_s
        while True:
            started = time.monotonic()
            try:
                await self.factory()
                if not self.restart_on_return:
                    return
                log.error("background task returned; restarting", extra={"task": self.name})
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task crashed; restarting",
                              extra={"task": self.name, "backoff_s": backoff})
            self.restarts += 1
            if time.monotonic() - started > self.max_s:
                backoff = self.initial_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_s)


def supervise(name: str, factory: Callable[[], Awaitable[object]], *, initial_s: float = INITIAL_BACKOFF_S,
              max_s: float = MAX_BACKOFF_S, restart_on_return: bool = True) -> Supervised:
    """Start `factory()` under supervision on the running loop; cancel `.task` to stop it."""
    sup = Supervised(name, factory, initial_s, max_s, restart_on_return)
    sup.task = asyncio.get_running_loop().create_task(sup._loop(), name=name)
    return sup
