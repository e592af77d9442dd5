"""/v1/responses answers in the OpenAI Responses shape, as vLLM 0.32 writes them, and its response store.

Not streamed: vLLM's Response object (vllm/entrypoints/openai/responses/protocol.py), every field
present: `id` "resp_<hex>" first (the picker reads it there, extproc/control/response_ids.py),
`object` "response", `created_at`, `model`, `output` (one message item `msg_<hex>`, status
"completed", one `output_text` part with `annotations` []), the request's `instructions`, `tools`,
`tool_choice`, `parallel_tool_calls`, ... echoed with vLLM's defaults, `max_output_tokens` the
answer's limit, and `usage` {input_tokens, input_tokens_details: {cached_tokens, ...},
output_tokens, output_tokens_details: {reasoning_tokens: 0, ...}, total_tokens}, cached tokens as
the engine found them. vLLM marks an answer that ended at its token limit "incomplete" with
`incomplete_details.reason` "max_output_tokens": every simulated answer does.

Streamed (`event: <type>\\ndata: <json>\\n\\n`, no `[DONE]`), `sequence_number` counting from 0:
`response.created` and `response.in_progress` (status "in_progress", empty output, usage null) at
once, then with the first tokens `response.output_item.added` and `response.content_part.added`,
one `response.output_text.delta` per batch of tokens, `response.output_text.done`,
`response.content_part.done`, `response.output_item.done` and `response.completed` (the whole
Response, as above).

Store: vLLM keeps responses only with `VLLM_ENABLE_RESPONSES_API_STORE=1`; a simulated replica
behaves as if it were set, so `previous_response_id` chains work and show the picker's affinity:
each answer of a request with `store` (default true) leaves, under its id, the conversation a
next turn continues: the request's chat messages but its system message (instructions do not carry
over) and the answer as an assistant message. A `previous_response_id` this replica does not
hold (another replica's, or forgotten) is a 404, as vLLM answers it. The store keeps the newest
`STORE_SIZE` responses per replica (vLLM's is unbounded).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from prefix_epp_sim.anthropic_api import event
from prefix_epp_sim.openai_api import ApiError, Generation

STORE_SIZE = 4096
Messages = list[dict[str, Any]]


class ResponseStore:
    """The newest `STORE_SIZE` responses' conversations, by response id (module docstring)."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, Messages] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def history(self, body: Mapping[str, Any]) -> Messages:
        """The conversation `body` continues: [] without `previous_response_id`; 404 when unknown."""
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        if not isinstance(previous, str) or previous not in self._items:
            raise ApiError("not_found", f"Response with id '{previous}' not found.", "response_id")
        self._items.move_to_end(previous)
        return list(self._items[previous])

    def put(self, response_id: str, messages: Sequence[Mapping[str, Any]], answer: str) -> None:
        kept = [dict(m) for m in messages if m.get("role") != "system"]
        self._items[response_id] = [*kept, {"role": "assistant", "content": answer}]
        while len(self._items) > self.size:
            self._items.popitem(last=False)


def response_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


class ResponseAnswer:
    """One /v1/responses answer; `messages` is the chat request it was served as, kept in `store`
    (when the request asks for it) once the answer is complete."""

    def __init__(self, gen: Generation, body: Mapping[str, Any], messages: Messages,
                 store: ResponseStore, created: int) -> None:
        self.gen = gen
        self.request = body
        self.messages = messages
        self.store = store if body.get("store", True) is not False else None
        self.created = created
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self._sequence = 0
        self._text: list[str] = []

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """vLLM's Response object (ResponsesResponse.from_request), every field in its order."""
        b = self.request
        return {
            "id": self.id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata"), "model": self.gen.model,
            "object": "response", "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "temperature": _number(b, "temperature", 1.0), "tool_choice": b.get("tool_choice") or "auto",
            "tools": b.get("tools") or [], "top_p": _number(b, "top_p", 1.0),
            "background": bool(b.get("background", False)), "max_output_tokens": self.gen.max_tokens,
            "max_tool_calls": b.get("max_tool_calls"), "previous_response_id": b.get("previous_response_id"),
            "prompt": b.get("prompt"), "reasoning": b.get("reasoning"),
            "service_tier": b.get("service_tier") or "auto", "status": status, "text": b.get("text"),
            "top_logprobs": None, "truncation": b.get("truncation") or "disabled", "usage": usage,
            "user": b.get("user"), "presence_penalty": _number(b, "presence_penalty", 0.0),
            "frequency_penalty": _number(b, "frequency_penalty", 0.0), "kv_transfer_params": None,
            "ec_transfer_params": None, "input_messages": None, "output_messages": None,
        }

    def _item(self, text: str) -> dict[str, Any]:
        return {"id": self.item_id, "content": [_text_part(text, None)], "role": "assistant",
                "status": "completed", "type": "message"}

    def _final(self, text: str, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        if self.store is not None:
            self.store.put(self.id, self.messages, text)
        usage = response_usage(len(self.gen.prompt_tokens), completion_tokens, cached_tokens)
        return self.response("incomplete", [self._item(text)], usage)

    def body(self, text: str, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return self._final(text, completion_tokens, cached_tokens)

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = {**fields, "sequence_number": self._sequence, "type": kind}
        self._sequence += 1
        return event(kind, data)

    def opening(self) -> bytes:
        start = self.response("in_progress", [], None)
        return (self._event("response.created", {"response": start})
                + self._event("response.in_progress", {"response": start}))

    def chunk(self, text: str, first: bool, last: bool) -> bytes:
        out = b""
        where = {"item_id": self.item_id, "output_index": 0}
        if first:
            out += self._event("response.output_item.added", {"item": {
                "id": self.item_id, "content": [], "role": "assistant", "status": "in_progress", "type": "message"},
                "output_index": 0})
            out += self._event("response.content_part.added", {"content_index": 0, **where,
                                                                "part": _text_part("", [])})
        self._text.append(text)
        return out + self._event("response.output_text.delta", {"content_index": 0, "delta": text, **where,
                                                                 "logprobs": []})

    def closing(self, completion_tokens: int, cached_tokens: int) -> bytes:
        text = "".join(self._text)
        where = {"item_id": self.item_id, "output_index": 0}
        return (self._event("response.output_text.done", {"content_index": 0, **where, "logprobs": [],
                                                          "text": text})
                + self._event("response.content_part.done", {"content_index": 0, **where,
                                                             "part": _text_part(text, None)})
                + self._event("response.output_item.done", {"item": self._item(text), "output_index": 0})
                + self._event("response.completed", {"response": self._final(text, completion_tokens,
                                                                              cached_tokens)}))
