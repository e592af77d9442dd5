"""The placement reference: the most prefix-cache hits placement alone gets from the engines' own caches.

The finite-cache bound (`bench.lib.cache_bound`) pools the replicas' caches and evicts
offline-optimally. Real vLLM engines evict by their own rule, one engine at a time, so part of the
gap between a router and that bound is out of any router's reach: a router chooses where each
request goes, never what an engine evicts. This module replays a run's requests, each from its
first token to its end, through a model of each engine's cache, and asks how many hits a
clairvoyant placement gets there.

`EngineCache`, vLLM V1's block pool as far as prefix hits go (vllm/v1/core/block_pool.py and
kv_cache_manager.py):
- `capacity` blocks, all free at first; a request's hit is the leading run of its prompt's blocks
  the engine holds (`BlockTrace.looked_up`: never the last prompt token's block), held whether a
  running request uses them or they wait in the free queue;
- a starting request takes the blocks it hits out of the free queue (shared with any running
  request that holds them) and one block for each other block it occupies (`BlockTrace.stored`:
  the prompt's, then the full blocks of prompt and answer; and `BlockTrace.blocks`: the partly
  filled last one), each popped from the head of the free queue: a never-used block while there
  are any, else the least recently freed one, whose prefix, if it held one, is evicted;
- a finished request's cached blocks that no running request still holds return to the free
  queue's tail in reverse order (vLLM frees them so, so that a prompt's tail is evicted before its
  head); its partly filled block, which holds no prefix, goes to the head, to be reused first.
What it leaves out: when exactly the engine scheduled each request (here, at its first token, by
which time all its prompt's blocks are taken), chunked prefill taking them chunk by chunk, and
preemption when the pool runs out (here the block is taken anyway).
tests/e2e/test_vllm_cache_model.py checks the model against a real engine request by request.

`replay(requests, placement, engines, capacity)`: the engines' cache hits for a placement, the
requests' starts and ends in time order (an end before a start at the same instant). A request
starts at its first token (`timed`): on a busy engine it waits in the queue before it takes any
block, and replays from the sends counted more hits than queued engines did.

`reference(requests, engines, capacity)`: greedy clairvoyant placement. In the order the requests
were sent, each request tries every engine: from the replayed state at its start, the rest of the
run is replayed with each later request on `base_choice` (the engine holding the longest leading
run of its blocks, ties to the one running fewest requests, then the lowest index), and the request
keeps the engine whose replay hits most (ties to base_choice's). It knows every later request and
when it will come, so no online router is expected to reach it; it is not a bound either (greedy,
one request at a time). Its cost is requests x engines x the events left, ~1 s of CPU for a
160-request run on 2 engines, so bench.run computes it only for the 2 engines of the vLLM
backend. `run_reference(results, traces, engines, capacity)` takes one run's answered requests;
`run_replayed` replays the run's own placement where its records name every engine (the
picker's --explain-decisions), to set the model beside the engines' own counters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bench.lib.cache_bound import BlockTrace
from bench.lib.client import RequestResult
from testkit.vllm import NUM_BLOCKS


@dataclass(frozen=True)
class Timed:
    """One request of a run: when the engine took it and let it go, and its blocks."""
    start_s: float
    end_s: float
    trace: BlockTrace


class EngineCache:
    """One engine's prefix cache (module docstring)."""

    __slots__ = ("empty", "free", "held")

    def __init__(self, capacity: int) -> None:
        self.empty = capacity  # free blocks that hold no prefix: the head of the free queue
        self.free: OrderedDict[int, None] = OrderedDict()  # the rest, cached blocks, head first
        self.held: dict[int, int] = {}  # block -> running requests holding it

    def copy(self) -> EngineCache:
        other = EngineCache(0)
        other.empty, other.free, other.held = self.empty, self.free.copy(), dict(self.held)
        return other

    def leading(self, trace: BlockTrace) -> int:
        """Blocks of the prompt's leading run the engine holds."""
        n = 0
        for h in trace.looked_up:
            if h not in self.held and h not in self.free:
                break
            n += 1
        return n

    def _take(self) -> None:
        """One block off the head of the free queue; a cached one is evicted with it."""
        if self.empty > 0:
            self.empty -= 1
        elif self.free:
            self.free.popitem(last=False)

    def start(self, trace: BlockTrace) -> int:
        """Takes the request's blocks; returns its hit in blocks."""
        hits = self.leading(trace)
        held, free = self.held, self.free
        for h in trace.stored:
            count = held.get(h)
            if count:
                held[h] = count + 1
                continue
            if h in free:
                del free[h]
            else:
                self._take()
            held[h] = 1
        for _ in range(trace.blocks - len(trace.stored)):  # the partly filled last block
            self._take()
        return hits

    def end(self, trace: BlockTrace) -> None:
        """Frees the request's blocks: its partly filled one to the head, `stored` reversed to the tail."""
        held, free = self.held, self.free
        self.empty += max(trace.blocks - len(trace.stored), 0)
        for h in reversed(trace.stored):
            count = held.get(h, 0)
            if count > 1:
                held[h] = count - 1
            elif count == 1:
                del held[h]
                free[h] = None


def _events(requests: Sequence[Timed]) -> list[tuple[float, int, int]]:
    """(time, 0 for an end or 1 for a start, request) in time order."""
    out = [(r.start_s, 1, i) for i, r in enumerate(requests)]
    out += [(r.end_s, 0, i) for i, r in enumerate(requests)]
    out.sort()
    return out


def base_choice(trace: BlockTrace, caches: Sequence[EngineCache], running: Sequence[int]) -> int:
    return min(range(len(caches)), key=lambda e: (-caches[e].leading(trace), running[e], e))


@dataclass
class _State:
    caches: list[EngineCache]
    running: list[int]
    where: dict[int, int]
    hits: int

    def copy(self) -> _State:
        return _State([c.copy() for c in self.caches], list(self.running), dict(self.where), self.hits)


def _run(requests: Sequence[Timed], events: Sequence[tuple[float, int, int]], span: tuple[int, int],
         state: _State, choose: Callable[[int, _State], int]) -> _State:
    """Replays events[begin:end] onto `state` (changed in place), each start placed by `choose`."""
    for _, kind, i in events[span[0]:span[1]]:
        trace = requests[i].trace
        if kind:
            e = choose(i, state)
            state.where[i] = e
            state.running[e] += 1
            state.hits += state.caches[e].start(trace)
        elif i in state.where:
            e = state.where[i]
            state.running[e] -= 1
            state.caches[e].end(trace)
    return state


def _fresh(engines: int, capacity: int) -> _State:
    return _State([EngineCache(capacity) for _ in range(engines)], [0] * engines, {}, 0)


def _rate(requests: Sequence[Timed], state: _State) -> float:
    prompt = sum(r.trace.prompt_tokens for r in requests)
    cached = state.hits * requests[0].trace.block_size if requests else 0
    return cached / prompt if prompt else 0.0


def replay(requests: Sequence[Timed], placement: Sequence[int], engines: int, capacity: int) -> float:
    """The hit rate (cached / prompt tokens) with request i on engine placement[i]."""
    events = _events(requests)
    state = _run(requests, events, (0, len(events)), _fresh(engines, capacity), lambda i, _: placement[i])
    return _rate(requests, state)


def reference(requests: Sequence[Timed], engines: int, capacity: int) -> float:
    """The greedy clairvoyant placement's hit rate (module docstring)."""
    events = _events(requests)
    fixed: dict[int, int] = {}

    def choose(i: int, state: _State) -> int:
        e = fixed.get(i)
        return e if e is not None else base_choice(requests[i].trace, state.caches, state.running)

    state, pos, end = _fresh(engines, capacity), 0, len(events)
    for n, (_, kind, i) in enumerate(events):
        if not kind:
            continue
        _run(requests, events, (pos, n), state, choose)  # up to this start, every request placed
        pos = n
        default = base_choice(requests[i].trace, state.caches, state.running)
        best, best_hits = default, -1
        for e in [default, *(k for k in range(engines) if k != default)]:
            fixed[i] = e
            hits = _run(requests, events, (n, end), state.copy(), choose).hits
            if hits > best_hits:
                best, best_hits = e, hits
        fixed[i] = best
    return _rate(requests, _run(requests, events, (pos, end), state, choose))


def timed(results: Sequence[RequestResult], traces: Mapping[tuple[int, int], BlockTrace]) -> list[Timed]:
    """One run's answered requests, each from its first token (by then the engine has taken every
    block of its prompt, and what it hit was decided when it was scheduled, in between) to its end."""
    return [Timed(r.sent_s + (r.ttft_s or 0.0), r.sent_s + r.e2e_s, traces[(r.session, r.turn)])
            for r in results if r.ok and (r.session, r.turn) in traces]


def run_reference(results: Sequence[RequestResult], traces: Mapping[tuple[int, int], BlockTrace],
                  engines: int, capacity: int) -> float:
    """The reference for one run's answered requests, at the times the run gave them."""
    return reference(timed(results, traces), engines, capacity)


def run_replayed(results: Sequence[RequestResult], traces: Mapping[tuple[int, int], BlockTrace],
                 keys: Sequence[str], capacity: int) -> float | None:
    """The run's own placement replayed (the model's check on a concurrent run): None unless every
    answered request names its engine, in `served_by` or in the picker's explanation
    (`decision`, --explain-decisions: "endpoint=KEY; ...")."""
    placement = []
    for r in results:
        if not (r.ok and (r.session, r.turn) in traces):
            continue
        key = r.served_by or _explained(r.decision)
        if key not in keys:
            return None
        placement.append(keys.index(key))
    return replay(timed(results, traces), placement, len(keys), capacity)


def _explained(decision: str) -> str:
    head = decision.split(";", 1)[0]
    return head.removeprefix("endpoint=") if head.startswith("endpoint=") else ""


def placement_figures(results: Sequence[RequestResult], traces: Mapping[tuple[int, int], BlockTrace],
                      keys: Sequence[str]) -> dict[str, float]:
    """A run's `hit_reference` and, where its placement is known, `hit_replayed`, on real engines
    of NUM_BLOCKS blocks (vLLM keeps one of them aside: its null block)."""
    out = {"hit_reference": round(run_reference(results, traces, len(keys), NUM_BLOCKS - 1), 4)}
    replayed = run_replayed(results, traces, keys, NUM_BLOCKS - 1)
    if replayed is not None:
        out["hit_replayed"] = round(replayed, 4)
    return out
