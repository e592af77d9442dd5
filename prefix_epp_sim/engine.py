"""A continuous-batching scheduler that spends model time instead of GPU time.

One asyncio task per replica runs engine *steps*, like vLLM V1's scheduler loop:

1. Admit waiting requests in FIFO order while fewer than `max_num_seqs` run and the step's
   token budget (`max_num_batched_tokens`, less one token per decoding request and the prefill
   still owed by running requests) is not used up, as vLLM V1 schedules running requests first
   and then waiting ones while budget remains. A request whose LoRA adapter would exceed
   `max_loras` distinct running adapters is skipped (and keeps its place); a request the KV cache
   cannot hold stops admission (head-of-line, as vLLM). Admission fixes the request's cached
   tokens (`KVCache.allocate`), and adds the leading prompt blocks a KV connector loads beyond
   them (`SimRequest.external_blocks`, set by `prefix_epp_sim.kv_transfer`), stored as computed.
   A prompt's blocks become hits as soon as the chunk that computes
   them is scheduled, before the step runs, as vLLM V1's `allocate_slots` caches them: a request
   admitted later in the same step, or in any later step, hits the blocks of every chunk
   scheduled before it (the step writes every KV before attention reads any); only blocks of
   chunks not yet scheduled (a long prompt's later chunks) are missed.
2. Plan a step: every running request past prefill decodes one token, and the prefill chunks
   chosen in step 1 run: the remaining token budget (`max_num_batched_tokens`) goes to them in
   admission order (chunked prefill).
3. Cost it, in model milliseconds::

       step = inter_token_latency + decode_time_per_seq * (sequences in step - 1)
              + [prefill_overhead + prefill_time_per_token * prefill tokens]   (if any prefill)

4. Sleep `step / time_scale` of wall time, then apply it: a request whose prefill completes
   stores its prompt blocks and samples its first token (TTFT = step end - arrival); decoding
   requests gain a token; requests reaching `max_tokens` store their generated full blocks,
   free their blocks and finish. KV events of the step go out as one batch (`after_step`).

Defaults (`SimConfig`) resemble Llama-3-8B (bf16) under vLLM on one H100-80GB:
  - inter_token_latency 8 ms: a decode step streams ~16 GB of weights at ~3.35 TB/s (~5 ms)
    plus kernel-launch and scheduling overhead; published vLLM 8B/H100 runs report 6-10 ms TPOT
    at concurrency 1.
  - decode_time_per_seq 0.15 ms: KV reads and sampling per sequence; gives ~17.5 ms at batch
    64 and ~46 ms at 256, the range vLLM 8B/H100 throughput benchmarks show.
  - prefill_time_per_token 0.06 ms (~16.7k tokens/s): 2 x 8B FLOPs per token at roughly a
    quarter of the 989 dense bf16 TFLOP/s, leaving room for attention on long contexts.
  - prefill_overhead 2 ms: setup and first-token sampling of newly scheduled sequences.
  - max_num_batched_tokens 8192, max_num_seqs 256: common vLLM V1 serving settings.

Cheapness: pure-decode steps with no streaming output due and no admissible arrival are
coalesced into one sleep that lasts until the first request finishes; an arrival cuts the
sleep short at the next step boundary. A replica therefore wakes about once per request
(plus once per `stream_interval` steps while streaming). All costs and reported latencies
are model time; `time_scale` only divides sleeps. When the process falls behind its schedule
(CPU saturation), steps run back to back until caught up and a request that arrived after its
step nominally began is treated as arriving at that step's start, so harness lag is not charged
to the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.kvcache import Allocation, KVCache, block_hash_seed, hash_blocks
from prefix_epp_sim.output import filler_for
from prefix_epp_sim.vllm_metrics import E2E_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS, Histogram


@dataclass(eq=False)
class SimRequest:
    """One inference request; the engine fills in everything after `lora`."""

    prompt_tokens: list[int]
    max_tokens: int
    stream: bool = False
    lora: str | None = None
    arrival: float = 0.0  # model seconds
    prompt_hashes: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prefill_left: int = 0
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    alloc: Allocation | None = None
    external_blocks: int = 0  # leading prompt blocks a KV connector loads (prefix_epp_sim.kv_transfer)
    external_tokens: int = 0  # of the cached tokens, those loaded (beyond the local hit)
    keep_block_ids: bool = False  # a prefill for a remote decode: report its prompt's block ids
    block_ids: list[int] = field(default_factory=list)  # the prompt's full blocks, at finish (keep_block_ids)
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # new tokens or finished
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


@dataclass
class EngineStats:
    prefix_queries: int = 0  # prompt tokens of admitted requests
    prefix_hits: int = 0  # cached tokens of admitted requests, from the local cache
    external_queries: int = 0  # prompt tokens of admitted requests, with a KV connector
    external_hits: int = 0  # tokens loaded by the KV connector
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_success: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


@dataclass
class _Step:
    prefills: list[tuple[SimRequest, int]]
    decodes: list[SimRequest]
    duration: float  # model seconds


class Engine:
    def __init__(self, config: SimConfig, cache: KVCache, after_step: Callable[[], None] | None = None,
                 lora_ids: Mapping[str, int] | None = None) -> None:
        self.config = config
        self.filler = filler_for(config)  # what every request generates
        self.cache = cache
        self.stats = EngineStats()
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.clock = 0.0  # model seconds at the end of the last step
        self._after_step = after_step
        self._lora_ids = dict(lora_ids or {})
        self._lora_running: dict[str, int] = {}
        self._seed = block_hash_seed(config.model_names[0])
        self._seeds = {name: block_hash_seed(name) for name in self._lora_ids}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[bool] | None = None
        self._woken_at = 0.0  # model time of the arrival or abort that cut the last sleep short
        self._prefills: list[tuple[SimRequest, int]] = []  # this step's prefill chunks (`_admit`)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def now(self) -> float:
        """Model seconds since start."""
        assert self._loop is not None, "engine not started"
        return (self._loop.time() - self._t0) * self.config.time_scale

    # --- requests ---------------------------------------------------------------------------

    def seed_for(self, lora: str | None) -> int:
        return self._seeds[lora] if lora else self._seed

    def hash_prompt(self, req: SimRequest) -> None:
        """The chained hashes of the prompt's full blocks (`req.prompt_hashes`), once."""
        if not req.prompt_hashes:
            req.prompt_hashes = hash_blocks(req.prompt_tokens, self.cache.block_size, self.seed_for(req.lora))

    def submit(self, req: SimRequest) -> None:
        """Queue a request (prompt and max_tokens already validated against max_model_len)."""
        req.arrival = self.now()
        self.hash_prompt(req)
        self.waiting.append(req)
        if len(self.running) < self.config.max_num_seqs:
            self._wake(req.arrival)

    def abort(self, req: SimRequest) -> None:
        """Drop a request whose client went away; its blocks are freed at the next step end."""
        if req.finished or req.aborted:
            return
        req.aborted = True
        if req.alloc is None:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        else:
            self._wake(self.now())

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """(running adapters, waiting adapters), for vllm:lora_requests_info."""
        waiting = sorted({r.lora for r in self.waiting if r.lora})
        return sorted(self._lora_running), waiting

    def _wake(self, model_time: float) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._woken_at = model_time
            self._waiter.set_result(True)

    # --- the step loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._admit()
            if not self.running:
                self._waiter = loop.create_future()
                await self._waiter
                self._waiter = None
                # Start at the arrival, not at wake-up: wall latency times time_scale is not model time.
                self.clock = max(self.clock, self._woken_at)
                continue
            step = self._plan()
            start = self.clock
            k = k_max = self._coalescible(step)
            if await self._sleep_until(start + k_max * step.duration, k_max > 1) and step.duration > 0:
                # An arrival or abort cut the stretch short: end it at the step boundary after that.
                elapsed = self._woken_at - start
                k = min(k_max, max(1, math.ceil(elapsed / step.duration)))
                if k < k_max:
                    await self._sleep_until(start + k * step.duration, False)
            self.clock = start + k * step.duration
            self._apply(step, k)
            if self._after_step is not None:
                self._after_step()

    async def _sleep_until(self, model_deadline: float, interruptible: bool) -> bool:
        """Sleep until a model-time deadline; True if an arrival cut an interruptible sleep short."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        when = self._t0 + model_deadline / self.config.time_scale
        handle = loop.call_at(when, _resolve, fut, False)
        if interruptible:
            self._waiter = fut
        try:
            return await fut
        finally:
            handle.cancel()
            self._waiter = None

    def _admit(self) -> None:
        cfg = self.config
        skipped: list[SimRequest] = []
        budget = cfg.max_num_batched_tokens - sum(1 for r in self.running if r.prefill_left == 0)
        self._prefills = []
        for r in self.running:  # their chunks come first in the step, in admission order
            if r.prefill_left > 0 and budget > 0:
                budget -= self._schedule_chunk(r, budget)
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if req.lora and req.lora not in self._lora_running and len(self._lora_running) >= cfg.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            n_prompt = len(req.prompt_tokens)
            alloc = self.cache.allocate(req.prompt_hashes, n_prompt, n_prompt + req.max_tokens,
                                        self._lora_ids.get(req.lora) if req.lora else None, req.lora)
            if alloc is None:
                break
            self.waiting.popleft()
            req.alloc = alloc
            loaded = min(req.external_blocks, (n_prompt - 1) // self.cache.block_size)
            if loaded * self.cache.block_size > alloc.cached_tokens:  # stored as if computed, as vLLM does
                self.cache.commit(alloc, req.prompt_hashes[:loaded], req.prompt_tokens)
                req.external_tokens = loaded * self.cache.block_size - alloc.cached_tokens
            req.cached_tokens = alloc.cached_tokens + req.external_tokens
            req.prefill_left = n_prompt - req.cached_tokens
            budget -= self._schedule_chunk(req, budget)
            req.arrival = min(req.arrival, self.clock)
            self.stats.queue.observe(self.clock - req.arrival)
            self.stats.prefix_queries += n_prompt
            self.stats.prefix_hits += alloc.cached_tokens
            if cfg.kv_connector:
                self.stats.external_queries += n_prompt
                self.stats.external_hits += req.external_tokens
            if req.lora:
                self._lora_running[req.lora] = self._lora_running.get(req.lora, 0) + 1
            self.running.append(req)
        if skipped:
            self.waiting.extendleft(reversed(skipped))

    def _schedule_chunk(self, req: SimRequest, budget: int) -> int:
        """Put the next chunk of the request's prefill in this step (at most `budget` tokens) and
        cache the full blocks it covers, as vLLM V1 does when it schedules them; the chunk's size."""
        chunk = min(req.prefill_left, budget)
        self._prefills.append((req, chunk))
        assert req.alloc is not None
        blocks = (len(req.prompt_tokens) - req.prefill_left + chunk) // self.cache.block_size
        self.cache.commit(req.alloc, req.prompt_hashes[:blocks], req.prompt_tokens)
        return chunk

    def _plan(self) -> _Step:
        cfg = self.config
        decodes = [r for r in self.running if r.prefill_left == 0]
        prefills = self._prefills  # chosen by `_admit`, which caches their blocks
        n_seqs = len(decodes) + len(prefills)
        ms = cfg.inter_token_latency + cfg.decode_time_per_seq * max(0, n_seqs - 1)
        if prefills:
            ms += cfg.prefill_overhead + cfg.prefill_time_per_token * sum(c for _, c in prefills)
        return _Step(prefills, decodes, ms / 1000.0)

    def _coalescible(self, step: _Step) -> int:
        """How many identical decode steps may pass in one sleep."""
        if step.prefills or not step.decodes:
            return 1
        k = min(r.max_tokens - r.generated for r in step.decodes)
        if any(r.stream for r in step.decodes):
            k = min(k, self.config.stream_interval)
        return max(1, k)

    def _apply(self, step: _Step, k: int) -> None:
        end = self.clock
        touched: list[SimRequest] = []
        for req, chunk in step.prefills:
            if req.aborted:
                continue
            req.prefill_left -= chunk
            if req.prefill_left == 0:
                req.generated = 1
                req.first_token_at = end
                # vLLM V1 counts a prompt's tokens with its first token (IterationStats), not at
                # the end: a router pairing the two counters over a window relies on it.
                self.stats.ttft.observe(end - req.arrival)
                self.stats.prompt_tokens += len(req.prompt_tokens)
                touched.append(req)
        for req in step.decodes:
            if not req.aborted:
                req.generated += k
                touched.append(req)
        done = False
        for req in touched:
            if req.generated >= req.max_tokens:
                self._finish(req, end)
                done = True
            elif req.stream:
                req.progress.set()
        if done or any(r.aborted for r in self.running):
            kept: list[SimRequest] = []
            for req in self.running:
                if req.aborted and req.alloc is not None:
                    self._release(req)
                elif not req.finished:
                    kept.append(req)
            self.running = kept

    def _finish(self, req: SimRequest, end: float) -> None:
        alloc = req.alloc
        assert alloc is not None
        req.generated = req.max_tokens
        bs = self.cache.block_size
        # The last sampled token has not been through the model yet, so its KV does not exist.
        computed = len(req.prompt_tokens) + req.generated - 1
        done_blocks = len(req.prompt_hashes)
        if computed // bs > done_blocks:
            tokens = req.prompt_tokens + self.filler.ids(req.generated)
            parent = req.prompt_hashes[-1] if done_blocks else 0
            tail = hash_blocks(tokens[done_blocks * bs:computed], bs, self.seed_for(req.lora), parent)
            self.cache.commit(alloc, req.prompt_hashes + tail, tokens)
        req.finished_at = end
        if req.keep_block_ids:
            req.block_ids = [b.block_id for b in alloc.blocks[:len(req.prompt_hashes)]]
        self._release(req)
        stats = self.stats
        stats.requests_success += 1
        stats.generation_tokens += req.generated
        stats.e2e.observe(end - req.arrival)
        if req.generated > 1 and req.first_token_at is not None:
            stats.tpot.observe((end - req.first_token_at) / (req.generated - 1))
        req.progress.set()
        req.done.set()

    def _release(self, req: SimRequest) -> None:
        assert req.alloc is not None
        self.cache.free(req.alloc)
        req.alloc = None
        if req.lora:
            left = self._lora_running[req.lora] - 1
            if left:
                self._lora_running[req.lora] = left
            else:
                del self._lora_running[req.lora]


def _resolve(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)
