"""A paged KV cache with vLLM's prefix-caching rules, without any tensors.

Blocks and hashes
    The cache holds `num_blocks` blocks of `block_size` tokens. Only FULL blocks are ever
    reused. A block's hash chains its parent's::

        hash(block i) = xxh64(parent.to_bytes(8, "little") + uint32-LE token ids, seed)
        parent of block 0 = 0 (events report it as None)
        seed = xxh64(name) for the served model name, or the LoRA adapter name

    `hash_blocks` is the one implementation; the picker may import it to predict hits.

Prefix reuse
    `allocate` looks up the request's full prompt blocks in order and stops at the first miss;
    the blocks found are the request's cached tokens, exactly what the cache held when the
    request was scheduled. As in vLLM, a prompt that is entirely cached still recomputes its
    last token, so at most `(prompt_tokens - 1) // block_size` blocks hit.

Allocation and eviction (vLLM's free-block queue)
    Every unreferenced block sits in one LRU queue, cached or not. A request takes references
    on its hit blocks (removing them from the queue) and pops new blocks from the LRU end; a
    popped block that still carried a hash is evicted (`BlockRemoved`). A request reserves, at
    admission, blocks for its prompt plus all `max_tokens` output tokens (vLLM allocates decode
    blocks lazily and preempts when it runs out; reserving up front gives the same admission
    pressure without modelling preemption). If the free queue is too short, `allocate` returns
    None and the scheduler keeps the request waiting. On `free`, blocks return in reverse order
    so a sequence's tail is evicted before its head; blocks without a hash go to the LRU end.

Storing (events)
    `commit` hashes a request's newly covered full blocks and reports them in one `BlockStored`
    per contiguous run. The scheduler calls it as each prefill chunk is scheduled, as vLLM V1
    caches blocks in `allocate_slots`, and at finish for the generated tokens. A block whose hash
    another request stored first stays unhashed. Evictions collected during one `allocate` are
    reported in one `BlockRemoved`; `reset` forgets every hash and reports `AllBlocksCleared`.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[KVEvent], None]


def block_hash_seed(name: str) -> int:
    """Hash seed for a model or LoRA adapter name."""
    return xxhash.xxh64_intdigest(name.encode("utf-8"))


def hash_blocks(tokens: Sequence[int], block_size: int, seed: int, parent: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `tokens`.

    To continue a chain, pass the tokens after its last full block and that block's hash as
    `parent` (0, the default, starts a sequence).
    """
    packed = array("I", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    data = packed.tobytes()
    width = block_size * 4
    out: list[int] = []
    digest = xxhash.xxh64_intdigest
    for offset in range(0, (len(tokens) // block_size) * width, width):
        parent = digest(parent.to_bytes(8, "little") + data[offset:offset + width], seed)
        out.append(parent)
    return out


class _Block:
    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


@dataclass(eq=False, slots=True)
class Allocation:
    """The blocks a running request holds; block i holds tokens [i*bs, (i+1)*bs)."""

    blocks: list[_Block]
    cached_tokens: int  # prefix-cache hit, in tokens, at admission
    committed: int  # leading blocks already hashed (the hits, then each commit)
    lora_id: int | None = None
    lora_name: str | None = None


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, sink: EventSink | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._sink = sink
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, _Block] = {}

    # --- read-only views -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` the cache holds right now."""
        hits = 0
        for h in block_hashes:
            if h not in self._cached:
                break
            hits += 1
        return hits

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._cached

    # --- request lifecycle -----------------------------------------------------------------

    def allocate(self, prompt_hashes: Sequence[int], num_prompt_tokens: int, num_total_tokens: int,
                 lora_id: int | None = None, lora_name: str | None = None) -> Allocation | None:
        """Reserve blocks for a request, reusing its cached prefix; None if it must wait."""
        max_hits = min(len(prompt_hashes), (num_prompt_tokens - 1) // self.block_size)
        hits: list[_Block] = []
        cached = self._cached
        for h in prompt_hashes[:max_hits]:
            block = cached.get(h)
            if block is None:
                break
            hits.append(block)
        idle_hits = sum(1 for b in hits if b.ref_cnt == 0)
        new_count = self.blocks_needed(num_total_tokens) - len(hits)
        if new_count + idle_hits > len(self._free):
            return None
        free = self._free
        for block in hits:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1
        evicted: list[int] = []
        blocks = self._blocks
        new_blocks: list[_Block] = []
        for _ in range(new_count):
            block = blocks[free.popitem(last=False)[0]]
            if block.block_hash is not None:
                del cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            new_blocks.append(block)
        if evicted:
            self._emit(BlockRemoved(evicted))
        return Allocation(blocks=hits + new_blocks, cached_tokens=len(hits) * self.block_size,
                          committed=len(hits), lora_id=lora_id, lora_name=lora_name)

    def commit(self, alloc: Allocation, block_hashes: Sequence[int], tokens: Sequence[int]) -> None:
        """Record that the request computed the full blocks in `block_hashes` (its whole chain).

        `block_hashes[i]` is block i's hash; blocks before `alloc.committed` are skipped.
        `tokens` holds at least all tokens of the newly committed blocks.
        """
        start = alloc.committed
        end = min(len(block_hashes), len(alloc.blocks))
        if end <= start:
            return
        bs = self.block_size
        cached = self._cached
        run_start: int | None = None
        for i in range(start, end + 1):
            stored = False
            if i < end:
                h = block_hashes[i]
                block = alloc.blocks[i]
                if h not in cached and block.block_hash is None:
                    block.block_hash = h
                    cached[h] = block
                    stored = True
            if stored and run_start is None:
                run_start = i
            elif not stored and run_start is not None:
                self._emit(BlockStored(
                    block_hashes=list(block_hashes[run_start:i]),
                    parent_block_hash=block_hashes[run_start - 1] if run_start > 0 else None,
                    token_ids=list(tokens[run_start * bs:i * bs]),
                    block_size=bs, lora_id=alloc.lora_id, lora_name=alloc.lora_name))
                run_start = None
        alloc.committed = end

    def free(self, alloc: Allocation) -> None:
        """Drop the request's references; idle blocks rejoin the free queue."""
        free = self._free
        for block in reversed(alloc.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = None
                if block.block_hash is None:
                    free.move_to_end(block.block_id, last=False)
        alloc.blocks = []

    def reset(self) -> None:
        """Forget every cached hash (vLLM's reset_prefix_cache); running requests keep their blocks."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._emit(AllBlocksCleared())

    def _emit(self, event: KVEvent) -> None:
        if self._sink is not None:
            self._sink(event)
