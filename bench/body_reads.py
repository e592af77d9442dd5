"""What a read under the body's deadline costs the picker (`python -m bench.body_reads`, ~1 min).

A stream waiting for its request body reads under `--request-body-timeout`. Three ways, side by
side in each of `--reps` repetitions, over a stand-in for grpc.aio's servicer context whose read
completes one event-loop turn after it is asked (no network: the reading machinery alone), 64
streams at once, `--reads` reads each:

- `plain`: `anext(call)`, no deadline (a read after the body: the reference);
- `timeout`: `asyncio.timeout_at` around `anext(call)`: the read before 76359b0, which the
  deadline cancels (leaving grpc.aio's batch behind: extproc/transport/call.py);
- `next_before`: `Call.next_before(deadline)`: the read in a task of its own, a future and a timer.

Figures: process CPU per read (us). Writes bench/results/body-reads.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from extproc.pb import external_processor_pb2 as pb
from extproc.transport.call import Call, EndWait

OUT = Path(__file__).resolve().parent / "results" / "body-reads"
WAYS = ("plain", "timeout", "next_before")
STREAMS = 64


class _Context:
    """grpc.aio's `read()`, answered one event-loop turn later."""

    def __init__(self, msg: pb.ProcessingRequest) -> None:
        self._msg = msg

    async def read(self) -> pb.ProcessingRequest:
        await asyncio.sleep(0)
        return self._msg


async def _stream(way: str, reads: int, msg: pb.ProcessingRequest) -> None:
    call = Call(_Context(msg), EndWait())  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    for _ in range(reads):
        if way == "plain":
            await anext(call)
        elif way == "timeout":
            async with asyncio.timeout_at(loop.time() + 30):
                await anext(call)
        else:
            await call.next_before(loop.time() + 30)


async def cpu_per_read(way: str, reads: int) -> float:
    msg = pb.ProcessingRequest()
    msg.request_body.body = b"{}"
    start = time.process_time()
    await asyncio.gather(*(_stream(way, reads, msg) for _ in range(STREAMS)))
    return (time.process_time() - start) / (reads * STREAMS) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--reads", type=int, default=2000, help="reads per stream")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    runs: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(a.reps):
        for way in WAYS:  # side by side in each repetition
            runs[way].append(asyncio.run(cpu_per_read(way, a.reads)))
    data: dict[str, Any] = {"reps": a.reps, "reads": a.reads, "streams": STREAMS, "us_per_read": runs}
    lines = ["# CPU per read under the body's deadline (`python -m bench.body_reads`)", "",
             f"In process, {STREAMS} streams x {a.reads:,} reads, a stand-in context whose read completes one "
             f"event-loop turn later; repetitions: {a.reps}, mean (min-max).", "",
             "| read | CPU per read (us) |", "|---|---:|"]
    for way, values in runs.items():
        lines.append(f"| {way} | {statistics.mean(values):.1f} ({min(values):.1f}-{max(values):.1f}) |")
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
