"""`/v1/messages` and `/v1/responses` requests on a simulated replica: converted into the chat request
the engine renders, as vLLM 0.32 converts them (the answers' own shapes: `anthropic_api`,
`responses_api`).

- `/v1/messages` (Anthropic Messages): vLLM's conversion (`extproc.request.messages.to_chat`:
  top-level system, content blocks, tool round trips) into chat messages. `max_tokens` is required
  (a positive integer), as the Messages API and vLLM's request model require it.
- `/v1/responses`: `instructions` become the leading system message, then the conversation the
  request continues (`history`: what `previous_response_id` names, `responses_api.ResponseStore`),
  then a string `input` as one user message, or the input items as their messages (text parts
  kept; `input_text` / `output_text` parts as text). `max_output_tokens` is the answer's limit.

The prompt tokens, hence the KV cache's blocks, are those of the converted chat request, so a
Messages or Responses conversation shares its cached prefix with the same conversation sent as
chat. `max_tokens` and `stream_options` pass through (a Responses client that sends `max_tokens`
gets it honoured, where vLLM would ignore it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from extproc.core.errors import EppError
from extproc.request.messages import to_chat
from prefix_epp_sim.openai_api import ApiError

_KEPT = ("model", "max_tokens", "stream", "stream_options", "temperature", "ignore_eos")


def _part_text(part: Any) -> Any:
    if isinstance(part, Mapping) and part.get("type") in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    return part


def _responses_messages(body: Mapping[str, Any], history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    messages += [dict(m) for m in history]
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


def as_chat(body: Mapping[str, Any], shape: str, history: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The chat completion body a `messages` or `responses` request is served as; `history`: the
    chat messages of the conversation a Responses request continues (previous_response_id)."""
    out = {k: body[k] for k in _KEPT if k in body}
    if shape == "messages":
        max_tokens = body.get("max_tokens")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ApiError("bad_request", "'max_tokens' is required: a positive integer.", "max_tokens")
        try:
            out["messages"] = to_chat(dict(body))[0]
        except EppError as err:
            raise ApiError("bad_request", err.message, "messages") from None
    else:
        if "max_output_tokens" in body:
            out["max_tokens"] = body["max_output_tokens"]
        out["messages"] = _responses_messages(body, history)
    return out
