"""The builtin tokenizer in cached chunks, off the event loop (extproc/tokenization/chunking.py)."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from extproc.request.openai import Api, parse_request
from extproc.tokenization.builtin import encode
from extproc.tokenization.chunking import CHUNK_CHARS, BuiltinTokenizer, chunk_bounds


def texts() -> list[str]:
    rng = random.Random(11)
    alphabet = "abcdefghij     ,.!?;:'\"()[]{}<>|_-0123456789\n\téàü漢字"
    out = ["", "a", " " * 5000, "x" * 9000, "word " * 3000, "<|im_start|>user\nhi<|im_end|>\n" * 300]
    for n in (100, 2047, 2048, 2049, 5000, 20_000):
        out.append("".join(rng.choice(alphabet) for _ in range(n)))
        out.append(" ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 14)))
                            for _ in range(n // 6)))
    return out


@pytest.mark.parametrize("text", texts(), ids=lambda t: f"{len(t)}chars")
def test_chunks_cover_the_text_and_encode_like_the_whole(text: str) -> None:
    bounds = list(chunk_bounds(text))
    assert "".join(text[a:b] for a, b in bounds) == text
    assert all(b - a >= CHUNK_CHARS or b == len(text) for a, b in bounds)
    assert BuiltinTokenizer().encode_text(text, False) == encode(text)


def test_repeated_prefixes_are_encoded_once() -> None:
    tok = BuiltinTokenizer()
    shared = " ".join(f"token{i % 97}x" for i in range(3000))  # ~27 KB, about 13 chunks
    tok.encode_text(shared + " first question", False)
    first = tok.chunks_encoded
    assert first >= 10
    assert tok.encode_text(shared + " second question", False) == encode(shared + " second question")
    assert tok.chunks_encoded - first <= 1  # only the chunk holding the new tail


def test_cache_is_bounded() -> None:
    tok = BuiltinTokenizer(cache_entries=4)
    for i in range(10):
        tok.encode_text(f"text {i} " + "lorem ipsum " * 400, False)
    assert len(tok._cache) == 4


async def test_async_encoding_equals_sync_and_yields_to_the_loop() -> None:
    tok = BuiltinTokenizer()
    prompt = " ".join(f"w{i}" for i in range(20_000))
    parsed = parse_request(Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt}))
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start_ticks = ticks
    tokens = await tok.encode_async(parsed, 0)
    done = True
    await task
    assert tokens == encode(prompt)
    assert ticks - start_ticks >= len(list(chunk_bounds(prompt))) - 1  # other tasks ran between chunks
    assert await BuiltinTokenizer().encode_async(parsed, 100) == encode(prompt)[:100]
    chat = parse_request(Api.CHAT, orjson.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}))
    assert await tok.encode_async(chat, 0) == tok.encode(chat, 0)
