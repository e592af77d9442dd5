"""How much of a prompt the precise lookup needs tokenized: up to the first block no endpoint holds.

The precise lookup matches each endpoint's leading run of the prompt's token blocks
(extproc/kvevents/index.py), so no endpoint matches past the first block that none holds, in its
engine's events or as a speculative entry: the tokens after it cannot change the match. A chunked
tokenizer (extproc/tokenization/chunking.py, tokenizer_json.py) asks `HeldPrefix`, after each
chunk it had to encode (one from its cache costs little to keep going), whether to go on: it keys
the chunk's new full blocks (`KeyChain`) and answers no once the last of them is held nowhere.
One lookup a chunk, not one a block (each a likely cache miss in a map of millions of keys): a
block held nowhere before a held last one only means one chunk more.
The decision is then made on the keys so far, with the prompt's length estimated from the share
of its text tokenized (`estimated_tokens`); the director tokenizes the rest after the answer and
makes its keys speculative entries of the chosen endpoint, as the whole prompt's keys would have
been (extproc/control/director.py). A prompt nobody holds costs the decision one chunk (about
2,048 characters) of tokenizing; one with a cached prefix, its cached chunks and one more. Where
no early stop happened (a short prompt, a tokenizer that is not chunked, a prompt given as token
ids), the keys are completed from the whole token list: the same keys as `chain_keys`.

`held` is read in the tokenizer's worker thread for tokenizer.json (a lookup of the index's
holders map; under the GIL a stale answer, never a broken one, and only the stop moves).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from extproc.kvevents.keys import KeyChain


class HeldPrefix:
    """A tokenizer's `more(ids, done_chars, total_chars)` predicate (module docstring)."""

    __slots__ = ("_held", "chain", "estimated_tokens", "stopped")

    def __init__(self, chain: KeyChain, held: Callable[[int], bool]) -> None:
        self.chain = chain
        self._held = held
        self.stopped = False  # the tokenizer stopped before the prompt's end
        self.estimated_tokens = 0  # the whole prompt's tokens, estimated where stopped

    def __call__(self, ids: Sequence[int], done_chars: int, total_chars: int) -> bool:
        """More tokens wanted? `ids`: the prompt's tokens so far, from the first `done_chars` of
        its `total_chars` characters."""
        new = self.chain.extend(ids)
        if not new or self._held(new[-1]):
            return True
        if done_chars < total_chars:
            self.stopped = True
            self.estimated_tokens = math.ceil(len(ids) * total_chars / max(done_chars, 1))
        return False

    def keys(self, tokens: Sequence[int]) -> list[int]:
        """The keys of the prompt as tokenized (`tokens`: what the tokenizer returned)."""
        self.chain.extend(tokens)  # nothing new where the tokenizer stopped at this predicate's word
        return self.chain.keys

    @property
    def blocks(self) -> int:
        """The whole prompt's full blocks: keyed, or estimated where the tokenizer stopped early."""
        keyed = len(self.chain.keys)
        if not self.stopped:
            return keyed
        estimated = self.estimated_tokens // self.chain.block_size
        cap = self.chain.max_blocks
        return max(keyed, min(estimated, cap) if cap > 0 else estimated)
