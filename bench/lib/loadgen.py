"""Load against one URL for the overhead benchmark (`bench.overhead`): closed and open loop.

- `closed_loop(url, bodies, concurrency, total, tally)`: `concurrency` workers send `total`
  requests back to back (each worker waits for its answer), after `warm_up` untimed ones.
- `open_loop(url, bodies, rate, total, tally)`: `total` requests sent at a fixed `rate` per
  second whatever the answers' length, so equal request rates compare like with like.
- Both fill a `Tally`: the latency of every 200 answer, the failures, the timed wall seconds
  and, given a `pid`, the CPU seconds that process spent meanwhile (`cpu_seconds`, /proc).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Tally:
    """What one setup did over the rounds of a measurement."""

    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    elapsed_s: float = 0.0
    cpu_s: float = 0.0


async def send(session: aiohttp.ClientSession, url: str, body: bytes, tally: Tally) -> None:
    """One request; its latency joins `tally` if the answer is a 200, else it counts as failed."""
    start = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            await resp.read()
            ok = resp.status == 200
    except aiohttp.ClientError:
        ok = False
    if ok:
        tally.latencies.append(time.perf_counter() - start)
    else:
        tally.failed += 1


async def closed_loop(url: str, bodies: list[bytes], concurrency: int, total: int, tally: Tally,
                      pid: int | None = None, warm_up: int = 0) -> None:
    """`total` requests from `concurrency` workers into `tally`; only 200 answers count as latencies.

    With `pid`, the CPU seconds that process spent during the timed part are added too.
    """
    issued = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def worker() -> None:
            nonlocal issued
            while issued < total:
                i = issued
                issued += 1
                await send(session, url, bodies[i % len(bodies)], tally)

        for _ in range(warm_up):  # connections, the picker's index
            async with session.post(url, data=bodies[0], headers={"content-type": "application/json"}) as r:
                await r.read()
        cpu_before = cpu_seconds(pid) if pid else 0.0
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        tally.elapsed_s += time.perf_counter() - start
        tally.cpu_s += cpu_seconds(pid) - cpu_before if pid else 0.0


async def open_loop(url: str, bodies: list[bytes], rate: float, total: int, tally: Tally,
                    pid: int | None = None) -> None:
    """`total` requests sent at a fixed `rate` per second whatever the answers' length (open loop).

    At equal request rates the picker's CPU per request compares like with like: in a closed loop
    longer answers lower the request rate, and an event loop spends more per request when fewer
    requests share each wake-up.
    """
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        loop = asyncio.get_running_loop()
        cpu_before = cpu_seconds(pid) if pid else 0.0
        start = loop.time()
        tasks = []
        for i in range(total):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, url, bodies[i % len(bodies)], tally)))
        await asyncio.gather(*tasks)
        tally.elapsed_s += loop.time() - start
        tally.cpu_s += cpu_seconds(pid) - cpu_before if pid else 0.0
