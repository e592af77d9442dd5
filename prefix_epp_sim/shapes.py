"""`/v1/messages` and `/v1/responses` on a simulated replica: served as the chat request the engine
renders, as vLLM 0.32 serves them.

- `/v1/messages` (Anthropic Messages): vLLM's conversion (`extproc.request.messages.to_chat`:
  top-level system, content blocks, tool round trips) into chat messages.
- `/v1/responses`: `instructions` become the leading system message, a string `input` one user
  message, input items their messages (text parts kept; `input_text` / `output_text` parts as text).
  `previous_response_id` is not served: the replica keeps no response store, so such a request is a
  400 (use full inputs, as a client with `store: false` does).

The answer is a chat completion (streamed as chat chunks): what the benchmark's client reads; the
prompt tokens, hence the KV cache's blocks, are those of the converted chat request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.core.errors import EppError
from extproc.request.messages import to_chat
from prefix_epp_sim.openai_api import ApiError

_KEPT = ("model", "max_tokens", "stream", "stream_options", "temperature", "ignore_eos")


def _part_text(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    return part


def _responses_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    if body.get("previous_response_id"):
        raise ApiError("bad_request", "previous_response_id is not supported by the simulator.",
                       "previous_response_id")
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, Mapping) or not isinstance(item.get("role"), str):
                raise ApiError("bad_request", "each input item must be a message with a role.", "input")
            content = item.get("content")
            if isinstance(content, list):
                content = [_part_text(p) for p in content]
            messages.append({"role": item["role"], "content": content})
    else:
        raise ApiError("bad_request", "'input' must be a string or a list of items.", "input")
    return messages


def as_chat(body: Mapping[str, Any], shape: str) -> dict[str, Any]:
    """The chat completion body a `messages` or `responses` request is served as."""
    out = {k: body[k] for k in _KEPT if k in body}
    if shape == "responses" and "max_output_tokens" in body:
        out["max_tokens"] = body["max_output_tokens"]
    if shape == "messages":
        try:
            out["messages"] = to_chat(dict(body))[0]
        except EppError as err:
            raise ApiError("bad_request", err.message, "messages") from None
    else:
        out["messages"] = _responses_messages(body)
    return out
