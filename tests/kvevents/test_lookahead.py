"""Tokenizing for the precise lookup stops at the first block no endpoint holds (kvevents/lookahead.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import orjson

from extproc.config.settings import EppConfig, KVEventsConfig
from extproc.control.director import RequestContext
from extproc.core.datastore import EndpointSpec, ModelServerMetrics
from extproc.kvevents.keys import KeyChain, chain_keys, key_seed
from extproc.kvevents.lookahead import HeldPrefix
from extproc.kvevents.wire import Stored
from extproc.request.openai import Api, parse_request
from extproc.runtime.app import App
from extproc.tokenization.builtin import encode
from extproc.tokenization.chunking import CHUNK_CHARS, BuiltinTokenizer, chunk_bounds
from testkit.kvevents import heard_from

BLOCK = 16
WORDS = ["the ", "model ", "server ", "keeps ", "each ", "block ", "of ", "sixteen ", "tokens ", "it ", "computed ",
         "until ", "memory ", "runs ", "out "]


def prose(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    n = 0
    while n < chars:
        out.append(rng.choice(WORDS) + rng.choice(WORDS).upper())
        n += len(out[-1])
    return "".join(out)


def test_a_key_chain_extended_step_by_step_equals_chain_keys() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(50_000) for _ in range(1_000)]
    for max_blocks in (0, 7):
        chain = KeyChain(BLOCK, 99, max_blocks)
        at = 0
        while at < len(tokens):
            at = min(len(tokens), at + rng.randrange(1, 90))
            chain.extend(tokens[:at])
            assert chain.keys == chain_keys(tokens[:at], BLOCK, 99, max_blocks)


async def test_tokenizing_stops_after_the_chunk_whose_last_block_nobody_holds() -> None:
    text = prose(1, 12 * CHUNK_CHARS)
    full = encode(text)
    keys = chain_keys(full, BLOCK, 7)
    held = set(keys[: len(keys) // 3])  # the first third of the prompt is cached somewhere
    parsed = parse_request(Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": text}))
    more = HeldPrefix(KeyChain(BLOCK, 7), held.__contains__)
    ids = await BuiltinTokenizer().encode_async(parsed, 0, more)
    assert ids is not None and more.stopped
    assert ids == full[: len(ids)] and len(full) // 3 < len(ids) < len(full) // 3 + 2 * CHUNK_CHARS // 3
    # The tokens kept reach past the last held block: the lookup sees every block anyone holds.
    assert more.keys(ids)[: len(held)] == keys[: len(held)] and keys[len(held)] in more.keys(ids)
    assert abs(more.estimated_tokens - len(full)) < 0.05 * len(full)
    assert abs(more.blocks - len(keys)) < 0.05 * len(keys)
    # All held: nothing stops, and the keys are the whole prompt's.
    everything = HeldPrefix(KeyChain(BLOCK, 7), set(keys).__contains__)
    ids = await BuiltinTokenizer().encode_async(parsed, 0, everything)
    assert ids == full and not everything.stopped and everything.keys(ids) == keys and everything.blocks == len(keys)


async def test_only_chunks_that_had_to_be_encoded_are_followed_by_a_question() -> None:
    """A chunk from the cache costs little to keep going: only encoded ones are asked about."""
    text = prose(6, 6 * CHUNK_CHARS)
    parsed = parse_request(Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": text}))
    asked: list[int] = []

    def more(ids: Sequence[int], done: int, total: int) -> bool:
        asked.append(done)
        return True

    tok = BuiltinTokenizer()
    await tok.encode_async(parsed, 0, more)
    assert len(asked) == len(list(chunk_bounds(text))) - 1  # every chunk but the last, all encoded
    asked.clear()
    assert await tok.encode_async(parsed, 0, more) == encode(text) and asked == []  # all from the cache


def precise_app(endpoints: int) -> App:
    cfg = replace(EppConfig(seed=1, kv_events=KVEventsConfig(prefix_scorer="precise")),
                  metrics_staleness_threshold_s=1e9)
    app = App(cfg)
    app.datastore.set_endpoints(EndpointSpec(f"10.0.0.{i}", 8000) for i in range(1, endpoints + 1))
    for ep in app.datastore.snapshot():
        app.datastore.set_metrics(ep.key, ModelServerMetrics(running=1, block_size=BLOCK, num_gpu_blocks=4096,
                                                             ok=True))
    assert app.kv_events is not None
    heard_from(app.kv_events, [ep.key for ep in app.datastore.snapshot()], app.kv_events.now())
    return app


async def test_a_decision_on_a_prompt_tokenized_in_part_matches_and_records_the_whole() -> None:
    app = precise_app(4)
    manager = app.kv_events
    assert manager is not None
    system = prose(2, 6 * CHUNK_CHARS)
    first = system + prose(3, 4 * CHUNK_CHARS)
    # The engine of 10.0.0.3 has computed an earlier request with the same system prompt.
    stored = encode(first)
    n = len(stored) // BLOCK * BLOCK
    manager.index.apply(("10.0.0.3:8000", 0), Stored(list(range(1, n // BLOCK + 1)), None, stored[:n], BLOCK))
    prompt = system + prose(4, 4 * CHUNK_CHARS)
    full = encode(prompt)
    full_keys = chain_keys(full, BLOCK, key_seed(None))
    ctx = RequestContext(path="/v1/completions", request_id="r1")
    body = orjson.dumps({"model": "m", "prompt": prompt})
    await app.director.prepare(ctx, body)
    assert ctx.tokens is not None and ctx.lookahead is not None and ctx.lookahead.stopped
    assert ctx.tokens == full[: len(ctx.tokens)] and len(ctx.tokens) < 0.8 * len(full)
    decision = app.director.route(ctx, body)
    # What the whole prompt's keys would have matched: the system prompt's blocks, on 10.0.0.3.
    shared = manager.index.match(full_keys, [ep.key for ep in app.datastore.snapshot()], 0.0)
    assert decision.primary.key == "10.0.0.3:8000" and decision.precise_matched == shared["10.0.0.3:8000"]
    assert abs(decision.precise_total - len(full_keys)) < 0.05 * len(full_keys)
    # After the answer the rest is tokenized and the whole prompt becomes speculative on the pick.
    while app.director.finishing:
        await asyncio.sleep(0)
    assert manager.match(full_keys, ["10.0.0.3:8000"])[0] == {"10.0.0.3:8000": len(full_keys)}


async def test_closing_the_director_cancels_the_prompts_still_being_keyed() -> None:
    app = precise_app(2)
    prompt = prose(5, 8 * CHUNK_CHARS)
    ctx = RequestContext(path="/v1/completions", request_id="r2")
    body = orjson.dumps({"model": "m", "prompt": prompt})
    await app.director.prepare(ctx, body)
    assert ctx.lookahead is not None and ctx.lookahead.stopped  # nobody holds anything: one chunk
    app.director.route(ctx, body)
    pending = set(app.director.finishing)
    assert pending
    await app.director.close()
    assert all(t.cancelled() for t in pending) and not app.director.finishing


async def test_keying_after_the_answer_is_bounded_and_skips_an_endpoint_that_left(monkeypatch: Any) -> None:
    import extproc.control.director as director_module

    monkeypatch.setattr(director_module, "MAX_KEYING", 1)
    app = precise_app(2)
    manager = app.kv_events
    assert manager is not None
    prompts = [prose(10 + i, 6 * CHUNK_CHARS) for i in range(2)]
    decisions = []
    for i, prompt in enumerate(prompts):
        ctx = RequestContext(path="/v1/completions", request_id=f"r{i}")
        body = orjson.dumps({"model": "m", "prompt": prompt})
        await app.director.prepare(ctx, body)
        decisions.append(app.director.route(ctx, body))
    assert len(app.director.finishing) == 1  # the second prompt found the one place taken
    monkeypatch.setattr(director_module, "MAX_KEYING", 2)
    monkeypatch.setattr(director_module, "MAX_KEYING_BYTES", len(prompts[0]) + 100)
    ctx = RequestContext(path="/v1/completions", request_id="r2")
    body = orjson.dumps({"model": "m", "prompt": prose(12, 6 * CHUNK_CHARS)})
    await app.director.prepare(ctx, body)
    app.director.route(ctx, body)
    assert len(app.director.finishing) == 1  # a place, but not the bytes
    chosen = decisions[0].primary.key
    app.datastore.remove(chosen)
    while app.director.finishing:
        await asyncio.sleep(0)
    # No slot is made again for the endpoint gone from the pool (its entries were purged with it),
    # and the prompt that found no place keeps only the keys made before its answer.
    assert chosen not in manager.index._speculative
    keys = chain_keys(encode(prompts[1]), BLOCK, key_seed(None))
    other = decisions[1].primary.key
    assert other != chosen and 0 < manager.match(keys, [other])[0][other] < len(keys) // 2
