"""Request -> prompt token ids, as the model server computes them (for the precise prefix index).

`--tokenizer` (KVEventsConfig.tokenizer):
- `builtin` (default): extproc/tokenizer.py and its fixed ChatML-like chat template, the exact
  tokenizer of the simulator.
- `/path/to/tokenizer.json`: a Hugging Face `tokenizers` file. Completions are encoded with the
  tokenizer's special tokens (BOS), as vLLM does; chat requests are rendered first, then encoded
  without adding special tokens. The template is `chat_template` from a `tokenizer_config.json`
  beside the file when the `jinja2` package is importable (it is not a dependency), else the
  builtin ChatML template (`<|im_start|>role\\ncontent<|im_end|>\\n`, then the generation prompt).
- `remote`: the model server's `POST /tokenize` (vLLM: `{"model", "prompt"}` or `{"model",
  "messages", "add_generation_prompt"}` -> `{"tokens"}`), asked of the endpoints in turn, with a
  timeout of `--tokenizer-timeout` (100 ms). It is asynchronous: the director awaits it before
  scheduling (`Director.prepare`), the event loop keeps running meanwhile.

What is tokenized: a completions `prompt` (a string, a list of token ids, or a one-element list of
either) and chat `messages` (with `add_generation_prompt`, default true). Anything else, a batch of
prompts, or a tokenizer error gives None: the request is then scored by the approximate index.

Off the event loop (`encode_async`, what the director awaits in precise mode): the builtin
tokenizer encodes in chunks of about `CHUNK_CHARS` (2048) characters cut at a space that starts a
word after a non-space character, where no token piece of extproc/tokenizer.py can straddle the
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

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import logging
import re
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import xxhash

from extproc.datastore import Datastore
from extproc.request.openai import Api, ParsedRequest
from extproc.tokenizer import encode, render_chat

log = logging.getLogger("prefix_epp.tokenize")
PREFIX_CHARS_PER_TOKEN = (6, 16)  # tried in order; about 4 on English text, at most 16 (builtin)
TRUNCATION_MARGIN = 8
CHUNK_CHARS = 2048
CHUNK_CACHE_ENTRIES = 4096
# A space preceded by a non-space and followed by a letter: every builtin piece ends before it.
_SAFE_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


def chunk_bounds(text: str, size: int = CHUNK_CHARS) -> Iterator[tuple[int, int]]:
    """(start, end) of consecutive chunks of about `size` characters, cut only at safe spaces."""
    start, n = 0, len(text)
    while n - start > size:
        m = _SAFE_CUT.search(text, start + size)
        if m is None:
            break
        yield start, m.start()
        start = m.start()
    if start < n:
        yield start, n


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and 0 <= t < 1 << 32 for t in value)


def _chat_input(parsed: ParsedRequest) -> tuple[list[Any], bool] | None:
    if parsed.api not in (Api.CHAT, Api.OTHER):
        return None
    messages = parsed.body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    return messages, bool(parsed.body.get("add_generation_prompt", True))


def _completion_input(parsed: ParsedRequest) -> str | list[int] | None:
    if parsed.api not in (Api.COMPLETIONS, Api.OTHER):
        return None
    prompt = parsed.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and _is_token_list(prompt):
        return [int(t) for t in prompt]
    return None


class LocalTokenizer:
    """Synchronous tokenizers: `encode(parsed)` -> token ids or None."""

    name = "local"
    is_async = False

    def encode_text(self, text: str, chat: bool) -> list[int]:
        raise NotImplementedError

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return render_chat(messages, add_generation_prompt)

    def encode(self, parsed: ParsedRequest, max_tokens: int = 0) -> list[int] | None:
        """Token ids of the prompt (its first `max_tokens` when > 0), None when not tokenizable."""
        source = self._source(parsed, max_tokens)
        if not isinstance(source, tuple):
            return source
        try:
            return self._encode_prefix(*source, max_tokens)
        except (ValueError, TypeError) as exc:
            log.debug("tokenization failed", extra={"error": type(exc).__name__})
            return None

    def _source(self, parsed: ParsedRequest, max_tokens: int) -> tuple[str, bool] | list[int] | None:
        """What to encode: (text, is chat), or the ids a completion already gives, or None."""
        try:
            chat = _chat_input(parsed)
            if chat is not None:
                return self.render(*chat), True
            prompt = _completion_input(parsed)
        except (ValueError, TypeError) as exc:
            log.debug("tokenization failed", extra={"error": type(exc).__name__})
            return None
        if isinstance(prompt, str):
            return prompt, False
        return prompt[:max_tokens] if prompt is not None and max_tokens > 0 else prompt

    def _encode_prefix(self, text: str, chat: bool, max_tokens: int) -> list[int]:
        for chars in PREFIX_CHARS_PER_TOKEN if max_tokens > 0 else ():
            limit = max_tokens * chars
            if len(text) <= limit:
                break
            ids = self.encode_text(text[:limit], chat)
            if len(ids) >= max_tokens + TRUNCATION_MARGIN:
                return ids[:max_tokens]
        ids = self.encode_text(text, chat)
        return ids[:max_tokens] if max_tokens > 0 else ids

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0) -> list[int] | None:
        return self.encode(parsed, max_tokens)

    async def close(self) -> None:
        return None


class BuiltinTokenizer(LocalTokenizer):
    """extproc/tokenizer.py in cached chunks; cooperative off-loop encoding (module docstring)."""

    name = "builtin"

    def __init__(self, cache_entries: int = CHUNK_CACHE_ENTRIES) -> None:
        self._cache: OrderedDict[int, array[int]] = OrderedDict()
        self._capacity = cache_entries
        self.chunks_encoded = 0  # cache misses, for tests and benchmarks

    def _chunk(self, piece: str) -> array[int]:
        key = xxhash.xxh3_64_intdigest(piece.encode("utf-8", "surrogatepass"))
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
            return ids
        ids = array("I", encode(piece))
        self.chunks_encoded += 1
        self._cache[key] = ids
        if len(self._cache) > self._capacity:
            self._cache.popitem(last=False)
        return ids

    def encode_text(self, text: str, chat: bool) -> list[int]:
        out: list[int] = []
        for start, end in chunk_bounds(text):
            out.extend(self._chunk(text[start:end]))
        return out

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0) -> list[int] | None:
        source = self._source(parsed, max_tokens)
        if not isinstance(source, tuple):
            return source
        text = source[0]
        out: list[int] = []
        for start, end in chunk_bounds(text):
            misses = self.chunks_encoded
            out.extend(self._chunk(text[start:end]))
            if max_tokens > 0 and len(out) >= max_tokens:
                return out[:max_tokens]
            if self.chunks_encoded != misses:
                await asyncio.sleep(0)  # let other streams run between two encoded chunks
        return out


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


class RemoteTokenizer:
    """The model server's POST /tokenize, round-robin over the datastore's endpoints."""

    name = "remote"
    is_async = True

    def __init__(self, datastore: Datastore, timeout_s: float) -> None:
        self._datastore = datastore
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._turn = itertools.count()
        self.failures = 0

    def encode(self, parsed: ParsedRequest, max_tokens: int = 0) -> list[int] | None:
        return None  # only asynchronously (Director.prepare)

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0) -> list[int] | None:
        chat = _chat_input(parsed)
        payload: dict[str, Any]
        if chat is not None:
            payload = {"model": parsed.model, "messages": chat[0], "add_generation_prompt": chat[1]}
        else:
            prompt = _completion_input(parsed)
            if not isinstance(prompt, str):
                return prompt[:max_tokens] if prompt is not None and max_tokens > 0 else prompt
            payload = {"model": parsed.model, "prompt": prompt}
        endpoints = self._datastore.snapshot()
        if not endpoints:
            return None
        ep = endpoints[next(self._turn) % len(endpoints)]
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(f"http://{ep.key}/tokenize", json=payload) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                tokens = (await resp.json()).get("tokens")
        except Exception as exc:  # timeouts, connection errors, bad JSON: fall back to approximate
            self.failures += 1
            log.info("remote tokenize failed", extra={"endpoint": ep.key, "error": type(exc).__name__})
            return None
        if not isinstance(tokens, list) or not _is_token_list(tokens):
            return None
        return tokens[:max_tokens] if max_tokens > 0 else tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


Tokenizer = LocalTokenizer | RemoteTokenizer


def make_tokenizer(spec: str, datastore: Datastore, timeout_s: float) -> Tokenizer:
    """`builtin`, `remote` or a tokenizer.json path (see the module docstring)."""
    if spec == "builtin":
        return BuiltinTokenizer()
    if spec == "remote":
        return RemoteTokenizer(datastore, timeout_s)
    if not Path(spec).is_file():
        raise ValueError(f"--tokenizer: no such file {spec!r} (or use builtin / remote)")
    return HFTokenizer(spec)
