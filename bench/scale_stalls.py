"""The longest pause an index update puts on the event loop, with the index at capacity.

A per-request p99 over a few hundred decisions (bench/scale_decide.py) cannot see a pause that
comes once in thousands of updates, yet such a pause holds every request in flight: a Python dict
that keeps losing old keys and gaining new ones is rebuilt in one go whenever its free slots run
out, at a cost proportional to its size (an 8M-entry dict: about 2 s). This part churns each
index at capacity for one turnover (as many new blocks as it holds, enough to pass a rebuild of
its largest dict), timing every update:

- approximate: `PrefixIndex` at its default capacity (31,250 blocks) per endpoint, filled; then
  `records` routed prompts of 500 blocks (8k tokens), half of them one of 8 shared prefixes, half
  new, each recorded on a random endpoint (`record`: insert, evict to capacity);
- precise: the KV-events index at its default capacity (32,768 blocks) per endpoint, filled by
  BlockStored events; then `records` BlockStored events of 64 new blocks on random endpoints
  (`apply`: re-hash, insert, evict).

Run in a fresh process per cell (bench.scale), so each starts from the same heap. Each update
is timed twice: wall time (what the event loop waits) and the thread's CPU time, whose maximum
tells a rebuild (CPU spent inside the update) from the process being descheduled (wall time only).
"""

from __future__ import annotations

import random
from time import perf_counter, thread_time
from typing import Any

from bench.lib.stats import percentile
from bench.scale_decide import BLOCK, endpoint_specs, fill_approximate, fill_precise
from extproc.config.settings import KVEventsConfig, PrefixConfig
from extproc.kvevents.index import PreciseIndex
from extproc.kvevents.wire import Stored
from extproc.prefix.index import PrefixIndex

STALL_MS = 10.0  # an update at least this long counts as a stall


NEW_BLOCKS = {"approximate": 250, "precise": 64}  # new blocks per update, as below


def turnover(kind: str, endpoints: int) -> int:
    """Updates that insert as many new blocks as the index holds: enough to pass at least one
    rebuild of its largest dict (a rebuilt dict has room for at most ~3x its entries)."""
    capacity = PrefixConfig().lru_capacity_per_server if kind == "approximate" else KVEventsConfig().index_capacity
    return capacity * endpoints // NEW_BLOCKS[kind]


def index_stalls(kind: str, endpoints: int, records: int = 0) -> dict[str, Any]:
    """One cell (module docstring); `records` 0: one turnover."""
    records = records or turnover(kind, endpoints)
    keys = [s.key for s in endpoint_specs(endpoints)]
    rng = random.Random(11)
    samples: list[float] = []
    cpu: list[float] = []
    if kind == "approximate":
        index = PrefixIndex(PrefixConfig().lru_capacity_per_server)
        fill_approximate(index, keys)
        shared = [[rng.getrandbits(63) for _ in range(250)] for _ in range(8)]
        for i in range(records):
            hashes = shared[i % 8] + [rng.getrandbits(63) for _ in range(250)]
            key = keys[rng.randrange(endpoints)]
            c0, t0 = thread_time(), perf_counter()
            index.record(key, hashes)
            samples.append(perf_counter() - t0)
            cpu.append(thread_time() - c0)
        entries = index.entries
    else:
        kv = KVEventsConfig()
        precise = PreciseIndex(kv.index_capacity)
        fill_precise(precise, keys, kv.index_capacity)
        tokens = [rng.randrange(50000) for _ in range(64 * BLOCK)]
        serial = 1 << 40
        for _ in range(records):
            key = keys[rng.randrange(endpoints)]
            first = [rng.randrange(50000), *tokens[1:]]
            event = Stored(list(range(serial, serial + 64)), None, first, BLOCK)
            serial += 64
            c0, t0 = thread_time(), perf_counter()
            precise.apply((key, 0), event)
            samples.append(perf_counter() - t0)
            cpu.append(thread_time() - c0)
        entries = precise.entries
    ms = [s * 1e3 for s in samples]
    return {"kind": kind, "endpoints": endpoints, "records": records, "entries": entries,
            "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "p999_ms": percentile(ms, 99.9),
            "max_ms": max(ms), "max_cpu_ms": max(cpu) * 1e3, "stalls": sum(1 for x in ms if x >= STALL_MS),
            "stalled_ms": sum(x for x in ms if x >= STALL_MS)}
