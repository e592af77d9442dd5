"""Request parsing: API from `:path`, model, cache salt and the prompt as segments, per shape.

Shapes (`api_from_path`, by the path's suffix; a query string is ignored):
- `/v1/completions`: the prompt string is one segment;
- `/v1/chat/completions`: the leading system (or developer) message, then the tools, then each
  further message, one segment each, the order in which chat templates render them;
- `/v1/messages` (Anthropic Messages): converted into the chat request vLLM renders
  (extproc/request/messages.py), then segmented as chat, so it shares its prefix with the same
  conversation sent as chat;
- `/v1/responses`: `instructions` (as the system message), the tools, then each input item;
  `previous_response_id` is kept as an affinity hint toward the endpoint that served that
  response (extproc/control/affinity.py);
- `/v1/embeddings`: the input, one segment;
- any other path (`/v1/messages/count_tokens`, render endpoints, audio, ...): no segments, so the
  request is routed by load alone; the body need not be JSON and no field is required.

A *segment* is one unit of the prompt whose serialisation never depends on what follows it. The
prefix hasher (extproc/prefix/hashing.py) aligns blocks to segment starts, so a later turn, whose
messages extend the earlier turn's, produces exactly the earlier turn's block hashes followed by
new ones.

`prompt_cache_key` (a string; "" means none) becomes `affinity_key`, an affinity hint
(extproc/control/affinity.py); any other type is a 400, as is a non-string `previous_response_id`.

Message framing: `<role>\\x1f<text>` where text is the string content, or the parts of a
structured content list joined with `\\n`: text parts by their text, media parts by their content
(extproc/request/media.py: equal image bytes give equal markers, whatever the shape; bounded work
for huge data URLs). Other fields (`name`, `tool_calls`, ...) are serialised canonically (sorted
keys) so JSON key order and whitespace never change the hashes; a Responses item's
`"type": "message"` is left out, so an input message frames like the same chat message. Tools are
framed in one canonical form (`name`, `description`, `parameters`) whether they come in chat's
`{"function": {...}}` form, the Responses API's flat form or Anthropic's `input_schema` form.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import orjson

from extproc.core.errors import EppError, ErrorCode
from extproc.request.media import part_identity
from extproc.request.messages import to_chat


class Api(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    MESSAGES = "messages"
    EMBEDDINGS = "embeddings"
    OTHER = "other"


_API_BY_SUFFIX: tuple[tuple[str, Api], ...] = (
    ("/chat/completions", Api.CHAT),
    ("/completions", Api.COMPLETIONS),
    ("/responses", Api.RESPONSES),
    ("/v1/messages", Api.MESSAGES),
    ("/embeddings", Api.EMBEDDINGS),
)


def api_from_path(path: str) -> Api:
    """Choose the API from the request path (query string ignored); unknown -> Api.OTHER."""
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
    previous_response_id: str = ""  # /v1/responses: only ever hashed, never logged
    body: dict[str, Any] = field(default_factory=dict)
    # Chat and Messages: (the chat messages the engine renders, add_generation_prompt) and the
    # tools in chat form, for the tokenizers (extproc/tokenization/local.py).
    chat: tuple[list[Any], bool] | None = None
    tools: list[Any] | None = None


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
                if isinstance(part.get("text"), str):
                    parts.append(part["text"].encode())
                else:  # images, audio: by their content (extproc/request/media.py)
                    parts.append(part_identity(part))
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
    if extra.get("type") == "message":  # a Responses input item frames like the chat message
        del extra["type"]
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


def _tool(tool: Any) -> Any:
    """One canonical form of a function tool: chat's `{"type": "function", "function": {...}}`,
    the Responses API's flat `{"type": "function", "name", ...}`; other tools as they are."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    inner = tool.get("function")
    fn: dict[str, Any] = inner if isinstance(inner, dict) else tool
    return {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}


def _tools_segment(tools: Any) -> list[bytes]:
    if not tools:
        return []
    if not isinstance(tools, list):
        raise EppError(ErrorCode.BAD_REQUEST, "'tools' must be a list")
    return [b"tools\x1f" + _canon([_tool(t) for t in tools])]


def _leads(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") in ("system", "developer")


def _chat_segments(messages: Any, tools: Any) -> list[bytes]:
    """System message, tools, then the turns: the order chat templates render them in."""
    if not isinstance(messages, list) or not messages:
        raise EppError(ErrorCode.BAD_REQUEST, "'messages' must be a non-empty list")
    lead = 1 if _leads(messages[0]) else 0
    segments = [_message_segment(m) for m in messages[:lead]]
    segments.extend(_tools_segment(tools))
    segments.extend(_message_segment(m) for m in messages[lead:])
    return segments


def _responses_segments(body: dict[str, Any]) -> list[bytes]:
    segments: list[bytes] = []
    instructions = body.get("instructions")
    if instructions:  # the engine renders them as the leading system message
        segments.append(b"system\x1f" + _content_text(instructions))
    segments.extend(_tools_segment(body.get("tools")))
    items = body.get("input")
    if isinstance(items, str):
        segments.append(b"user\x1f" + items.encode())
    elif isinstance(items, list):
        for item in items:
            segments.append(_message_segment(item) if isinstance(item, dict) else _canon(item))
    elif items is not None:
        raise EppError(ErrorCode.BAD_REQUEST, "'input' must be a string or a list")
    return segments


def _string_field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise EppError(ErrorCode.BAD_REQUEST, f"'{name}' must be a string")
    return value or ""


def _load_only(api: Api, raw: bytes) -> ParsedRequest:
    """A path the picker does not know: routed by load; the model is read when there is one."""
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = None
    model = body.get("model") if isinstance(body, dict) else None
    return ParsedRequest(api=api, model=model if isinstance(model, str) else "", segments=[],
                         body=body if isinstance(body, dict) else {})


def parse_request(api: Api, raw: bytes) -> ParsedRequest:
    """Parse a request body; raises EppError(BAD_REQUEST) with a readable message when it is invalid.

    Api.OTHER never raises: such a request is routed by load alone."""
    if api is Api.OTHER:
        return _load_only(api, raw)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EppError(ErrorCode.BAD_REQUEST, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise EppError(ErrorCode.BAD_REQUEST, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise EppError(ErrorCode.BAD_REQUEST, "model not found in request body")
    chat: tuple[list[Any], bool] | None = None
    tools = None
    if api is Api.CHAT:
        tools = body.get("tools")
        segments = _chat_segments(body.get("messages"), tools)
        chat = body["messages"], bool(body.get("add_generation_prompt", True))
    elif api is Api.MESSAGES:
        messages, tools = to_chat(body)
        segments = _chat_segments(messages, tools)
        chat = messages, True
    elif api is Api.RESPONSES:
        segments = _responses_segments(body)
    elif api is Api.EMBEDDINGS:
        segments = [_canon(body.get("input"))]
    else:
        segments = _completion_segments(body)
    salt = body.get("cache_salt")
    stream_options = body.get("stream_options")
    return ParsedRequest(
        api=api,
        model=model,
        segments=segments,
        cache_salt=salt if isinstance(salt, str) else "",
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
        affinity_key=_string_field(body, "prompt_cache_key"),
        previous_response_id=_string_field(body, "previous_response_id") if api is Api.RESPONSES else "",
        body=body,
        chat=chat,
        tools=tools if isinstance(tools, list) and tools else None,
    )
