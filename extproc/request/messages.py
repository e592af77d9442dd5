"""The Anthropic Messages API (`/v1/messages`) as the chat request the engine turns it into.

vLLM serves `/v1/messages` by converting the body into a chat completion request and rendering
that with the model's chat template (vllm/entrypoints/anthropic/serving.py,
`to_chat_completion_request`); `to_chat` does the same conversion, so a Messages request hashes
and tokenizes like the chat request the engine renders, and an agent's requests share their
prefix with each other and with the same conversation sent to `/v1/chat/completions`:

- top-level `system` (a string, or text blocks joined without separator) becomes the leading
  system message; a text block starting `x-anthropic-billing-header` is dropped, as vLLM drops it
  (it carries a per-request hash that would defeat prefix caching);
- `tools` (`name`, `description`, `input_schema`) become chat tools;
- each message's content blocks: `text` -> text parts (one text part -> a string content);
  `image` (`source` base64 or url) -> an `image_url` part with the data URL vLLM builds;
  `thinking` -> the message's `reasoning`; `redacted_thinking` is skipped; `tool_use` ->
  `tool_calls`; a user's `tool_result` -> a `tool` message placed before the user message (its
  images follow it as a user message of image parts), an assistant's -> a "Tool result: ..." text;
- inline `system` messages stay in place (the templates vLLM merges them for are not known here).

`cache_control` breakpoints are hints for the engine's cache and nothing the model reads: they
are left out, so a breakpoint that moves to the newest block on every turn (what coding agents
do) changes no earlier hash. Anything malformed is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

import orjson

from extproc.core.errors import EppError, ErrorCode

_BILLING = "x-anthropic-billing-header"


def _bad(message: str) -> EppError:
    return EppError(ErrorCode.BAD_REQUEST, message)


def _text_blocks(value: Any, field: str) -> str:
    if isinstance(value, str):
        return "" if value.startswith(_BILLING) else value
    if not isinstance(value, list):
        raise _bad(f"'{field}' must be a string or a list of content blocks")
    parts = []
    for block in value:
        if not isinstance(block, dict):
            raise _bad(f"each block of '{field}' must be a JSON object")
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and text and not text.startswith(_BILLING):
            parts.append(text)
    return "".join(parts)


def image_url(source: Any) -> str:
    """An Anthropic image source as the URL vLLM hands its media loader."""
    if not isinstance(source, dict):
        raise _bad("an image block needs a 'source' object")
    if source.get("type") == "url":
        url = source.get("url", "")
        return url if isinstance(url, str) else ""
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result(block: dict[str, Any], out: list[dict[str, Any]]) -> None:
    content = block.get("content")
    text, images = "", []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "text":
                texts.append(str(item.get("text", "")))
            elif item.get("type") == "image" and (url := image_url(item.get("source", {}))):
                images.append(url)
        text = "\n".join(texts)
    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": text})
    if images:
        out.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})


def _message(msg: Any, out: list[dict[str, Any]]) -> None:
    if not isinstance(msg, dict):
        raise _bad("each message must be a JSON object")
    role = msg.get("role")
    if not isinstance(role, str):
        raise _bad("each message needs a 'role'")
    content = msg.get("content")
    if role == "system":
        if text := _text_blocks(content, "system message content"):
            out.append({"role": "system", "content": text})
        return
    converted: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        converted["content"] = content
        out.append(converted)
        return
    if not isinstance(content, list):
        raise _bad("message 'content' must be a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            raise _bad("each content block must be a JSON object")
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str) and block["text"]:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": image_url(block["source"])}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            calls.append({"id": block.get("id") or "", "type": "function", "function": {
                "name": block.get("name") or "", "arguments": orjson.dumps(block.get("input") or {}).decode()}})
        elif kind == "tool_result":
            if role == "user":
                _tool_result(block, out)
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if calls:
        converted["tool_calls"] = calls
    if parts:
        converted["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if not (role == "user" and "content" not in converted):
        out.append(converted)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise _bad("each tool must be a JSON object")
        out.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"), "parameters": tool.get("input_schema")}})
    return out


def to_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(chat messages, chat tools) of a Messages request body, as vLLM converts it."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system and (text := _text_blocks(system, "system")):
        out.append({"role": "system", "content": text})
    for msg in messages:
        _message(msg, out)
    return out, _tools(body.get("tools"))
