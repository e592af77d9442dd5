"""HTTP helpers for end-to-end tests: aiohttp requests against Envoy's listener, OpenAI-style bodies."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def served_by(self) -> str:
        return self.headers.get("x-served-by", "")


async def post(session: aiohttp.ClientSession, url: str, payload: Any = None, *, raw: bytes | None = None,
               headers: dict[str, str] | None = None) -> Reply:
    data = raw if raw is not None else json.dumps(payload).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    async with session.post(url, data=data, headers=hdrs) as resp:
        return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read())


async def get(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Reply:
    async with session.get(url, headers=headers or {}) as resp:
        return Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read())


def completion(prompt: str, model: str = "m") -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 4}


def chat(messages: list[dict[str, Any]], model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": 4}


async def gather_limited(coros: list[Any], limit: int) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))
