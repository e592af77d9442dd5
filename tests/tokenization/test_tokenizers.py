"""Tokenization parity with the simulator, the Hugging Face and remote tokenizers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from extproc.core.datastore import Datastore, EndpointSpec
from extproc.kvevents.keys import chain_keys, key_seed
from extproc.request.openai import Api, parse_request
from extproc.tokenization.chunking import BuiltinTokenizer
from extproc.tokenization.factory import make_tokenizer
from extproc.tokenization.remote import RemoteTokenizer
from extproc.tokenization.tokenizer_json import HFTokenizer
from prefix_epp_sim.kvcache import block_hash_seed, hash_blocks
from prefix_epp_sim.openai_api import parse_generation
from testkit.kvevents import SIM, events_stack, post, sim_blocks, wait_for

SYSTEM = "You are a careful assistant. Answer briefly and cite the manual. " * 6
CHAT = {"model": "sim-model", "max_tokens": 4, "messages": [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": [{"type": "text", "text": "What is the refund policy for "},
                                 {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                                 {"type": "text", "text": " damaged items?"}]},
    {"role": "assistant", "content": None},
    {"role": "user", "content": "And for 2,048 items, shipped abroad?"}]}
COMPLETION = {"model": "sim-model", "max_tokens": 4, "prompt": "Summarise: " + "the quick brown fox " * 40}
CASES = [(Api.CHAT, "/v1/chat/completions", "chat", CHAT), (Api.COMPLETIONS, "/v1/completions", "completion",
                                                               COMPLETION)]


@pytest.mark.parametrize(("api", "path", "kind", "body"), CASES)
async def test_picker_blocks_equal_the_simulators(api: Api, path: str, kind: str, body: dict[str, Any]) -> None:
    parsed = parse_request(api, orjson.dumps(body))
    tokens = BuiltinTokenizer().encode(parsed)
    assert tokens == parse_generation(body, kind, SIM).prompt_tokens  # type: ignore[arg-type]
    # Same block boundaries: one key per full block, exactly where the engine hashes one.
    engine = hash_blocks(tokens, SIM.block_size, block_hash_seed("sim-model"))
    assert len(chain_keys(tokens, SIM.block_size, key_seed(None))) == len(engine) == len(tokens) // 16 >= 7
    async with events_stack() as ev:
        rep, m = ev.replicas[0], ev.manager
        await post(rep, path, body)
        keys = m.keys_for("sim-model", "", tokens)
        assert keys is not None and len(keys) == len(engine)
        # The keys derived from the engine's BlockStored.token_ids are the request's keys.
        await wait_for(lambda: m.index.match(keys, [ev.key()], m.now()).get(ev.key()) == len(keys))
        assert rep.cache.match_prefix(engine) == len(engine)
        remote = RemoteTokenizer(ev.datastore, 1.0)
        try:
            assert await remote.encode_async(parsed) == tokens  # the engine's own POST /tokenize agrees
        finally:
            await remote.close()
        assert sim_blocks(rep, "unrelated prompt " * 20) == 0


def test_requests_without_a_tokenizable_prompt_give_none() -> None:
    tok = BuiltinTokenizer()
    batch = parse_request(Api.COMPLETIONS, b'{"model": "m", "prompt": ["a", "b"]}')
    ids = parse_request(Api.COMPLETIONS, b'{"model": "m", "prompt": [[5, 6, 7]]}')
    bad_chat = parse_request(Api.CHAT, b'{"model": "m", "messages": [{"content": "no role"}]}')
    embeddings = parse_request(Api.EMBEDDINGS, b'{"model": "m", "input": "x"}')
    assert tok.encode(batch) is None and tok.encode(bad_chat) is None and tok.encode(embeddings) is None
    assert tok.encode(ids) == [5, 6, 7]


def write_hf_tokenizer(tmp: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<s>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "hello": 4, "world": 5, "user": 6,
             "assistant": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    if template is not None:
        (tmp / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    return path


def test_hugging_face_tokenizer_file(tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    path = write_hf_tokenizer(tmp_path, template)
    tok = make_tokenizer(str(path), Datastore(), 0.1)
    assert isinstance(tok, HFTokenizer)
    completion = parse_request(Api.COMPLETIONS, b'{"model": "m", "prompt": "hello world"}')
    assert tok.encode(completion) == [1, 4, 5]  # the tokenizer's BOS, as vLLM adds for completions
    chat = parse_request(Api.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}')
    assert tok.has_model_template and tok.encode(chat) == [0, 6, 0, 4]  # "[", "user", "]", "hello"
    with pytest.raises(ValueError, match="no such file"):
        make_tokenizer(str(tmp_path / "missing.json"), Datastore(), 0.1)


def test_chat_template_from_its_own_file_and_the_builtin_one_without(tmp_path: Path) -> None:
    """A model that ships chat_template.jinja (transformers' layout) renders with it; one without any
    template renders the builtin ChatML template, encoded without a BOS."""
    chat = parse_request(Api.CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}')
    bare = HFTokenizer(str(write_hf_tokenizer(tmp_path, None)))
    assert not bare.has_model_template and bare.encode(chat) == [2, 6, 4, 3, 2, 7]
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}")
    shipped = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert shipped.has_model_template and shipped.encode(chat) == [0, 6, 0, 4]


async def test_remote_tokenizer_times_out_quickly_and_gives_none() -> None:
    import socket

    with socket.socket() as s:  # accepts connections, never answers
        s.bind(("127.0.0.1", 0))
        s.listen()
        ds = Datastore()
        ds.set_endpoints([EndpointSpec("127.0.0.1", s.getsockname()[1])])
        remote = RemoteTokenizer(ds, 0.1)
        start = time.monotonic()
        try:
            assert await remote.encode_async(parse_request(Api.COMPLETIONS, orjson.dumps(COMPLETION))) is None
        finally:
            await remote.close()
        assert time.monotonic() - start < 5.0 and remote.failures == 1  # not waiting for an answer


def test_long_prompts_tokenize_only_a_prefix_with_identical_ids() -> None:
    import random

    rng = random.Random(3)
    pieces = ["word", " supercalifragilistic", "   ", "\n\n", "12345", "!?!?!", "____", " é", "<|im_end|>", "\t "]
    text = "".join(rng.choice(pieces) for _ in range(20_000))
    tok = BuiltinTokenizer()
    full = tok.encode(parse_request(Api.COMPLETIONS, orjson.dumps({"model": "m", "prompt": text})))
    assert full is not None and len(full) > 2000
    for max_tokens in (1, 37, 500, 1999):
        body = orjson.dumps({"model": "m", "prompt": text})
        assert tok.encode(parse_request(Api.COMPLETIONS, body), max_tokens) == full[:max_tokens]
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})
    whole = tok.encode(parse_request(Api.CHAT, chat))
    assert whole is not None and tok.encode(parse_request(Api.CHAT, chat), 300) == whole[:300]


def test_content_parts_reach_the_template_as_vllm_hands_them(tmp_path: Path) -> None:
    """A template that prints `m.content` gets the text parts joined with a newline (vLLM's
    "string" format); one that loops over the parts gets them; tools reach it when present."""
    parts = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]})
    chat = parse_request(Api.CHAT, parts)
    assert chat.chat is not None
    string = HFTokenizer(str(write_hf_tokenizer(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")))
    assert string.render(*chat.chat) == "hello\nworld"
    loops = "{% for m in messages %}{% for p in m['content'] %}<{{ p.text }}>{% endfor %}{% endfor %}{{ tools }}"
    (tmp_path / "tokenizer_config.json").unlink(missing_ok=True)
    (tmp_path / "chat_template.jinja").write_text(loops)
    iterating = HFTokenizer(str(write_hf_tokenizer(tmp_path, None)))
    assert iterating.render(*chat.chat, [{"type": "function"}]) == "<hello><world>[{'type': 'function'}]"
