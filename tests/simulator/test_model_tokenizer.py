"""The simulator counting with a model's tokenizer.json (`prefix-epp sim --tokenizer`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from extproc.tokenization.tokenizer_json import HFTokenizer
from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.engine import Engine, SimRequest
from prefix_epp_sim.kvcache import KVCache
from prefix_epp_sim.openai_api import parse_generation, tokenize_body

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = "the of and to in is you that it he was for on are as with his they at be this have from or one"


def byte_level_bpe(tmp: Path) -> Path:
    """A byte-level BPE with a BOS post-processor and a ChatML template, as testkit/tiny_model.py writes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp / "tokenizer.json"
    tok.save(str(path))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>"}))
    return path


def test_prompts_are_the_models_token_ids(tmp_path: Path) -> None:
    path = byte_level_bpe(tmp_path)
    cfg = SimConfig(tokenizer=str(path), kv_events=False)
    model = HFTokenizer(str(path))
    prompt = "the quick brown fox is on the stone bridge"
    gen = parse_generation({"model": cfg.model, "prompt": prompt}, "completion", cfg)
    assert gen.prompt_tokens == model.encode_text(prompt, False) and gen.prompt_tokens[0] == 0  # BOS
    messages = [{"role": "system", "content": "you are the one"}, {"role": "user", "content": prompt}]
    chat = parse_generation({"model": cfg.model, "messages": messages}, "chat", cfg)
    assert chat.prompt_tokens == model.encode_text(model.render(messages, True), True) and chat.prompt_tokens[0] != 0
    assert tokenize_body({"messages": messages}, cfg)["tokens"] == chat.prompt_tokens
    builtin = parse_generation({"model": cfg.model, "prompt": prompt}, "completion", SimConfig(kv_events=False))
    assert builtin.prompt_tokens != gen.prompt_tokens


async def test_an_answer_sent_back_in_the_history_hits_the_generated_blocks(tmp_path: Path) -> None:
    path = byte_level_bpe(tmp_path)
    cfg = SimConfig(tokenizer=str(path), kv_events=False, time_scale=200.0, kv_cache_blocks=512, block_size=16,
                    max_model_len=4096)
    eng = Engine(cfg, KVCache(cfg.kv_cache_blocks, cfg.block_size))
    eng.start()
    try:
        history = [{"role": "user", "content": "the of and to in is you that it he was for " * 8}]
        first_gen = parse_generation({"model": cfg.model, "messages": history, "max_tokens": 60}, "chat", cfg)
        first = SimRequest(first_gen.prompt_tokens, 60)
        eng.submit(first)
        await asyncio.wait_for(first.done.wait(), 10)
        answer = eng.filler.text(0, 60)
        assert HFTokenizer(str(path)).encode_text(answer, True) == eng.filler.ids(60)  # the answer round-trips
        follow = [*history, {"role": "assistant", "content": answer}, {"role": "user", "content": "and you"}]
        gen = parse_generation({"model": cfg.model, "messages": follow, "max_tokens": 2}, "chat", cfg)
        assert gen.prompt_tokens[:len(first.prompt_tokens) + 60] == first.prompt_tokens + eng.filler.ids(60)
        second = SimRequest(gen.prompt_tokens, 2)
        eng.submit(second)
        await asyncio.wait_for(second.done.wait(), 10)
        # Prompt and answer are cached but the answer's last token (sampled, never computed).
        assert second.cached_tokens == (len(first.prompt_tokens) + 59) // 16 * 16 > len(first.prompt_tokens)
    finally:
        await eng.close()
