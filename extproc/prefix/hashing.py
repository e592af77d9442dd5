"""Chained 64-bit xxhash over prompt blocks, aligned to segment starts.

Algorithm:
- seed = xxh64(model + "\\x00" + cache_salt): requests for different models, LoRA adapters or cache
  salts never share a block, as on the engine.
- Each segment (see extproc/request/openai.py) is cut into blocks of `block_size` bytes (`--prefix-block-size`,
  64 by default: ~16 tokens); the segment's last block may be shorter. Blocks never straddle two segments.
- h_i = xxh64(block_i, seed=h_{i-1}), h_{-1} = seed. Chaining makes h_i identify the whole prefix
  up to block i, so equal hashes at position i mean equal prefixes.
- At most `max_blocks` hashes are produced (`--prefix-max-blocks`; the rest of a long prompt does
  not change routing).

Affinity hints (extproc/control/affinity.py) hash to xxh64(model \\x00 cache_salt \\x00 "affinity"
\\x00 key): the same model/salt separation as the seed, in a domain of its own, apart from the prompt's block
hashes even when the key's text equals the prompt's first block.

Why segment alignment: successive turns of a conversation append messages. Because each message
starts a new block, turn k's hashes are exactly the first hashes of turn k+1, including the short
tail block of its last message; fixed offsets over the concatenation would instead hash that tail
together with the next turn's text. Completions have one segment, so this is plain fixed-size
chunking. Using the previous hash as the xxh64 seed (rather than appending it to the block) hashes
each block as it is, without joining the hash to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

_xxh64 = xxhash.xxh64_intdigest


def prefix_seed(model: str, cache_salt: str = "") -> int:
    return _xxh64(f"{model}\x00{cache_salt}".encode())


def affinity_hash(model: str, cache_salt: str, key: str) -> int:
    return _xxh64(f"{model}\x00{cache_salt}\x00affinity\x00{key}".encode())


def block_hashes(
    segments: Sequence[bytes], model: str, cache_salt: str = "", *, block_size: int, max_blocks: int
) -> list[int]:
    """Chained block hashes of the prompt segments (see module docstring); the caller passes the
    configured `block_size` and `max_blocks` (PrefixConfig.block_size_bytes, .max_prefix_blocks)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    h = prefix_seed(model, cache_salt)
    out: list[int] = []
    append, hash_block = out.append, _xxh64
    left = max_blocks
    for seg in segments:
        n = len(seg)
        blocks = -(-n // block_size)
        if blocks > left:
            n, blocks = left * block_size, left
        # A bytes slice per block: cheaper than a memoryview slice (~30% of the loop at 8k tokens).
        for start in range(0, n, block_size):
            h = hash_block(seg[start:start + block_size], h)
            append(h)
        left -= blocks
        if left <= 0:
            break
    return out
