"""The model server's POST /tokenize (vLLM: `{"model", "prompt"}` or `{"model", "messages",
"add_generation_prompt", "tools"}` -> `{"tokens"}`; a `/v1/messages` request as the chat request
vLLM converts it to), or, with `render`, vLLM's render endpoints: the request body as the client
sent it, to `/v1/completions/render`, `/v1/chat/completions/render`, `/v1/messages/render` or
`/v1/responses/render` -> `{"token_ids"}` (a list of them for completions): the very tokens the
engine would execute, whatever the shape, its chat template or its conversion rules. Either way
the endpoints are asked in turn,, asked of the datastore's endpoints in turn, with a timeout
of `--tokenizer-timeout`; any failure gives None (the approximate index scores the request).
"""

from __future__ import annotations

import itertools
from typing import Any

import aiohttp

from extproc.core.datastore import Datastore
from extproc.request.openai import Api, ParsedRequest
from extproc.tokenization.local import More, chat_input, completion_input, is_token_list, log

RENDER_PATHS = {Api.COMPLETIONS: "/v1/completions/render", Api.CHAT: "/v1/chat/completions/render",
                Api.MESSAGES: "/v1/messages/render", Api.RESPONSES: "/v1/responses/render"}


class RemoteTokenizer:
    """The model server's POST /tokenize (or render endpoints), round-robin over the datastore's endpoints."""

    is_async = True

    def __init__(self, datastore: Datastore, timeout_s: float, render: bool = False) -> None:
        self.name = "render" if render else "remote"
        self._render = render
        self._datastore = datastore
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._turn = itertools.count()
        self.failures = 0

    def encode(self, parsed: ParsedRequest, max_tokens: int = 0) -> list[int] | None:
        return None  # only asynchronously (Director.prepare)

    def _request(self, parsed: ParsedRequest) -> tuple[str, dict[str, Any]] | list[int] | None:
        """(path, payload) to ask, or the ids a completion already gives, or None: not tokenizable."""
        if self._render:
            path = RENDER_PATHS.get(parsed.api)
            return (path, parsed.body) if path is not None else None
        chat = chat_input(parsed)
        payload: dict[str, Any]
        if chat is not None:
            payload = {"model": parsed.model, "messages": chat[0], "add_generation_prompt": chat[1]}
            if parsed.tools:
                payload["tools"] = parsed.tools
        else:
            prompt = completion_input(parsed)
            if not isinstance(prompt, str):
                return prompt
            payload = {"model": parsed.model, "prompt": prompt}
        return "/tokenize", payload

    async def encode_async(self, parsed: ParsedRequest, max_tokens: int = 0,
                           more: More | None = None) -> list[int] | None:
        """The engine's tokens (`more` is not asked: the engine tokenizes the whole prompt)."""
        ask = self._request(parsed)
        if not isinstance(ask, tuple):
            return ask[:max_tokens] if ask is not None and max_tokens > 0 else ask
        path, payload = ask
        endpoints = self._datastore.snapshot()
        if not endpoints:
            return None
        ep = endpoints[next(self._turn) % len(endpoints)]
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(f"http://{ep.key}{path}", json=payload) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                reply = await resp.json()
            if self._render:  # GenerateRequest, or a list of them (completions): the first prompt's
                reply = reply[0] if isinstance(reply, list) and len(reply) == 1 else reply
                tokens = reply.get("token_ids") if isinstance(reply, dict) else None
            else:
                tokens = reply.get("tokens") if isinstance(reply, dict) else None
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
