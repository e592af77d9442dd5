"""A Hugging Face tokenizer.json, with the model's Jinja chat template when jinja2 is importable.

Completions are encoded with the tokenizer's special tokens (BOS), as vLLM does; chat requests are
rendered first, then encoded without adding special tokens. The template is `chat_template` from a
`tokenizer_config.json` beside the file (jinja2 is not a dependency; without it, the builtin
ChatML template). `tokenizers` releases the GIL, so `encode_async` runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

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
        if config.is_file():
            self._load_template(json.loads(config.read_text()))

    def _load_template(self, cfg: dict[str, Any]) -> None:
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if not isinstance(template, str):
            return
        try:
            jinja2 = importlib.import_module("jinja2.sandbox")
        except ImportError:
            log.warning("jinja2 not installed: chat requests use the builtin ChatML template")
            return
        env = jinja2.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
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
