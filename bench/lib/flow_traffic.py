"""The flow-control benchmark's two tenants and its watch on the engines (`python -m bench.flow_control`).

Both tenants send /v1/completions to one gateway URL in the same priority band (no objective),
told apart by `x-llm-d-inference-fairness-id` (`INTERACTIVE`, `BATCH`); every prompt is its own
random words (`bench.lib.workloads.text`, seeded), so no request finds another's prefix cached:

- **interactive**, open loop: one streaming request every 1 / `interactive_rate` seconds from the
  start, whatever the answers do, `interactive_prompt` tokens in, `interactive_tokens` out. TTFT
  is measured at the client, from sending to the first chunk with text (`bench.lib.client.send`);
- **batch**, closed loop: `batch_concurrency` workers, each sending its next request (not
  streamed) as soon as its last one ends, `batch_prompt` tokens in, an output length drawn
  uniformly from `batch_tokens` (short to medium, so sequence slots free often).

`run_tenants(url, load, seconds, ...)` sends for `seconds`, then stops sending and waits for what
is in flight, at most `drain_s`; a request still open then is cancelled and counted as `timeout`.
A batch request's kind is `ok` (200 and a JSON answer with choices), `http_<status>`,
`connection` or `timeout`.

`EngineWatch(urls, interval_s)` reads every engine's /metrics every `interval_s` (all engines at
once, the next round when the slower read is done and the interval has passed): its waiting
queue (`vllm:num_requests_waiting`), running requests and KV use (`vllm:kv_cache_usage_perc`);
the simulator exports the same families. A read that fails or takes over `READ_TIMEOUT_S` is
counted, not fatal (a real engine busy on a shared core can be slow to render its page).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.lib.client import RequestResult, send
from bench.lib.workloads import MODEL, text
from testkit.vllm import metric_total

FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
INTERACTIVE, BATCH = "interactive", "batch"
WAITING, RUNNING, KV = "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
BUSY_FAMILIES = (WAITING, RUNNING)
READ_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Load:
    """The two tenants' shape (module docstring); the defaults are the simulator's."""

    interactive_rate: float = 4.0  # requests per second
    interactive_prompt: int = 400  # tokens
    interactive_tokens: int = 8
    batch_concurrency: int = 32
    batch_prompt: int = 100
    batch_tokens: tuple[int, int] = (8, 32)  # uniform, both included
    sampling: tuple[tuple[str, Any], ...] = ()  # extra body fields (real vLLM: ignore_eos, temperature 0)


@dataclass
class BatchResult:
    sent_s: float
    tokens: int
    end_s: float = 0.0
    kind: str = ""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


@dataclass
class TenantRun:
    """What one arm's tenants saw; times are seconds after `run_tenants` began."""

    interactive: list[RequestResult] = field(default_factory=list)
    batch: list[BatchResult] = field(default_factory=list)
    sending_s: float = 0.0  # how long both sent


def _ok_body(body: bytes) -> bool:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(answer, dict) and bool(answer.get("choices"))


async def _batch_one(s: aiohttp.ClientSession, url: str, payload: bytes, r: BatchResult, t0: float) -> None:
    try:
        async with s.post(url, data=payload, headers={"content-type": "application/json",
                                                      FAIRNESS_HEADER: BATCH}) as resp:
            body = await resp.read()
            r.kind = ("ok" if _ok_body(body) else "truncated") if resp.status == 200 else f"http_{resp.status}"
    except (aiohttp.ClientError, ValueError):
        r.kind = "connection"
    except asyncio.CancelledError:
        r.kind = "timeout"  # still open when the drain ended
        raise
    finally:
        r.end_s = time.perf_counter() - t0


async def run_tenants(url: str, load: Load, seconds: float, *, interactive: bool = True, batch: bool = True,
                      drain_s: float = 60.0, seed: int = 0) -> TenantRun:
    """Both tenants (or one) against `url` (the gateway's base URL) for `seconds` (module docstring)."""
    rng = random.Random(seed)
    out = TenantRun()
    stop = asyncio.Event()
    endpoint = url + "/v1/completions"
    sampling = dict(load.sampling)
    timeout = aiohttp.ClientTimeout(total=seconds + drain_s + 30.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[Any]] = []

        async def worker(w: int) -> None:
            k = 0
            while not stop.is_set():
                tokens = rng.randint(*load.batch_tokens)
                payload = orjson.dumps({"model": MODEL, "max_tokens": tokens, **sampling,
                                        "prompt": text(rng, load.batch_prompt, f"Batch {w}.{k}.")})
                r = BatchResult(time.perf_counter() - t0, tokens)
                out.batch.append(r)
                await _batch_one(s, endpoint, payload, r, t0)
                k += 1

        async def ask(i: int, due: float) -> None:
            r = RequestResult(i, 0, INTERACTIVE, due, max(0.0, time.perf_counter() - t0 - due))
            out.interactive.append(r)
            payload = {"model": MODEL, "max_tokens": load.interactive_tokens, "stream": True,
                       "stream_options": {"include_usage": True}, **sampling,
                       "prompt": text(rng, load.interactive_prompt, f"Interactive {i}.")}
            try:
                await send(s, endpoint, payload, r, 1.0, headers={FAIRNESS_HEADER: INTERACTIVE})
            except asyncio.CancelledError:
                r.error = "timeout"
                raise

        async def interactive_loop() -> None:
            period, i = 1.0 / load.interactive_rate, 0
            while (due := i * period) < seconds:
                await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
                tasks.append(asyncio.create_task(ask(i, due)))
                i += 1

        workers = [asyncio.create_task(worker(w)) for w in range(load.batch_concurrency if batch else 0)]
        tasks += workers
        if interactive:
            await interactive_loop()
        await asyncio.sleep(max(0.0, t0 + seconds - time.perf_counter()))
        stop.set()
        out.sending_s = time.perf_counter() - t0
        _, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return out


@dataclass
class EngineSeen:
    """One engine's readings over an arm."""

    url: str
    reads: int = 0
    failed_reads: int = 0
    max_waiting: float = 0.0
    max_running: float = 0.0
    max_kv: float = 0.0
    waiting: Counter[int] = field(default_factory=Counter)  # readings by waiting queue length

    def summary(self) -> dict[str, Any]:
        return {"engine": self.url, "reads": self.reads, "failed_reads": self.failed_reads,
                "max_waiting": self.max_waiting, "max_running": self.max_running, "max_kv": round(self.max_kv, 4),
                "waiting_histogram": {str(k): v for k, v in sorted(self.waiting.items())}}


class EngineWatch:
    """Every engine's waiting queue, running requests and KV use, read every `interval_s` (module docstring)."""

    def __init__(self, urls: Sequence[str], interval_s: float) -> None:
        self.seen = [EngineSeen(u) for u in urls]
        self.interval_s = interval_s
        self.rounds = 0
        self.elapsed_s = 0.0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> list[EngineSeen]:
        self._stop.set()
        if self._task is not None:
            await self._task
        return self.seen

    async def _read(self, s: aiohttp.ClientSession, e: EngineSeen) -> None:
        try:
            async with s.get(e.url + "/metrics") as resp:
                page = await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            e.failed_reads += 1
            return
        waiting = metric_total(page, WAITING)
        e.reads += 1
        e.waiting[round(waiting)] += 1
        e.max_waiting = max(e.max_waiting, waiting)
        e.max_running = max(e.max_running, metric_total(page, RUNNING))
        e.max_kv = max(e.max_kv, metric_total(page, KV))

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            t0 = time.perf_counter()
            while not self._stop.is_set():
                due = t0 + (self.rounds + 1) * self.interval_s
                await asyncio.gather(*(self._read(s, e) for e in self.seen))
                self.rounds += 1
                with_stop = asyncio.create_task(self._stop.wait())
                await asyncio.wait({with_stop}, timeout=max(0.0, due - time.perf_counter()))
                with_stop.cancel()
            self.elapsed_s = time.perf_counter() - t0
