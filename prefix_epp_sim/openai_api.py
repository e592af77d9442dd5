"""The OpenAI/vLLM request and response shapes the simulator speaks, without any I/O.

Requests
    `parse_json` turns a body into a JSON object or raises `ApiError("bad_request")`.
    `parse_generation` validates a /v1/completions or /v1/chat/completions body and returns a
    `Generation`: the resolved model (base or LoRA adapter), the prompt's token ids (chat
    messages are rendered first, as vLLM applies the chat template): by default with
    `extproc.tokenization.builtin`, or with `SimConfig.tokenizer` (a model's tokenizer.json and its
    chat template, `extproc.tokenization.tokenizer_json`: completions encoded with the model's
    special tokens, chat rendered then encoded without them, as vLLM does), `max_tokens`
    (chat: `max_completion_tokens` wins; default
    `SimConfig.default_max_tokens`, capped by the room left in `max_model_len`), `stream` and
    `stream_options.include_usage`. A completions prompt is a string, a list of token ids, or
    a one-element list of either.

Errors
    `ApiError(code, message)`; `ERRORS` maps each code to its one HTTP status and vLLM error
    type. The body is `{"error": {"message", "type", "param", "code": <status>}}`.

Responses
    `completion_body` / `completion_chunk` build non-streaming bodies and SSE chunks for both
    endpoints (`kind` "completion" or "chat"); `usage` always reports
    `prompt_tokens_details.cached_tokens` (vLLM's `--enable-prompt-tokens-details`). Generated text
    comes from `prefix_epp_sim.output` (the filler of the configured tokenizer); every finish is
    "length".

Answers
    An `Answer` writes one generation in its API's shape: `body` (not streamed), or `opening`,
    one `chunk` per batch of new tokens and `closing` (streamed, SSE). `ChatAnswer` is the one of
    /v1/completions and /v1/chat/completions (`data: [DONE]` last, the usage chunk before it with
    `stream_options.include_usage`); `anthropic_api.MessageAnswer` and
    `responses_api.ResponseAnswer` are the other two.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson

from extproc.tokenization.builtin import encode, render_chat
from extproc.tokenization.tokenizer_json import HFTokenizer
from prefix_epp_sim.config import SimConfig

Kind = Literal["completion", "chat"]

ERRORS: dict[str, tuple[int, str]] = {
    "bad_request": (400, "BadRequestError"),
    "not_found": (404, "NotFoundError"),
    "internal": (500, "InternalServerError"),
    "unavailable": (503, "ServiceUnavailableError"),
}


class ApiError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return ERRORS[self.code][0]

    def body(self) -> dict[str, Any]:
        status, kind = ERRORS[self.code]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": status}}


@dataclass(frozen=True)
class Generation:
    kind: Kind
    model: str  # the name the client used
    lora: str | None  # adapter name when `model` names one
    prompt_tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's, for a KV connector (prefix_epp_sim.kv_transfer)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError("bad_request", f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("bad_request", "The request body must be a JSON object.")
    return body


def resolve_model(name: Any, config: SimConfig, required: bool = True) -> str | None:
    """The LoRA adapter `name` refers to, or None for the base model; 404 for unknown names."""
    if name is None and not required:
        return None
    if not isinstance(name, str):
        raise ApiError("bad_request", "'model' must be a string.", "model")
    if name in config.model_names:
        return None
    if name in config.lora_names:
        return name
    raise ApiError("not_found", f"The model `{name}` does not exist.", "model")


class PromptTokenizer(Protocol):
    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str: ...
    def encode_text(self, text: str, chat: bool) -> list[int]: ...


class _Builtin:
    """The builtin tokenizer and ChatML template (no special tokens)."""

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return render_chat(messages, add_generation_prompt)

    def encode_text(self, text: str, chat: bool) -> list[int]:
        return encode(text)


_BUILTIN = _Builtin()


@functools.lru_cache(maxsize=4)
def _model_tokenizer(path: str) -> HFTokenizer:
    return HFTokenizer(path)


def prompt_tokenizer(config: SimConfig) -> PromptTokenizer:
    """The tokenizer prompts are counted with (loaded once per path)."""
    return _model_tokenizer(config.tokenizer) if config.tokenizer else _BUILTIN


def _prompt_tokens(body: Mapping[str, Any], kind: Kind, config: SimConfig) -> list[int]:
    tok = prompt_tokenizer(config)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("bad_request", "'messages' must be a non-empty list.", "messages")
        try:
            text = tok.render(messages, bool(body.get("add_generation_prompt", True)))
        except ValueError as exc:
            raise ApiError("bad_request", str(exc), "messages") from None
        return tok.encode_text(text, True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tok.encode_text(prompt, False)
    if isinstance(prompt, list) and prompt and all(type(t) is int and 0 <= t < 1 << 32 for t in prompt):
        return list(prompt)
    raise ApiError("bad_request", "'prompt' must be a string or a list of token ids (batches are not "
                   "supported).", "prompt")


def prompt_token_ids(body: Mapping[str, Any], kind: Kind, config: SimConfig) -> list[int]:
    """The prompt's token ids exactly as a generation request of `kind` would count them (non-empty)."""
    tokens = _prompt_tokens(body, kind, config)
    if not tokens:
        raise ApiError("bad_request", "The prompt cannot be empty.", "prompt")
    return tokens


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ApiError("bad_request", f"'{key}' must be a positive integer.", key)
    return value


def parse_generation(body: Mapping[str, Any], kind: Kind, config: SimConfig) -> Generation:
    model = body.get("model")
    lora = resolve_model(model, config)
    assert isinstance(model, str)
    tokens = prompt_token_ids(body, kind, config)
    requested = _optional_int(body, "max_completion_tokens") if kind == "chat" else None
    if requested is None:
        requested = _optional_int(body, "max_tokens")
    room = config.max_model_len - len(tokens)
    max_tokens = requested if requested is not None else min(config.default_max_tokens, room)
    if max_tokens > room or room < 1:
        raise ApiError(
            "bad_request",
            f"This model's maximum context length is {config.max_model_len} tokens. However, you "
            f"requested {len(tokens) + max(max_tokens, 1)} tokens ({len(tokens)} in the "
            f"{'messages' if kind == 'chat' else 'prompt'}, {max(max_tokens, 1)} in the completion). "
            "Please reduce the length of the input or completion.")
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    include_usage = stream and isinstance(options, dict) and bool(options.get("include_usage", False))
    params = body.get("kv_transfer_params")
    return Generation(kind, model, lora, tokens, max_tokens, stream, include_usage,
                      params if isinstance(params, dict) else None)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _choice(kind: Kind, text: str, finish: str | None, first: bool, stream: bool) -> dict[str, Any]:
    if kind == "completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish, "stop_reason": None}
    delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "stop_reason": None}


def completion_body(gen: Generation, request_id: str, text: str, completion_tokens: int,
                    cached_tokens: int) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion" if gen.kind == "completion" else "chat.completion",
        "created": int(time.time()),
        "model": gen.model,
        "choices": [_choice(gen.kind, text, "length", True, False)],
        "usage": usage(len(gen.prompt_tokens), completion_tokens, cached_tokens),
    }


def completion_chunk(gen: Generation, request_id: str, created: int, text: str | None,
                     finish: str | None = None, first: bool = False,
                     usage_body: dict[str, Any] | None = None) -> bytes:
    """One SSE event; `text=None` makes the usage-only final chunk (empty `choices`)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion" if gen.kind == "completion" else "chat.completion.chunk",
        "created": created,
        "model": gen.model,
        "choices": [] if text is None else [_choice(gen.kind, text, finish, first, True)],
    }
    if gen.include_usage:
        chunk["usage"] = usage_body
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_body(config: SimConfig, created: int) -> dict[str, Any]:
    base = config.model_names[0]
    data = [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": config.model,
             "parent": None, "max_model_len": config.max_model_len} for name in config.model_names]
    data += [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name,
              "parent": base, "max_model_len": config.max_model_len} for name in config.lora_names]
    return {"object": "list", "data": data}


def tokenize_body(body: Mapping[str, Any], config: SimConfig) -> dict[str, Any]:
    resolve_model(body.get("model"), config, required=False)
    if "messages" in body:
        tokens = _prompt_tokens(body, "chat", config)
    elif isinstance(body.get("prompt"), str):
        tokens = _prompt_tokens(body, "completion", config)
    else:
        raise ApiError("bad_request", "Provide 'prompt' (a string) or 'messages'.", "prompt")
    return {"count": len(tokens), "max_model_len": config.max_model_len, "tokens": tokens, "token_strs": None}


class Answer(Protocol):
    """How one API writes a generation (module docstring)."""

    def body(self, text: str, completion_tokens: int, cached_tokens: int) -> dict[str, Any]: ...
    def opening(self) -> bytes: ...
    def chunk(self, text: str, first: bool, last: bool) -> bytes: ...
    def closing(self, completion_tokens: int, cached_tokens: int) -> bytes: ...


class ChatAnswer:
    """/v1/completions and /v1/chat/completions: ids `cmpl-<hex>` and `chatcmpl-<hex>`."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen
        self.id = f"{'cmpl' if gen.kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def body(self, text: str, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return completion_body(self.gen, self.id, text, completion_tokens, cached_tokens)

    def opening(self) -> bytes:
        return b""

    def chunk(self, text: str, first: bool, last: bool) -> bytes:
        return completion_chunk(self.gen, self.id, self.created, text, "length" if last else None, first=first)

    def closing(self, completion_tokens: int, cached_tokens: int) -> bytes:
        if not self.gen.include_usage:
            return SSE_DONE
        return completion_chunk(self.gen, self.id, self.created, None, usage_body=usage(
            len(self.gen.prompt_tokens), completion_tokens, cached_tokens)) + SSE_DONE
