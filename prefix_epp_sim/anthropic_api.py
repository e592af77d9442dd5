"""/v1/messages answers in the Anthropic Messages shape, as vLLM 0.32 writes them.

vLLM serves a Messages request as the chat completion it converts it into and converts the answer
back (vllm/entrypoints/anthropic/serving.py); so does the simulator, without the round trip:

Not streamed: a Message, `None` fields left out as vLLM leaves them out::

    {"id": "chatcmpl-<hex>", "type": "message", "role": "assistant",
     "content": [{"type": "text", "text": ...}], "model": ..., "stop_reason": "max_tokens",
     "usage": {"input_tokens", "output_tokens", "cache_read_input_tokens"}}

The id is the chat completion's (vLLM keeps it; `msg_...` only when it has none). Anthropic counts
cached input apart: `input_tokens` = prompt tokens - cached tokens, `cache_read_input_tokens` =
cached tokens (vLLM with `--enable-prompt-tokens-details`, as the chat answers report them).
Every simulated answer ends at its token limit: `stop_reason` "max_tokens".

Streamed (`event: <type>\\ndata: <json>\\n\\n`, no `[DONE]`), in vLLM's order: `message_start` (the
Message with empty content, `stop_reason` null, usage `{input_tokens: prompt tokens,
output_tokens: 0}`) with the first tokens, then `content_block_start` (index 0, an empty text
block), one `content_block_delta` (`text_delta`) per batch of tokens, `content_block_stop`,
`message_delta` (`stop_reason`, `stop_sequence` null, the final usage as above) and
`message_stop`. vLLM sends no `ping`.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from prefix_epp_sim.openai_api import ApiError, Generation

STOP_REASON = "max_tokens"  # every simulated answer ends at its token limit ("length")


def event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def message_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {"input_tokens": max(0, prompt_tokens - cached_tokens), "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached_tokens}


def error_body(exc: ApiError) -> dict[str, Any]:
    """vLLM's Anthropic error shape (errors raised while serving; malformed bodies keep the OpenAI one)."""
    return {"type": "error", "error": {"type": exc.body()["error"]["type"], "message": exc.message}}


class MessageAnswer:
    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.id = f"chatcmpl-{uuid.uuid4().hex}"

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content,
                "model": self.gen.model, "stop_reason": stop_reason, "usage": usage}

    def body(self, text: str, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        usage = message_usage(len(self.gen.prompt_tokens), completion_tokens, cached_tokens)
        return self._message([{"type": "text", "text": text}], STOP_REASON, usage)

    def opening(self) -> bytes:
        return b""  # vLLM starts the message with the engine's first output, not before

    def chunk(self, text: str, first: bool, last: bool) -> bytes:
        out = b""
        if first:
            start = self._message([], None, {"input_tokens": len(self.gen.prompt_tokens), "output_tokens": 0})
            start["stop_sequence"] = None
            out += event("message_start", {"type": "message_start", "message": start})
            out += event("content_block_start", {"type": "content_block_start",
                                                 "content_block": {"type": "text", "text": ""}, "index": 0})
        return out + event("content_block_delta", {"type": "content_block_delta",
                                                   "delta": {"type": "text_delta", "text": text}, "index": 0})

    def closing(self, completion_tokens: int, cached_tokens: int) -> bytes:
        usage = message_usage(len(self.gen.prompt_tokens), completion_tokens, cached_tokens)
        return (event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": STOP_REASON, "stop_sequence": None},
                                          "usage": usage})
                + event("message_stop", {"type": "message_stop"}))
