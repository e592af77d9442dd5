"""A Hugging Face tokenizer.json, with the model's Jinja chat template.

Completions are encoded with the tokenizer's special tokens (BOS), as vLLM does; chat requests are
rendered first, then encoded without adding special tokens. The template is found where a model
ships it, beside the file: `chat_template` in `tokenizer_config.json` (a string, or a list of named
templates of which "default" is used), else `chat_template.jinja` (what transformers writes since
4.43). It renders in jinja2's sandbox with `trim_blocks` and `lstrip_blocks`, as transformers and
vLLM render it, with the config's `bos_token` and `eos_token`, and the request's `tools` when it has
some. Content lists are handed over as vLLM hands them: a template that iterates over a message's
content parts (`for ... in message['content']`) gets the parts; any other template (vLLM's
"string" content format) gets the text parts joined with "\n". A model without a template renders
with the builtin ChatML template. (For exact tokens whatever the template and the message
normalisation, `--tokenizer render` asks the engine itself.) `tokenizers` releases the GIL, so
`encode_async` runs in a worker thread.

Cached chunks. Requests share long prefixes (a system prompt, a conversation so far), so a text
longer than CHUNK_CHARS is encoded in the chunks of extproc/tokenization/chunking.py
(`chunk_bounds`: cuts only at a space after a non-space and before a letter), each chunk's ids
remembered in a `ChunkCache`: a shared prefix is tokenized once, not once per request. That
equals encoding the whole text only where no pre-token can straddle such a cut, so it is used for
byte-level BPE tokenizers without a normalizer (GPT-2, Llama 3, Qwen, Mistral's tekken): their
pre-tokenizer regexes start a new pre-token at a space before a letter and never end one with a
space after a non-space, and BPE merges stay inside pre-tokens. The special tokens a completion's
encoding adds (BOS, or BOS and EOS) are taken from the tokenizer's own post-processor and put
around the chunks. As a guard, the first VERIFY_TEXTS chunked encodings are also encoded whole;
one difference turns chunking off for good (logged once): never a wrong token, at the cost of
those double encodings.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from extproc.request.openai import ParsedRequest
from extproc.tokenization.builtin import render_chat
from extproc.tokenization.chunking import CHUNK_CACHE_ENTRIES, CHUNK_CHARS, ChunkCache
from extproc.tokenization.local import LocalTokenizer, More, log

# vLLM's content-format detection, in short: the template loops over a message's content parts.
_ITERATES_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def _as_strings(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Messages with list content turned into its text parts joined with "\\n" (vLLM's "string" format)."""
    out: list[Mapping[str, Any]] = []
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            texts = [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out

VERIFY_TEXTS = 64


def chunks_are_exact(spec: Mapping[str, Any]) -> bool:
    """True when `chunk_bounds` cuts are pre-token boundaries of this tokenizer (module docstring)."""
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    steps = [step for step in steps if isinstance(step, Mapping)]
    kinds = [step.get("type") for step in steps]
    if not kinds or kinds[-1] != "ByteLevel" or not set(kinds) <= {"Split", "ByteLevel"}:
        return False
    # The splitting regex: a Split step before it, or ByteLevel's own (GPT-2's); without either
    # the whole text is one pre-token and merges may cross spaces.
    return "Split" in kinds or bool(steps[-1].get("use_regex", True))


def special_wrapping(tok: Any) -> tuple[list[int], list[int]] | None:
    """(ids before, ids after) the text that the post-processor adds for a completion, or None."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return full[:i], full[i + len(plain):]
    return None


class HFTokenizer(LocalTokenizer):
    """A Hugging Face tokenizer.json, with the model's Jinja chat template when jinja2 exists."""

    name = "huggingface"

    def __init__(self, path: str, cache_entries: int = CHUNK_CACHE_ENTRIES) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self._wrap = special_wrapping(self._tok)
        self.chunked = self._wrap is not None and chunks_are_exact(json.loads(self._tok.to_str()))
        self._chunks = ChunkCache(cache_entries)
        self._verify_left = VERIFY_TEXTS
        self._pool: ThreadPoolExecutor | None = None
        self._template: Any = None
        self._parts = False  # the template iterates over content parts (vLLM's "openai" format)
        self._specials: dict[str, str] = {}
        config = Path(path).with_name("tokenizer_config.json")
        cfg = json.loads(config.read_text()) if config.is_file() else {}
        self._load_template(cfg, Path(path).with_name("chat_template.jinja"))

    def _load_template(self, cfg: dict[str, Any], jinja_file: Path) -> None:
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text()
        if not isinstance(template, str):
            log.info("the tokenizer has no chat template: chat requests use the builtin ChatML template")
            return
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(template)
        self._parts = bool(_ITERATES_CONTENT.search(template))
        for key in ("bos_token", "eos_token"):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self._specials[key] = value

    @property
    def has_model_template(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               tools: Sequence[Any] | None = None) -> str:
        if self._template is None:
            return render_chat(messages, add_generation_prompt)
        # As vLLM renders: `tools` only when the request has some (templates test `if tools`).
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        shown = messages if self._parts else _as_strings(messages)
        text: str = self._template.render(messages=shown, add_generation_prompt=add_generation_prompt,
                                          **self._specials, **extra)
        return text

    @property
    def chunks_encoded(self) -> int:
        """Chunks encoded so far (cache misses; tests and benchmarks)."""
        return self._chunks.misses

    def _whole(self, text: str, chat: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=not chat).ids
        return ids

    def _piece(self, piece: str) -> list[int]:
        ids: list[int] = self._tok.encode(piece, add_special_tokens=False).ids
        return ids

    def encode_text(self, text: str, chat: bool, more: More | None = None) -> list[int]:
        if not self.chunked or len(text) <= CHUNK_CHARS or self._wrap is None:
            return self._whole(text, chat)
        before, after = ([], []) if chat else self._wrap
        ids = list(before)
        if self._chunks.extend(ids, text, self._piece, more):
            return ids  # stopped at `more`'s word: a prefix of the ids, no closing tokens, nothing to verify
        ids.extend(after)
        if self._verify_left > 0:
            self._verify_left -= 1
            whole = self._whole(text, chat)
            if whole != ids:
                self.chunked = False
                log.warning("chunked tokenization differs from the whole text's; encoding whole texts from now on",
                            extra={"tokenizer": self.name})
                return whole
        return ids

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0,
                           more: More | None = None) -> list[int] | None:
        # `tokenizers` releases the GIL while it encodes: a worker thread keeps the loop free.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, parsed, max_tokens, more)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
