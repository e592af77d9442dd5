"""Our block keys: the one hash function for request tokens and for `BlockStored.token_ids`.

    key(block i) = xxh64(uint32-LE token ids of block i, seed = key(block i-1))
    key(block -1) = key_seed(lora_name)  (the chain root; base model: lora_name None)

Only full blocks of `block_size` tokens get a key, as only full blocks are reused by vLLM. Keys
are ours, not the engine's: an event's blocks are re-hashed from its `token_ids`, chained from the
key its `parent_block_hash` maps to, so the engine's hash algorithm and `PYTHONHASHSEED` never
need to match ours (llm-d's "dual-key" design). Using the parent key as the xxh64 seed hashes each
block in place, without concatenating bytes. `KeyChain` keys a token list that grows (a prompt
tokenized chunk by chunk) block by block, with the same keys as `chain_keys` over the whole list.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

_digest = xxhash.xxh64_intdigest
_SEEDS: dict[str | None, int] = {}


def key_seed(lora_name: str | None) -> int:
    """Chain root for the base model (None) or a LoRA adapter: adapters never share blocks."""
    seed = _SEEDS.get(lora_name)
    if seed is None:
        seed = _digest(b"prefix-epp/kv\x00" + (lora_name or "").encode("utf-8"))
        _SEEDS[lora_name] = seed
    return seed


def chain_keys(tokens: Sequence[int], block_size: int, parent: int, max_blocks: int = 0) -> list[int]:
    """Keys of the full blocks of `tokens`, chained from `parent` (at most `max_blocks` if > 0).

    Raises ValueError for a token id outside [0, 2**32) or a non-positive block size.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(tokens) // block_size
    if max_blocks > 0:
        n = min(n, max_blocks)
    if n == 0:
        return []
    try:
        packed = array("I", tokens[: n * block_size] if len(tokens) != n * block_size else tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    data = memoryview(packed).cast("B")
    width = block_size * 4
    out: list[int] = []
    for off in range(0, n * width, width):
        parent = _digest(data[off:off + width], parent)
        out.append(parent)
    return out


class KeyChain:
    """`chain_keys` of a token list that grows: each `extend` keys the full blocks not keyed yet.

    `keys` equals `chain_keys(tokens, block_size, root, max_blocks)` of the longest list extended so far.
    """

    __slots__ = ("_root", "block_size", "keys", "max_blocks")

    def __init__(self, block_size: int, root: int, max_blocks: int = 0) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size, self.max_blocks, self._root = block_size, max_blocks, root
        self.keys: list[int] = []

    def extend(self, tokens: Sequence[int]) -> list[int]:
        """Keys of `tokens`' full blocks past those keyed already (`tokens` starts with the tokens
        extended before: the same prompt, longer), appended to `keys` and returned."""
        keys, size = self.keys, self.block_size
        done = len(keys)
        end = len(tokens) // size
        if self.max_blocks > 0:
            end = min(end, self.max_blocks)
        if end <= done:
            return []
        new = chain_keys(tokens[done * size:end * size], size, keys[-1] if keys else self._root)
        keys.extend(new)
        return new
