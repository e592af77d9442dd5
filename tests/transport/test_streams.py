"""StreamTracker: the drain waits for open streams, then for a quiet second (extproc/transport/streams.py)."""

from __future__ import annotations

import asyncio
import time

from extproc.transport.streams import StreamTracker


async def test_drain_waits_for_the_last_stream_then_idle() -> None:
    t = StreamTracker()
    t.opened()
    t.opened()

    async def finish() -> None:
        await asyncio.sleep(0.2)
        t.closed()
        await asyncio.sleep(0.1)
        t.closed()

    start = time.monotonic()
    closer = asyncio.create_task(finish())
    assert await t.drained(idle_s=0.2, timeout_s=10)
    elapsed = time.monotonic() - start
    assert t.open == 0 and t.total == 2
    assert 0.5 <= elapsed < 5  # 0.3 s of streams + 0.2 s quiet
    await closer


async def test_drain_gives_up_at_the_timeout_or_when_interrupted() -> None:
    t = StreamTracker()
    t.opened()
    assert not await t.drained(idle_s=0.1, timeout_s=0.2)
    hurry = asyncio.Event()
    hurry.set()
    assert not await t.drained(idle_s=0.1, timeout_s=30, interrupt=hurry)
