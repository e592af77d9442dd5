"""Tokenization: request -> prompt token ids, as the model server computes them (for the precise index).

Files: `builtin` (the deterministic tokenizer shared with the simulator), `local` (what of a request is
encoded, prefix truncation), `chunking` (the builtin tokenizer in cached chunks, off the event loop),
`tokenizer_json` (a Hugging Face tokenizer.json and its chat template), `remote` (the engine's
/tokenize), `factory` (`--tokenizer` -> one of them).

`--tokenizer` (KVEventsConfig.tokenizer):
- `builtin` (default): extproc/tokenization/builtin.py and its fixed ChatML-like chat template, the exact
  tokenizer of the simulator.
- `/path/to/tokenizer.json`: a Hugging Face `tokenizers` file. Completions are encoded with the
  tokenizer's special tokens (BOS), as vLLM does; chat requests are rendered first, then encoded
  without adding special tokens. The template is the model's own, beside the file
  (`chat_template` in `tokenizer_config.json`, else `chat_template.jinja`); a model without one
  renders with the builtin ChatML template (`<|im_start|>role\\ncontent<|im_end|>\\n`, then the
  generation prompt).
- `remote`: the model server's `POST /tokenize` (vLLM: `{"model", "prompt"}` or `{"model",
  "messages", "add_generation_prompt"}` -> `{"tokens"}`), asked of the endpoints in turn, with a
  timeout of `--tokenizer-timeout` (100 ms). It is asynchronous: the director awaits it before
  scheduling (`Director.prepare`), the event loop keeps running meanwhile.
- `render`: vLLM's render endpoints (`/v1/completions/render`, `/v1/chat/completions/render`,
  `/v1/messages/render`, `/v1/responses/render`), sent the request body as the client sent it:
  the tokens the engine itself would execute, for every shape, whatever its chat template or
  conversion rules; asynchronous like `remote`, with the same timeout and fallback.

What is tokenized: a completions `prompt` (a string, a list of token ids, or a one-element list of
either), chat `messages` (with `add_generation_prompt`, default true, and `tools`) and `/v1/messages`
as the chat request vLLM converts it to. Anything else, a batch of prompts, or a tokenizer error
gives None: the request is then scored by the approximate index.

Off the event loop (`encode_async`, what the director awaits in precise mode): the builtin
tokenizer encodes in chunks of about `CHUNK_CHARS` (2048) characters cut at a space that starts a
word after a non-space character, where no token piece of extproc/tokenization/builtin.py can straddle the
cut, so the ids equal the whole text's; between two chunks it yields to the event loop, and each
chunk's ids are remembered in an LRU (`CHUNK_CACHE_ENTRIES`, 4096 chunks, ids as uint32 arrays,
~8 KB each at most), keyed by the chunk's xxh3 hash: a shared system prompt or an earlier turn of
a conversation is tokenized once, later requests only pay for their new text. A Hugging Face
tokenizer releases the GIL, so it runs in a worker thread.

Only the first `max_tokens` tokens matter (the precise lookup stops at `--kv-events-max-blocks`
blocks): local tokenizers encode a prefix of a longer text, first `max_tokens * 6` characters, then
`max_tokens * 16`, and keep the first `max_tokens` ids once a prefix yields `TRUNCATION_MARGIN` (8)
more than that, so the tokens near the cut are never kept; otherwise the whole text. Token
boundaries far from the cut do not depend on it (a builtin token spans at most 16 characters and
looks one character ahead), so the result equals the whole text's first `max_tokens` ids.
"""
