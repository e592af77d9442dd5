"""What of a request is tokenized, and the prefix truncation every local tokenizer shares.

A completions `prompt` (a string, a list of token ids, or a one-element list of either), chat
`messages` (with `add_generation_prompt`, default true, and the request's `tools`, which a model's
own template renders) and a `/v1/messages` request as the chat request the engine converts it to
(extproc/request/messages.py) are tokenized; anything else, a batch of prompts, or a tokenizer
error gives None (the approximate index then scores the request).

Only the first `max_tokens` tokens matter: `LocalTokenizer` encodes a prefix of a longer text,
first `max_tokens * 6` characters, then `max_tokens * 16`, and keeps the first `max_tokens` ids once
a prefix yields `TRUNCATION_MARGIN` (8) more than that (see the room's docstring,
extproc/tokenization/__init__.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from extproc.request.openai import Api, ParsedRequest
from extproc.tokenization.builtin import render_chat

log = logging.getLogger("prefix_epp.tokenize")
# `more(ids so far, characters done, characters in all)`: a chunked tokenizer asks it after each
# chunk it had to encode (not found in its cache), but the last, and stops where it says False
# (extproc/kvevents/lookahead.py).
More = Callable[[Sequence[int], int, int], bool]
PREFIX_CHARS_PER_TOKEN = (6, 16)  # tried in order; about 4 on English text, at most 16 (builtin)
TRUNCATION_MARGIN = 8


def is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and 0 <= t < 1 << 32 for t in value)


def chat_input(parsed: ParsedRequest) -> tuple[list[Any], bool] | None:
    """(messages, add_generation_prompt) of a chat or Messages request (ParsedRequest.chat)."""
    return parsed.chat


def completion_input(parsed: ParsedRequest) -> str | list[int] | None:
    if parsed.api is not Api.COMPLETIONS:
        return None
    prompt = parsed.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and is_token_list(prompt):
        return [int(t) for t in prompt]
    return None


class LocalTokenizer:
    """Synchronous tokenizers: `encode(parsed)` -> token ids or None."""

    name = "local"
    is_async = False

    def encode_text(self, text: str, chat: bool, more: More | None = None) -> list[int]:
        raise NotImplementedError

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               tools: Sequence[Any] | None = None) -> str:
        return render_chat(messages, add_generation_prompt)  # the builtin template renders no tools

    def encode(self, parsed: ParsedRequest, max_tokens: int = 0, more: More | None = None) -> list[int] | None:
        """Token ids of the prompt (its first `max_tokens` when > 0), None when not tokenizable;
        fewer where a chunked tokenizer stopped at `more`'s word."""
        source = self._source(parsed, max_tokens)
        if not isinstance(source, tuple):
            return source
        try:
            return self._encode_prefix(*source, max_tokens, more)
        except (ValueError, TypeError) as exc:
            log.debug("tokenization failed", extra={"error": type(exc).__name__})
            return None

    def _source(self, parsed: ParsedRequest, max_tokens: int) -> tuple[str, bool] | list[int] | None:
        """What to encode: (text, is chat), or the ids a completion already gives, or None."""
        try:
            chat = chat_input(parsed)
            if chat is not None:
                return self.render(*chat, parsed.tools), True
            prompt = completion_input(parsed)
        except (ValueError, TypeError) as exc:
            log.debug("tokenization failed", extra={"error": type(exc).__name__})
            return None
        if isinstance(prompt, str):
            return prompt, False
        return prompt[:max_tokens] if prompt is not None and max_tokens > 0 else prompt

    def _encode_prefix(self, text: str, chat: bool, max_tokens: int, more: More | None = None) -> list[int]:
        stopped = False
        if more is not None:
            ask, whole = more, len(text)

            def more(ids: Sequence[int], done: int, total: int) -> bool:
                nonlocal stopped
                stopped = not ask(ids, done, whole)  # of the whole text, not of the prefix tried
                return not stopped

        for chars in PREFIX_CHARS_PER_TOKEN if max_tokens > 0 else ():
            limit = max_tokens * chars
            if len(text) <= limit:
                break
            ids = self.encode_text(text[:limit], chat, more)
            if stopped or len(ids) >= max_tokens + TRUNCATION_MARGIN:  # `more` said stop, or enough
                return ids[:max_tokens]
        ids = self.encode_text(text, chat, more)
        return ids[:max_tokens] if max_tokens > 0 else ids

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0,
                           more: More | None = None) -> list[int] | None:
        return self.encode(parsed, max_tokens, more)

    async def close(self) -> None:
        return None
