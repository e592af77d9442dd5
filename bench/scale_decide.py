"""Decision cost as the pool and the prompts grow, in process (no network, no Envoy).

`decision_cells(endpoints, mode, lengths, requests)`: an `App` with `endpoints` endpoints (fresh
scraped metrics on each), its prefix index filled to capacity first, then for each prompt length
`requests(length)` requests through
`Director.prepare` (precise: tokenization) and `Director.route` (parse, hash, index lookup, score
every endpoint, pick, record), each completed at once and the scheduler told, as the transport
tells it at a response end. Prompts of `tokens` builtin tokens: one of 8 shared system prompts
(half the prompt, tokenized and routed before the measured requests, so it is cached and
indexed) plus a part of their own. Figures: wall time per decision p50/p99,
and CPU per request (process CPU over the measured loop / requests).
- approximate: `PrefixIndex` at its default capacity per endpoint (31,250 blocks), every record evicts;
- precise: the KV-events index at its default capacity per endpoint (32,768 blocks) filled by
  BlockStored events; each routed request's blocks (its tokens as far as the lookup reaches,
  tokenized before the clock starts) are then stored on the chosen endpoint as its engine would
  report them. Event streams are treated as connected (no ZeroMQ here): each endpoint has a
  subscriber state that heard from its publisher, so the real usability check runs.

`tokenize(tokens)`: the builtin tokenizer on one prompt of `tokens` tokens, cold (a new tokenizer)
and with all but its last 4,096 tokens cached (an earlier turn), uncapped and at the precise
lookup's cap (max_blocks x block_size = 32,768 tokens).

`index_memory(kind, endpoints)` (run in a fresh process by bench.scale): resident memory added by
an index filled to capacity for that many endpoints, against the index's own estimate.
"""

from __future__ import annotations

import asyncio
import random
import resource
import string
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import orjson

from bench.lib.stats import percentile
from extproc.config.settings import EppConfig, KVEventsConfig
from extproc.control.director import RequestContext
from extproc.core.datastore import EndpointSpec, ModelServerMetrics
from extproc.kvevents.index import PreciseIndex
from extproc.kvevents.wire import Stored
from extproc.prefix.index import PrefixIndex
from extproc.request.openai import Api, parse_request
from extproc.runtime.app import App
from extproc.tokenization.builtin import encode
from extproc.tokenization.chunking import BuiltinTokenizer
from testkit.kvevents import heard_from


class Profiler(Protocol):
    """What `decision_cells` switches on and off around the measured requests."""

    def enable(self) -> None: ...

    def disable(self) -> None: ...


_VOCAB = random.Random(0)
# Words of 1-12 letters (about 1.16 builtin tokens each) from a 5,000-word vocabulary.
WORDS = ["".join(_VOCAB.choice(string.ascii_lowercase) for _ in range(_VOCAB.randint(1, 12))) + " "
         for _ in range(5000)]
TOKENS_PER_WORD = 1.16
BLOCK = 16
_CORPUS_RNG = random.Random(9)
CORPUS = "".join(_CORPUS_RNG.choice(WORDS) for _ in range(200_000))  # the requests' own parts come from it


# The precise lookup's reach (max_blocks x block_size tokens), and enough characters to hold it.
STORED_TOKENS = KVEventsConfig().max_blocks * KVEventsConfig().block_size
STORED_CHARS = STORED_TOKENS * 16


def text(seed: int, tokens: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) for _ in range(int(tokens / TOKENS_PER_WORD)))


def endpoint_specs(n: int) -> list[EndpointSpec]:
    return [EndpointSpec(f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}", 8000) for i in range(n)]


def fill_approximate(index: PrefixIndex, keys: list[str], seed: int = 1) -> None:
    """Each endpoint's LRU full of blocks of its own: random 63-bit hashes, as xxh64 spreads them
    (consecutive integers would sit side by side in the dicts' tables, which no real index sees)."""
    rng = random.Random(seed)
    for key in keys:
        index.load(key, [rng.getrandbits(63) for _ in range(index.capacity(key))])


def fill_precise(index: PrefixIndex | PreciseIndex, keys: list[str], capacity: int) -> None:
    """BlockStored events of 64 blocks until each endpoint holds `capacity` blocks."""
    assert isinstance(index, PreciseIndex)
    rng = random.Random(2)
    pool = [[rng.randrange(50000) for _ in range(64 * BLOCK)] for _ in range(64)]
    serial = 1
    for e, key in enumerate(keys):
        parent: int | None = None
        first = [e % 50000, *pool[0][1:]]
        for k in range(capacity // 64):
            hashes = list(range(serial, serial + 64))
            serial += 64
            index.apply((key, 0), Stored(hashes, parent, first if k == 0 else pool[k % 64], BLOCK))
            parent = hashes[-1]


def decision_cells(endpoints: int, mode: str, lengths: Sequence[int], requests: Callable[[int], int],
                   profiler: Profiler | None = None, max_scored: int | None = None) -> list[dict[str, Any]]:
    """One row of the matrix per prompt length, on one App whose index is filled once; `profiler`
    (if any: a cProfile.Profile, or bench.scale_parts' timers) runs over the measured requests
    only; `max_scored`: --max-scored-endpoints (None: the default)."""
    kv = KVEventsConfig(prefix_scorer="precise") if mode == "precise" else KVEventsConfig()
    cfg = replace(EppConfig(seed=1, kv_events=kv), metrics_staleness_threshold_s=1e9)
    if max_scored is not None:
        cfg = replace(cfg, max_scored_endpoints=max_scored)
    app = App(cfg)
    specs = endpoint_specs(endpoints)
    app.datastore.set_endpoints(specs)
    keys = [s.key for s in specs]
    now = time.monotonic()
    for i, key in enumerate(keys):
        app.datastore.set_metrics(key, ModelServerMetrics(
            # 31,250 GPU blocks of 16 tokens: the approximate index's default capacity (auto-tuned).
            waiting=i % 3, running=2, kv_usage=0.3, block_size=BLOCK, num_gpu_blocks=31250, ttft_sum_s=10.0,
            ttft_count=100, prompt_tokens=100000, updated_at=now, ok=True))
    t0 = time.perf_counter()
    fill_approximate(app.index, keys)
    if app.kv_events is not None:
        manager = app.kv_events
        heard_from(manager, keys, now)  # usable by the manager's own check
        fill_precise(manager.index, keys, kv.index_capacity)
    fill_s = time.perf_counter() - t0
    rng = random.Random(3)
    serial = 0

    async def one(data: bytes, tokens: array[int] | None) -> float:
        nonlocal serial
        serial += 1
        ctx = RequestContext(path="/v1/completions", request_id=str(serial))
        start = time.perf_counter()
        if app.director.tokenizes_async:
            await app.director.prepare(ctx, data)
        decision = app.director.route(ctx, data)
        elapsed = time.perf_counter() - start
        app.director.complete(decision.primary, decision)  # the observers release what it held
        if app.kv_events is not None and tokens:  # the engine reports the blocks it stored
            n = len(tokens) // BLOCK * BLOCK
            app.kv_events.index.apply((decision.primary.key, 0), Stored(
                [rng.getrandbits(63) for _ in range(n // BLOCK)], None, tokens[:n].tolist(), BLOCK))
            app.kv_events._heard(decision.primary.key)  # as its subscriber does on each message
        # The loop runs until this is its only task between requests (they are not back to back):
        # what the picker does after an answer (the prefix-index records, keying the rest of a
        # prompt whose tokenizing stopped early) runs here, in CPU per request, not in the time to
        # the decision. Back to back, the next decision's lookup would make the records first.
        await asyncio.sleep(0)
        me = asyncio.current_task()
        while any(t is not me for t in asyncio.all_tasks()):
            await asyncio.sleep(0)
        return elapsed

    async def cell(tokens: int) -> dict[str, Any]:
        shared = [text(100 + g + tokens, tokens // 2) for g in range(8)]
        own_chars = len(shared[0])
        corpus = CORPUS * (own_chars // len(CORPUS) + 2)
        count = requests(tokens)
        bodies: list[bytes] = []
        stored: list[array[int] | None] = []
        for i in range(16 + count):  # made before the clock starts
            at = corpus.index(" ", rng.randrange(len(CORPUS))) + 1
            prompt = shared[i % 8] + corpus[at:at + own_chars]
            bodies.append(orjson.dumps({"model": "bench-model", "prompt": prompt, "max_tokens": 1}))
            # What the engine stores: the prompt's tokens as far as the precise lookup reaches.
            stored.append(array("I", encode(prompt[:STORED_CHARS])[:STORED_TOKENS]) if app.kv_events else None)
        for data, ids in zip(bodies[:16], stored[:16], strict=True):  # the shared prompts routed and indexed
            await one(data, ids)
        samples = []
        if profiler is not None:
            profiler.enable()
        cpu0 = time.process_time()
        for data, ids in zip(bodies[16:], stored[16:], strict=True):
            samples.append(await one(data, ids))
        cpu = time.process_time() - cpu0
        if profiler is not None:
            profiler.disable()
        return {"endpoints": endpoints, "tokens": tokens, "mode": mode, "body_kb": len(bodies[0]) / 1000,
                "requests": count, "p50_ms": percentile(samples, 50) * 1e3, "p99_ms": percentile(samples, 99) * 1e3,
                "cpu_ms_per_request": cpu / count * 1e3, "fill_s": fill_s,
                "index_entries": app.index.entries + (app.kv_events.index.entries if app.kv_events else 0)}

    async def run() -> list[dict[str, Any]]:
        return [await cell(tokens) for tokens in lengths]

    return asyncio.run(run())


def tokenize(tokens: int, reps: int = 5) -> dict[str, Any]:
    cap = KVEventsConfig().max_blocks * KVEventsConfig().block_size
    context, turn = text(7, tokens - 4096), text(8, 4096)
    parsed = parse_request(Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": context + turn}))
    real_tokens = len(encode(context + turn))

    async def run() -> dict[str, float]:
        out: dict[str, list[float]] = {"cold_ms": [], "cached_prefix_ms": [], "capped_cold_ms": [],
                                       "capped_cached_prefix_ms": []}
        for r in range(reps):
            for label, max_tokens in (("", 0), ("capped_", cap)):
                tok = BuiltinTokenizer()
                t0 = time.perf_counter()
                await tok.encode_async(parsed, max_tokens)
                out[f"{label}cold_ms"].append((time.perf_counter() - t0) * 1e3)
                warm = BuiltinTokenizer()
                await warm.encode_async(parse_request(Api.COMPLETIONS, orjson.dumps(
                    {"model": "m", "prompt": context + text(20 + r, 4096)})), max_tokens)
                t0 = time.perf_counter()
                await warm.encode_async(parsed, max_tokens)
                out[f"{label}cached_prefix_ms"].append((time.perf_counter() - t0) * 1e3)
        return {k: percentile(v, 50) for k, v in out.items()}

    return {"tokens": real_tokens, "chars": len(context + turn), **asyncio.run(run())}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def index_memory(kind: str, endpoints: int) -> dict[str, Any]:
    keys = [s.key for s in endpoint_specs(endpoints)]
    before = _rss_bytes()
    if kind == "approximate":
        approx = PrefixIndex(EppConfig().prefix.lru_capacity_per_server)
        fill_approximate(approx, keys)
        entries, estimate = approx.entries, approx.approx_bytes()
    else:
        capacity = KVEventsConfig().index_capacity
        precise = PreciseIndex(capacity, KVEventsConfig().speculative_ttl_s)
        fill_precise(precise, keys, capacity)
        entries, estimate = precise.entries, precise.approx_bytes()
    rss = _rss_bytes() - before
    return {"kind": kind, "endpoints": endpoints, "entries": entries, "rss_mb": rss / 1e6,
            "bytes_per_entry": rss / max(entries, 1), "estimate_mb": estimate / 1e6}
