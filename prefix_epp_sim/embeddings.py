"""/v1/embeddings on a simulated replica: OpenAI's request, vLLM 0.32's answer, hashed vectors.

Request: `model`, `input` (a string, a list of strings, a list of token ids or a list of such
lists; at most `MAX_INPUTS` inputs, none empty, each shorter than `max_model_len`), `encoding_format`
"float" (the default) or "base64" (what the openai SDK asks for when its caller names none: the
vector's float32 values, little-endian, base64-encoded), `dimensions` (1..`DIMENSIONS`: the
vector's leading values, renormalised).

Answer (vllm/entrypoints/pooling/embed/protocol.py)::

    {"id": "embd-<hex>", "object": "list", "created", "model",
     "data": [{"index": i, "object": "embedding", "embedding": [...] | "<base64>"}, ...],
     "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0,
               "prompt_tokens_details": null, "completion_tokens_details": null}}

Vectors: `DIMENSIONS` float32 values, unit length, drawn from a generator seeded by a hash of the
input's token ids: the same input gives the same vector on every replica and run. Cost: the
server queues each input on the engine as a one-token request (`Replica`), so embeddings take
prefill time, queue behind other work and hit and fill the prefix cache as the prompts of
generation requests do.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import sys
import time
import uuid
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefix_epp_sim.config import SimConfig
from prefix_epp_sim.openai_api import ApiError, prompt_tokenizer, resolve_model

DIMENSIONS = 256
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    lora: str | None
    inputs: list[list[int]]  # each input's token ids
    base64: bool
    dimensions: int


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and 0 <= t < 1 << 32 for t in value)


def _inputs(raw: Any, config: SimConfig) -> list[list[int]]:
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise ApiError("bad_request", "'input' must be a string, a list of strings or a list of token-id "
                       "lists.", "input")
    if len(raw) > MAX_INPUTS:
        raise ApiError("bad_request", f"At most {MAX_INPUTS} inputs per request.", "input")
    tok = prompt_tokenizer(config)
    out = []
    for item in raw:
        if isinstance(item, str):
            tokens = tok.encode_text(item, False)
        elif _is_ids(item):
            tokens = list(item)
        else:
            raise ApiError("bad_request", "each input must be a string or a list of token ids.", "input")
        if not tokens:
            raise ApiError("bad_request", "An input cannot be empty.", "input")
        if len(tokens) >= config.max_model_len:  # its one engine token must fit too (module docstring)
            raise ApiError("bad_request", f"This model's maximum context length is {config.max_model_len} "
                           f"tokens. However, you requested {len(tokens)} tokens in the input for embedding "
                           "generation. Please reduce the length of the input.", "input")
        out.append(tokens)
    return out


def parse_embeddings(body: Mapping[str, Any], config: SimConfig) -> EmbeddingRequest:
    model = body.get("model")
    lora = resolve_model(model, config)
    assert isinstance(model, str)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError("bad_request", "'encoding_format' must be 'float' or 'base64'.", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = DIMENSIONS
    if type(dimensions) is not int or not 1 <= dimensions <= DIMENSIONS:
        raise ApiError("bad_request", f"'dimensions' must be an integer in 1..{DIMENSIONS}.", "dimensions")
    return EmbeddingRequest(model, lora, _inputs(body.get("input"), config), fmt == "base64", dimensions)


def vector(tokens: Sequence[int], dimensions: int = DIMENSIONS) -> array[float]:
    """The input's unit vector (float32): seeded by a hash of its token ids."""
    seed = hashlib.blake2b(array("I", tokens).tobytes(), digest_size=16).digest()
    rng = random.Random(seed)
    values = [rng.gauss(0.0, 1.0) for _ in range(DIMENSIONS)][:dimensions]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return array("f", (v / norm for v in values))


def _encode(vec: array[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return vec.tolist()
    if sys.byteorder != "little":
        vec = array("f", vec)
        vec.byteswap()  # the openai SDK reads little-endian float32
    return base64.b64encode(vec.tobytes()).decode()


def embeddings_body(req: EmbeddingRequest) -> dict[str, Any]:
    tokens = sum(len(t) for t in req.inputs)
    data = [{"index": i, "object": "embedding", "embedding": _encode(vector(t, req.dimensions), req.base64)}
            for i, t in enumerate(req.inputs)]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": req.model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                    "prompt_tokens_details": None, "completion_tokens_details": None}}
