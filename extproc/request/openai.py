"""OpenAI-style request parsing: API from `:path`, model, cache salt and the prompt as segments.

A *segment* is one unit of the prompt whose serialisation never depends on what follows it:
the prompt string of `/v1/completions`; each message of `/v1/chat/completions`; the instructions,
the tools and each input item of `/v1/responses`. The prefix hasher (extproc/prefix/hashing.py)
aligns blocks to segment starts, so a later chat turn, whose messages extend the earlier turn's,
produces exactly the earlier turn's block hashes followed by new ones.

`prompt_cache_key` (a string; "" means none) becomes `affinity_key`, an affinity hint
(extproc/control/affinity.py); any other type is a 400.

Message framing: `<role>\\x1f<text>` where text is the string content, or the text parts of a
structured content list joined with `\\n` (non-text parts contribute their URL or a type marker, so
two prompts that differ only in an image still differ). Tools and `name`/`tool_calls` fields are
serialised canonically (sorted keys) so JSON key order and whitespace never change the hashes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.core.errors import EppError, ErrorCode


class Api(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    OTHER = "other"


_API_BY_SUFFIX: tuple[tuple[str, Api], ...] = (
    ("/chat/completions", Api.CHAT),
    ("/completions", Api.COMPLETIONS),
    ("/responses", Api.RESPONSES),
    ("/embeddings", Api.EMBEDDINGS),
)


def api_from_path(path: str) -> Api:
    """Choose the API from the request path (query string ignored); unknown -> completions-like."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in _API_BY_SUFFIX:
        if path.endswith(suffix):
            return api
    return Api.OTHER


@dataclass(slots=True)
class ParsedRequest:
    api: Api
    model: str
    segments: list[bytes]
    cache_salt: str = ""
    stream: bool = False
    include_usage: bool = False
    affinity_key: str = ""  # prompt_cache_key: only ever hashed, never logged
    body: dict[str, Any] = field(default_factory=dict)


_CANON = orjson.OPT_SORT_KEYS


def _canon(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=_CANON)
    except TypeError:  # orjson parses 1024 levels of nesting but serialises at most 254
        raise EppError(ErrorCode.BAD_REQUEST, "request body is nested too deeply") from None


def _content_text(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, list):
        parts: list[bytes] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part.encode())
            elif isinstance(part, dict):
                kind = part.get("type", "")
                if isinstance(part.get("text"), str):
                    parts.append(part["text"].encode())
                else:
                    # Images/audio: the URL (or data URI) identifies the content; fall back to the whole part.
                    ref = part.get(kind) if isinstance(kind, str) else None
                    parts.append(b"\x1d" + _canon(ref if ref is not None else part))
            else:
                parts.append(_canon(part))
        return b"\n".join(parts)
    return _canon(content)


def _message_segment(message: Any) -> bytes:
    if not isinstance(message, dict):
        raise EppError(ErrorCode.BAD_REQUEST, "each message must be a JSON object")
    role = message.get("role", "")
    seg = f"{role}\x1f".encode() + _content_text(message.get("content"))
    extra = {k: v for k, v in message.items() if k not in ("role", "content")}
    if extra:
        seg += b"\x1f" + _canon(extra)
    return seg


def _completion_segments(body: dict[str, Any]) -> list[bytes]:
    prompt = body.get("prompt")
    if prompt is None:
        raise EppError(ErrorCode.BAD_REQUEST, "'prompt' is required for completions")
    if isinstance(prompt, str):
        return [prompt.encode()]
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return [" ".join(prompt).encode()]
        if all(isinstance(p, int) for p in prompt):
            return [_canon(prompt)]
        return [_canon(prompt)]
    raise EppError(ErrorCode.BAD_REQUEST, "'prompt' must be a string or a list")


def _chat_segments(body: dict[str, Any]) -> list[bytes]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EppError(ErrorCode.BAD_REQUEST, "'messages' must be a non-empty list")
    segments: list[bytes] = []
    tools = body.get("tools")
    if tools:
        segments.append(b"tools\x1f" + _canon(tools))
    segments.extend(_message_segment(m) for m in messages)
    return segments


def _responses_segments(body: dict[str, Any]) -> list[bytes]:
    segments: list[bytes] = []
    instructions = body.get("instructions")
    if instructions:
        segments.append(b"instructions\x1f" + _content_text(instructions))
    tools = body.get("tools")
    if tools:
        segments.append(b"tools\x1f" + _canon(tools))
    items = body.get("input")
    if isinstance(items, str):
        segments.append(b"user\x1f" + items.encode())
    elif isinstance(items, list):
        for item in items:
            segments.append(_message_segment(item) if isinstance(item, dict) else _canon(item))
    elif items is not None:
        raise EppError(ErrorCode.BAD_REQUEST, "'input' must be a string or a list")
    return segments


def parse_request(api: Api, raw: bytes) -> ParsedRequest:
    """Parse a request body; raises EppError(BAD_REQUEST) with a readable message when it is invalid."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EppError(ErrorCode.BAD_REQUEST, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise EppError(ErrorCode.BAD_REQUEST, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise EppError(ErrorCode.BAD_REQUEST, "model not found in request body")
    if api is Api.CHAT:
        segments = _chat_segments(body)
    elif api is Api.RESPONSES:
        segments = _responses_segments(body)
    elif api is Api.EMBEDDINGS:
        segments = [_canon(body.get("input"))]
    elif api is Api.COMPLETIONS or "prompt" in body:
        segments = _completion_segments(body)
    elif "messages" in body:
        segments = _chat_segments(body)
    else:
        segments = []
    salt = body.get("cache_salt")
    cache_key = body.get("prompt_cache_key")
    if cache_key is not None and not isinstance(cache_key, str):
        raise EppError(ErrorCode.BAD_REQUEST, "'prompt_cache_key' must be a string")
    stream_options = body.get("stream_options")
    return ParsedRequest(
        api=api,
        model=model,
        segments=segments,
        cache_salt=salt if isinstance(salt, str) else "",
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
        affinity_key=cache_key or "",
        body=body,
    )
