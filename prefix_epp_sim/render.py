"""vLLM's render routes: a request's prompt token ids without generating (vLLM 0.32, `--enable-scale-out`).

    POST /v1/completions/render        a completions body  -> [GenerateRequest, ...] (one per prompt)
    POST /v1/chat/completions/render   a chat body         -> GenerateRequest

A GenerateRequest is what vLLM would hand its engine for the request: `token_ids` (the prompt
tokenized exactly as the generation routes tokenize it, `openai_api.prompt_token_ids`), the
sampling parameters resolved from the body, and the body's routing fields. Routers that score
prefixes on the engine's own tokens (llm-d's `token-producer`) read `token_ids` only; the other
fields carry vLLM 0.32's key set and their defaults so a client that reads more finds them.
Request ids are `cmpl-<16 hex>` (`-<i>` appended per prompt of a batch) and `chatcmpl-<16 hex>`,
as vLLM's. The shapes were checked against vLLM 0.32.0's CPU build (`--enable-scale-out`, without
which the real engine answers 403 on these routes): tests/simulator/test_render.py holds them,
and the `vllm`-marked test_real_vllm.py compares the two servers' key sets.

A completions `prompt` may also be a batch (a list of strings or of token-id lists): one
GenerateRequest per element. Errors are the generation routes' (`ApiError`: unknown model 404,
bad body 400) in vLLM's error shape. Nothing is queued on the engine and no KV block is touched.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.openai_api import ApiError, Kind, prompt_token_ids, resolve_model

MAX_BATCH = 64  # prompts per completions render request (bounded; vLLM has no such limit)

# vLLM 0.32's SamplingParams as its render routes return them (msgspec, in its field order). Always
# there: the penalties and temperature (floats), stop and stop_token_ids, output_kind (1 deltas when
# streaming, 2 final only), skip_clone, bad_words, skip_reading_prefix_cache. top_p and min_p too,
# except for greedy sampling (temperature 0), where vLLM resets them to their defaults and they go.
# The other fields appear only when the body sets them off vLLM's default; max_tokens only when the
# body asks for a number of tokens. Checked against the real engine (tests/simulator/test_render.py).
FLOATS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0}
OPTIONAL_BEFORE_STOP = {"seed": None}
OPTIONAL_AFTER_STOP = {"ignore_eos": False}
OPTIONAL_AFTER_MAX = {"min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "skip_special_tokens": True,
                      "spaces_between_special_tokens": True, "include_stop_str_in_output": False}
TAIL = {"skip_clone": True, "bad_words": [], "skip_reading_prefix_cache": False}
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS
OUTPUT_KIND_DELTA, OUTPUT_KIND_FINAL = 1, 2


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _set_off_default(out: dict[str, Any], body: Mapping[str, Any], fields: Mapping[str, Any]) -> None:
    for key, default in fields.items():
        if body.get(key) is not None and body.get(key) != default:
            out[key] = body[key]


def sampling_params(body: Mapping[str, Any], kind: Kind, stream: bool) -> dict[str, Any]:
    """The sampling parameters vLLM 0.32 resolves from `body`, in its render shape (see above)."""
    out: dict[str, Any] = {key: _number(body, key, default) for key, default in FLOATS.items()}
    greedy = out["temperature"] < GREEDY_BELOW
    if not greedy:
        out["top_p"] = _number(body, "top_p", 1.0)
        _set_off_default(out, body, {"top_k": 0})
        out["min_p"] = _number(body, "min_p", 0.0)
    _set_off_default(out, body, OPTIONAL_BEFORE_STOP)
    stop = body.get("stop")
    out["stop"] = [stop] if isinstance(stop, str) else [x for x in stop if isinstance(x, str)] \
        if isinstance(stop, list) else []
    ids = body.get("stop_token_ids")
    out["stop_token_ids"] = [t for t in ids if type(t) is int] if isinstance(ids, list) else []
    _set_off_default(out, body, OPTIONAL_AFTER_STOP)
    requested = body.get("max_completion_tokens") if kind == "chat" else None
    if requested is None:
        requested = body.get("max_tokens")
    if type(requested) is int:
        out["max_tokens"] = requested
    _set_off_default(out, body, OPTIONAL_AFTER_MAX)
    out["output_kind"] = OUTPUT_KIND_DELTA if stream else OUTPUT_KIND_FINAL
    return out | TAIL


def _stream_options(body: Mapping[str, Any], stream: bool) -> dict[str, Any] | None:
    options = body.get("stream_options")
    if not stream or not isinstance(options, dict):
        return None
    return {"include_usage": bool(options.get("include_usage", False)),
            "continuous_usage_stats": bool(options.get("continuous_usage_stats", False))}


def generate_request(body: Mapping[str, Any], kind: Kind, request_id: str, tokens: list[int],
                     config: SimConfig) -> dict[str, Any]:
    """One GenerateRequest (module docstring) for `tokens`."""
    stream = bool(body.get("stream", False))
    return {
        "request_id": request_id, "token_ids": tokens, "token_offsets": None, "features": None,
        "content_parts": None, "sampling_params": sampling_params(body, kind, stream),
        "model": body.get("model") or config.model_names[0], "reasoning_ended": None,
        "reasoning_parser_kwargs": None, "return_token_ids": None, "output_mode": "tokens", "stream": stream,
        "stream_options": _stream_options(body, stream),
        "cache_salt": body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None,
        "priority": body.get("priority") if type(body.get("priority")) is int else 0,
        "kv_transfer_params": None, "ec_transfer_params": None,
    }


def _request_hex() -> str:
    return uuid.uuid4().hex[:16]  # vLLM's request ids carry 16 hex digits


def _prompts(body: Mapping[str, Any]) -> list[Any]:
    """The completions body's prompts: one, or a batch of strings or token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH:
            raise ApiError("bad_request", f"At most {MAX_BATCH} prompts per render request.", "prompt")
        return list(prompt)
    return [prompt]


def render_completions(body: Mapping[str, Any], config: SimConfig) -> list[dict[str, Any]]:
    """POST /v1/completions/render: one GenerateRequest per prompt."""
    resolve_model(body.get("model"), config, required=False)
    base = f"cmpl-{_request_hex()}"
    prompts = _prompts(body)
    out = []
    for i, prompt in enumerate(prompts):
        tokens = prompt_token_ids({**body, "prompt": prompt}, "completion", config)
        out.append(generate_request(body, "completion", base if len(prompts) == 1 else f"{base}-{i}", tokens,
                                    config))
    return out


def render_chat(body: Mapping[str, Any], config: SimConfig) -> dict[str, Any]:
    """POST /v1/chat/completions/render: the chat template applied, then tokenized."""
    resolve_model(body.get("model"), config, required=False)
    tokens = prompt_token_ids(body, "chat", config)
    return generate_request(body, "chat", f"chatcmpl-{_request_hex()}", tokens, config)
