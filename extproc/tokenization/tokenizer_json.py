"""A Hugging Face tokenizer.json, with the model's Jinja chat template.

Completions are encoded with the tokenizer's special tokens (BOS), as vLLM does; chat requests are
rendered first, then encoded without adding special tokens. The template is found where a model
ships it, beside the file: `chat_template` in `tokenizer_config.json` (a string, or a list of named
templates of which "default" is used), else `chat_template.jinja` (what transformers writes since
4.43). It renders in jinja2's sandbox with `trim_blocks` and `lstrip_blocks`, as transformers and
vLLM render it, with the config's `bos_token` and `eos_token`. A model without a template renders
with the builtin ChatML template. `tokenizers` releases the GIL, so `encode_async` runs in a worker
thread.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from extproc.request.openai import ParsedRequest
from extproc.tokenization.builtin import render_chat
from extproc.tokenization.local import LocalTokenizer, log


class HFTokenizer(LocalTokenizer):
    """A Hugging Face tokenizer.json, with the model's Jinja chat template when jinja2 exists."""

    name = "huggingface"

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self._pool: ThreadPoolExecutor | None = None
        self._template: Any = None
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
        for key in ("bos_token", "eos_token"):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self._specials[key] = value

    @property
    def has_model_template(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        if self._template is None:
            return render_chat(messages, add_generation_prompt)
        text: str = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          **self._specials)
        return text

    def encode_text(self, text: str, chat: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=not chat).ids
        return ids

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0) -> list[int] | None:
        # `tokenizers` releases the GIL while it encodes: a worker thread keeps the loop free.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, parsed, max_tokens)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
