"""The model server's POST /tokenize (vLLM: `{"model", "prompt"}` or `{"model", "messages",
"add_generation_prompt", "tools"}` -> `{"tokens"}`; a `/v1/messages` request as the chat request
vLLM converts it to), asked of the datastore's endpoints in turn, with a timeout
of `--tokenizer-timeout`; any failure gives None (the approximate index scores the request).
"""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp

from extproc.core.datastore import Datastore
from extproc.request.openai import ParsedRequest
from extproc.tokenization.local import chat_input, completion_input, is_token_list, log


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
        chat = chat_input(parsed)
        payload: dict[str, Any]
        if chat is not None:
            payload = {"model": parsed.model, "messages": chat[0], "add_generation_prompt": chat[1]}
            if parsed.tools:
                payload["tools"] = parsed.tools
        else:
            prompt = completion_input(parsed)
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
        if not isinstance(tokens, list) or not is_token_list(tokens):
            return None
        return tokens[:max_tokens] if max_tokens > 0 else tokens

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
