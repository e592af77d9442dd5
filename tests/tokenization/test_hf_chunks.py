"""A tokenizer.json encoded in cached chunks: the same ids as the whole text, a shared prefix once."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from extproc.tokenization.chunking import CHUNK_CHARS
from extproc.tokenization.tokenizer_json import HFTokenizer, chunks_are_exact
from testkit.tiny_model import TEXT

WORDS = TEXT.split()


def byte_level_bpe(tmp: Path, use_regex: bool = True) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(1)
    tok.train_from_iterator([" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(50)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return path


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ", 42 times.\n\nThe end"


def test_only_byte_level_bpe_with_a_splitting_regex_is_chunked(tmp_path: Path) -> None:
    spec = json.loads(Tokenizer.from_file(str(byte_level_bpe(tmp_path))).to_str())
    assert chunks_are_exact(spec)
    assert not chunks_are_exact({**spec, "normalizer": {"type": "Lowercase"}})
    assert not chunks_are_exact({**spec, "pre_tokenizer": {"type": "Whitespace"}})
    assert not chunks_are_exact({**spec, "pre_tokenizer": {"type": "ByteLevel", "use_regex": False}})
    llama3 = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "x"}},
                                                   {"type": "ByteLevel", "use_regex": False}]}
    assert chunks_are_exact({**spec, "pre_tokenizer": llama3})
    assert not chunks_are_exact({**spec, "model": {"type": "Unigram"}})


def test_chunked_ids_equal_the_whole_texts_and_a_shared_prefix_is_encoded_once(tmp_path: Path) -> None:
    path = byte_level_bpe(tmp_path)
    tok, whole = HFTokenizer(str(path)), Tokenizer.from_file(str(path))
    assert tok.chunked
    rng = random.Random(7)
    system = text(rng, 3000)  # ~5 chunks
    assert len(system) > 4 * CHUNK_CHARS
    for _ in range(20):
        prompt = system + " " + text(rng, 300)
        assert tok.encode_text(prompt, False) == whole.encode(prompt).ids  # BOS ... EOS around the chunks
        assert tok.encode_text(prompt, True) == whole.encode(prompt, add_special_tokens=False).ids
    before = tok.chunks_encoded
    tok.encode_text(system + " " + text(rng, 300), False)
    assert tok.chunks_encoded - before <= 2  # the chunk holding the new tail (and the one it splits)
    assert tok.chunked


def test_a_tokenizer_whose_chunks_differ_is_caught_and_encoded_whole(tmp_path: Path) -> None:
    """No splitting regex: merges cross spaces, so chunks differ. Admitted by mistake, the first
    verification catches it and every later text is encoded whole."""
    path = byte_level_bpe(tmp_path, use_regex=False)
    tok, whole = HFTokenizer(str(path)), Tokenizer.from_file(str(path))
    assert not tok.chunked
    tok.chunked = True  # as if the gate had admitted it
    rng = random.Random(3)
    prompts = [text(rng, 2000) for _ in range(3)]
    assert [tok.encode_text(p, False) for p in prompts] == [whole.encode(p).ids for p in prompts]
    assert not tok.chunked


async def test_a_chunked_tokenizer_json_stops_where_the_lookahead_says(tmp_path: Path) -> None:
    """In the worker thread as in line: after the chunk whose last block nobody holds, a prefix of
    the whole text's ids (BOS first, no EOS), and every id where nothing stops."""
    from extproc.kvevents.keys import KeyChain, chain_keys
    from extproc.kvevents.lookahead import HeldPrefix
    from extproc.request.openai import Api, parse_request

    path = byte_level_bpe(tmp_path)
    tok, whole = HFTokenizer(str(path)), Tokenizer.from_file(str(path))
    rng = random.Random(11)
    prompt = text(rng, 6000)
    ids = whole.encode(prompt).ids
    keys = chain_keys(ids, 16, 1)
    held = set(keys[: len(keys) // 2])
    parsed = parse_request(Api.COMPLETIONS, json.dumps({"model": "m", "prompt": prompt}).encode())
    more = HeldPrefix(KeyChain(16, 1), held.__contains__)
    got = await tok.encode_async(parsed, 0, more)
    assert got is not None and more.stopped and got == ids[: len(got)] and got[0] == 0
    assert len(ids) // 2 < len(got) < len(ids) - 100
    everything = HeldPrefix(KeyChain(16, 1), set(keys).__contains__)
    assert await tok.encode_async(parsed, 0, everything) == ids and not everything.stopped
    # Capped (a prefix of the text is tried first): the estimate is still of the whole prompt.
    capped = HeldPrefix(KeyChain(16, 1), set(keys[:20]).__contains__)
    await tok.close()
    tok = HFTokenizer(str(path))  # nothing cached: every chunk is encoded, and asked about
    got = await tok.encode_async(parsed, 1000, capped)
    assert got is not None and capped.stopped and got == ids[: len(got)] and len(got) < 1000
    assert abs(capped.estimated_tokens - len(ids)) < 0.1 * len(ids)
    await tok.close()
