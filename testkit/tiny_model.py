"""Generate a tiny random Llama and its tokenizer, offline and seeded: `python tiny_model.py OUT_DIR`.

Runs inside the vLLM environment (testkit/vllm_env.py), which has torch, transformers and
tokenizers; it imports nothing of this repository. What it writes is what a model hub would ship:
- `tokenizer.json`: a byte-level BPE (so any text round-trips) of 2,048 entries, trained on a
  seeded stream of common English words, with `<|begin_of_text|>` prepended to every encoding (as
  Llama 3's tokenizer does) and `<|im_start|>`, `<|im_end|>` as special tokens;
- `tokenizer_config.json` and `chat_template.jinja`: a ChatML chat template
  (`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the generation prompt);
- `config.json`, `model.safetensors`: Llama with hidden size 256, 2 layers, 4 attention heads and
  2 KV heads, 16k positions, bf16, random weights (~2.6 MB). Its answers are noise; what matters
  is that vLLM runs it exactly as a real model: paged KV cache, prefix caching, KV events, metrics.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 0
TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word but "
    "not what all were we when your can said there use an each which she do how their if will up other about out "
    "many then them these so some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who oil its now find long down day did get come made may part"
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = TEXT.split()
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(2000)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=2048, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384, bos_token_id=bos,
        eos_token_id=eos, tie_word_embeddings=True, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
