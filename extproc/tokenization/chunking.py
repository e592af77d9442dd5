"""The builtin tokenizer in cached chunks, cooperative off the event loop (what precise mode awaits).

`chunk_bounds` cuts a text into chunks of about `CHUNK_CHARS` (2048) characters, only at a space
that starts a word after a non-space character, where no piece of extproc/tokenization/builtin.py
can straddle the cut, so the chunks' ids equal the whole text's. `BuiltinTokenizer` remembers each
chunk's ids in an LRU (`CHUNK_CACHE_ENTRIES`, 4096 chunks, ids as uint32 arrays, ~8 KB each at
most) keyed by the chunk's xxh3 hash: a shared system prompt or an earlier turn is tokenized once.
`encode_async` yields to the event loop between two chunks it had to encode. After a chunk it
had to encode it asks `more` (extproc/tokenization/local.py) and stops where it says so: a chunk
from the cache costs little to keep going, and a prompt turns new where its chunks stop being
cached, so asking after every cached chunk too only keyed the prompt in small pieces (at 32k
cached tokens, ~100 asks a prompt, 0.6 ms more a decision than keying it once).
"""

from __future__ import annotations

import asyncio
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator

import xxhash

from extproc.request.openai import ParsedRequest
from extproc.tokenization.builtin import encode
from extproc.tokenization.local import LocalTokenizer, More

CHUNK_CHARS = 2048
CHUNK_CACHE_ENTRIES = 4096
# A space preceded by a non-space and followed by a letter: every builtin piece ends before it.
_SAFE_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


def chunk_bounds(text: str, size: int = CHUNK_CHARS) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive chunks of about `size` characters, cut only at safe spaces."""
    start, n = 0, len(text)
    while n - start > size:
        m = _SAFE_CUT.search(text, start + size)
        if m is None:
            break
        yield start, m.start()
        start = m.start()
    if start < n:
        yield start, n


class ChunkCache:
    """Token ids of text chunks in an LRU keyed by the chunk's xxh3 hash, stored as uint32 arrays.

    A lock guards it: the worker thread of `encode_async` and an in-process caller may both encode.
    """

    def __init__(self, capacity: int = CHUNK_CACHE_ENTRIES) -> None:
        self._entries: OrderedDict[int, array[int]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.misses = 0  # chunks encoded, for tests and benchmarks

    def __len__(self) -> int:
        return len(self._entries)

    def extend(self, out: list[int], text: str, encode_piece: Callable[[str], list[int]],
               more: More | None = None) -> bool:
        """Append the ids of `text`, chunk by chunk, to `out`; after each chunk it had to encode,
        but the last, ask `more` and stop where it says no (then True: `out` holds a prefix)."""
        n = len(text)
        for start, end in chunk_bounds(text):
            misses = self.misses
            out.extend(self.ids(text[start:end], encode_piece))
            if more is not None and end < n and self.misses != misses and not more(out, end, n):
                return True
        return False

    def ids(self, piece: str, encode_piece: Callable[[str], list[int]]) -> array[int]:
        key = xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass"))
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
                return ids
        ids = array("I", encode_piece(piece))
        with self._lock:
            self.misses += 1
            self._entries[key] = ids
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return ids


class BuiltinTokenizer(LocalTokenizer):
    """extproc/tokenization/builtin.py in cached chunks; cooperative off-loop encoding (module docstring)."""

    name = "builtin"

    def __init__(self, cache_entries: int = CHUNK_CACHE_ENTRIES) -> None:
        self._cache = ChunkCache(cache_entries)

    @property
    def chunks_encoded(self) -> int:
        """Cache misses so far (tests and benchmarks)."""
        return self._cache.misses

    def _chunk(self, piece: str) -> array[int]:
        return self._cache.ids(piece, encode)

    def encode_text(self, text: str, chat: bool, more: More | None = None) -> list[int]:
        out: list[int] = []
        self._cache.extend(out, text, encode, more)
        return out

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0,
                           more: More | None = None) -> list[int] | None:
        source = self._source(parsed, max_tokens)
        if not isinstance(source, tuple):
            return source
        text = source[0]
        n = len(text)
        out: list[int] = []
        for start, end in chunk_bounds(text):
            misses = self.chunks_encoded
            out.extend(self._chunk(text[start:end]))
            if max_tokens > 0 and len(out) >= max_tokens:
                return out[:max_tokens]
            if self.chunks_encoded != misses:
                if more is not None and end < n and not more(out, end, n):
                    return out  # the rest cannot change the lookup (extproc/kvevents/lookahead.py)
                await asyncio.sleep(0)  # let other streams run between two encoded chunks
        return out
