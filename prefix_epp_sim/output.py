"""What the simulated model generates: the same filler sentence for every request.

`filler_for(config)` gives the `Filler` of the configured tokenizer. With the builtin tokenizer each
generated token is one word piece of the sentence (" quick"), so `encode(text(0, n))` has n tokens.
With a model's tokenizer.json (`SimConfig.tokenizer`) the sentence is encoded once with it and a
generated token is one of those ids, its text the tokenizer's decoding of them: re-encoding an
answer that comes back in a later prompt (a chat history) gives the ids the engine cached, as with
a real engine whose answer round-trips through its byte-level tokenizer.
"""

from __future__ import annotations

import functools

from extproc.tokenization.builtin import encode
from prefix_epp_sim.config import SimConfig

_WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
    "quietly", "box", "jumbo", "crates", "of", "fresh", "kiwi", "and", "plum", "near", "an", "old",
    "stone", "bridge", "under", "morning", "light",
)


def _piece(i: int) -> str:
    word = _WORDS[i % len(_WORDS)]
    return word.capitalize() if i == 0 else " " + word


class Filler:
    """Generated token ids and their text, grown on demand (builtin tokenizer: one piece per id)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._ids: list[int] = []

    def _grow(self, n: int) -> None:
        while len(self._pieces) < n:
            piece = _piece(len(self._pieces))
            self._pieces.append(piece)
            self._ids.extend(encode(piece))

    def ids(self, n: int) -> list[int]:
        """Token ids of the first n generated tokens (the same for every request)."""
        self._grow(n)
        return self._ids[:n]

    def text(self, start: int, end: int) -> str:
        """Text of generated tokens [start, end)."""
        self._grow(end)
        return "".join(self._pieces[start:end])


class ModelFiller(Filler):
    """The filler sentence in a model tokenizer's ids; text by decoding them."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self._words = 0

    def _grow(self, n: int) -> None:
        while len(self._ids) < n:  # encode a longer sentence; its leading ids do not change
            self._words = max(2 * self._words, n + len(_WORDS))
            text = "".join(_piece(i) for i in range(self._words))
            self._ids = self._tok.encode(text, add_special_tokens=False).ids

    def text(self, start: int, end: int) -> str:
        self._grow(end)
        decoded: str = self._tok.decode(self._ids[start:end], skip_special_tokens=True)
        return decoded


@functools.lru_cache(maxsize=4)
def _model_filler(path: str) -> ModelFiller:
    return ModelFiller(path)


_BUILTIN = Filler()


def filler_for(config: SimConfig) -> Filler:
    return _model_filler(config.tokenizer) if config.tokenizer else _BUILTIN


def output_token_ids(n: int) -> list[int]:
    """The builtin tokenizer's ids of the first n generated tokens."""
    return _BUILTIN.ids(n)


def output_text(start: int, end: int) -> str:
    """The builtin tokenizer's text of generated tokens [start, end): `encode(output_text(0, n))` has n tokens."""
    return _BUILTIN.text(start, end)
