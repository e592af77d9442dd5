"""`--workers 2`: two picker processes share the ext_proc port and one view, behind real Envoy."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from testkit.envoy import run_envoy
from testkit.http_client import completion, gather_limited, post
from testkit.picker import picker_for, scrape, value, wait_ready
from testkit.procs import Proc
from testkit.stack import echo_backends

pytestmark = pytest.mark.e2e


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


async def known_at_worker0(picker_metrics: Callable[[], dict[tuple[str, tuple[tuple[str, str], ...]], float]],
                           decisions: int, timeout: float = 10.0) -> None:
    """Wait until worker 0 has sent its own decisions and applied its sibling's (the sync lag)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = await asyncio.to_thread(picker_metrics)
        known = value(samples, "prefix_epp_sync_records_sent_total", worker="0") + value(
            samples, "prefix_epp_sync_records_applied_total", worker="0")
        if known >= decisions:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker 0 knows {known} of {decisions} decisions")
        await asyncio.sleep(0.02)


async def test_two_workers_share_the_port_and_the_view_then_drain(tmp_path: Path) -> None:
    with echo_backends(tmp_path, 3) as backends:
        picker = picker_for(tmp_path, backends, "--workers", "2", "--seed", "3", name="workers")
        proc = Proc(picker.args, picker.log)
        try:
            wait_ready(picker.health_port, proc)
            assert len(children(proc.pid)) == 2
            # One stream per connection: the kernel spreads connections over the two workers.
            with run_envoy(tmp_path, picker.grpc_port, epp_requests_per_connection=1) as (_, listen, _):
                url = f"http://127.0.0.1:{listen}/v1/completions"
                prompts = [f"tenant {g} " + "shared system prompt text " * 40 + f"question {i}"
                           for i in range(5) for g in range(12)]
                async with aiohttp.ClientSession() as s:
                    replies = await gather_limited([post(s, url, completion(p)) for p in prompts[:12]], 4)
                    await known_at_worker0(picker_metrics=lambda: scrape(picker), decisions=12)
                    replies += await gather_limited([post(s, url, completion(p)) for p in prompts[12:]], 4)
            assert all(r.status == 200 for r in replies)
            homes: dict[int, Counter[str]] = {}
            for k, r in enumerate(replies):
                homes.setdefault(k % 12, Counter())[r.served_by] += 1
            # Each tenant's requests land on one backend, whichever worker decided them; a worker
            # that did not see its sibling's decisions would send some to another backend.
            assert all(len(c) == 1 for c in homes.values()), homes
            deadline = time.monotonic() + 10
            while True:  # one /metrics endpoint for the pod: every worker's samples
                samples = scrape(picker)
                routed = [value(samples, "prefix_epp_requests_total", outcome="routed", status="200", worker=w)
                          for w in ("0", "1")]
                applied = [value(samples, "prefix_epp_sync_records_applied_total", worker=w) for w in ("0", "1")]
                if applied == [routed[1], routed[0]] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert sum(routed) == len(prompts) and min(routed) > 0, routed  # both workers decided
            assert applied == [routed[1], routed[0]], (routed, applied)  # each applied all of the other's
            os.kill(proc.pid, signal.SIGTERM)
            await asyncio.to_thread(proc.popen.wait, 30)
            assert proc.popen.returncode == 0
            deadline = time.monotonic() + 10
            while children(proc.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            proc.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=2)
