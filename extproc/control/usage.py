"""Closed loop: what the engine reports it reused (`usage`) against what the picker predicted.

Response side (cheap on the hot path): `UsageTail.feed` keeps only the last `TAIL_BYTES` (8 KB)
of the response body as a deque of chunks, O(1) per chunk, no parsing. At end of stream
`parse_usage` finds the last `"usage"` key in the tail whose value is an object (an SSE stream
with `stream_options.include_usage` ends with the usage chunk; a plain JSON body has it near its
end), cuts that object out by brace matching and parses only it. Three shapes, as vLLM writes them:
- Completions and Chat: `prompt_tokens` and `prompt_tokens_details.cached_tokens`;
- Responses: `input_tokens` (the whole prompt) and `input_tokens_details.cached_tokens`;
- Anthropic Messages: the prompt is `input_tokens + cache_read_input_tokens +
  cache_creation_input_tokens` (Anthropic counts `input_tokens` after the cached part) and the
  cached part is `cache_read_input_tokens` (the final `message_delta` repeats the whole usage).
Nothing is reported when the prompt or the cached count is missing (e.g. a stream without
include_usage, an engine without `--enable-prompt-tokens-details`, an error body).

Predictions for the chosen endpoint, in tokens, both capped at what vLLM can reuse,
`reusable = (prompt_tokens - 1) // B * B` (the last prompt token is always recomputed), B = the
engine block size (scraped `vllm:cache_config_info`, else the KV-event block size / flag):
- approximate: the matched byte-blocks cover `matched_bytes` of the prompt's `prompt_bytes`
  (segment framing included); tokens = floor(matched_bytes * prompt_tokens / prompt_bytes / B) * B.
  The byte->token ratio is the request's own, from the reported prompt_tokens.
- precise: matched blocks x B when the endpoint's events were usable at decision time; otherwise
  the precise scorer fell back to the approximate index, and so does its prediction.
Both are computed for every sampled request when KV events are enabled (whichever scorer
routed); without events only the approximate one. Reported once per response (`Report`): the
engine's usage, which gives the served hit rate (cached / prompt tokens), and each scorer's
prediction for it, which gives the predicted hit rate on the same responses and the absolute
error in tokens (within one block: |error| <= B).

Sampling (`UsageSampler`, `--usage-sample-rate` r): the response body reaches the picker only for
the requests the sampler picks, because every streamed chunk the proxy sends costs a gRPC round
trip. The sampler is a deterministic accumulator (`credit += r`; sample and `credit -= 1` when it
reaches 1), so exactly one request in 1/r is sampled, evenly spread, with no random state.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson

TAIL_BYTES = 8192


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int


Report = Callable[[Usage, dict[str, int], int], None]  # (usage, predicted cached tokens per scorer, B)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the picker believed at decision time about the chosen endpoint."""

    block_size: int  # engine tokens per block
    approx_matched_bytes: int
    prompt_bytes: int
    precise_blocks: int | None  # None: KV events off or unusable for this request
    precise_enabled: bool  # KV events on and the request had token keys


class UsageTail:
    __slots__ = ("_chunks", "_size", "limit")

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0

    def feed(self, data: bytes) -> None:
        if not data:
            return
        chunks = self._chunks
        chunks.append(data)
        self._size += len(data)
        while len(chunks) > 1 and self._size - len(chunks[0]) >= self.limit:
            self._size -= len(chunks.popleft())

    def tail(self) -> bytes:
        data = b"".join(self._chunks)
        return data[-self.limit:] if len(data) > self.limit else data


def _object_end(data: bytes, start: int) -> int:
    """Index after the JSON object starting at data[start] == '{'; -1 if it is cut off."""
    depth, i, n, in_str = 0, start, len(data), False
    while i < n:
        c = data[i]
        if in_str:
            if c == 0x5C:  # backslash
                i += 1
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def parse_usage(tail: bytes) -> Usage | None:
    """The last usage object with prompt_tokens and cached_tokens in `tail`, or None."""
    pos = len(tail)
    while True:
        pos = tail.rfind(b'"usage"', 0, pos)
        if pos < 0:
            return None
        i = pos + 7
        while i < len(tail) and tail[i] in b" \t\r\n:":
            i += 1
        if i < len(tail) and tail[i] == 0x7B:
            end = _object_end(tail, i)
            if end > 0:
                try:
                    obj = orjson.loads(tail[i:end])
                except orjson.JSONDecodeError:
                    obj = None
                usage = _usage(obj)
                if usage is not None:
                    return usage


def _usage(obj: object) -> Usage | None:
    """Prompt and cached tokens from one usage object of any of the three shapes (module docstring)."""
    if not isinstance(obj, dict):
        return None
    if "prompt_tokens" in obj:  # Completions, Chat
        prompt, details = obj.get("prompt_tokens"), obj.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
    elif "input_tokens_details" in obj:  # Responses
        prompt, details = obj.get("input_tokens"), obj.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
    else:  # Anthropic Messages
        uncached, cached = obj.get("input_tokens"), obj.get("cache_read_input_tokens")
        created = obj.get("cache_creation_input_tokens", 0)
        if type(uncached) is not int or type(cached) is not int or type(created) is not int:
            return None
        prompt = uncached + cached + created
    if type(prompt) is not int or type(cached) is not int or not 0 <= cached <= prompt:
        return None
    return Usage(prompt, cached)


def matched_bytes(segment_lengths: Sequence[int], block_size: int, matched_blocks: int) -> int:
    """Prompt bytes covered by the first `matched_blocks` approximate blocks (segment-aligned)."""
    covered, left = 0, matched_blocks
    for n in segment_lengths:
        blocks = -(-n // block_size)
        if left >= blocks:
            covered += n
            left -= blocks
        else:
            return covered + left * block_size
        if left == 0:
            break
    return covered


def predictions(p: Prediction, usage: Usage) -> dict[str, int]:
    """Predicted cached tokens per scorer for the reported prompt (see the module docstring)."""
    bs = max(1, p.block_size)
    reusable = max(0, (usage.prompt_tokens - 1) // bs * bs)
    approx = 0
    if p.prompt_bytes > 0:
        approx = p.approx_matched_bytes * usage.prompt_tokens // p.prompt_bytes // bs * bs
    out = {"approximate": min(approx, reusable)}
    if p.precise_enabled:
        out["precise"] = out["approximate"] if p.precise_blocks is None else min(p.precise_blocks * bs, reusable)
    return out


class UsageSampler:
    """Picks `rate` of the calls to `take()` (0: none, 1: all), evenly spread."""

    __slots__ = ("_credit", "rate")

    def __init__(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"usage sample rate must be within [0, 1], got {rate}")
        self.rate = rate
        self._credit = 0.0

    def take(self) -> bool:
        self._credit += self.rate
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False


class UsageTracker:
    """One response: feed body chunks, then `finish()` reports the comparison once."""

    __slots__ = ("_prediction", "_report", "_tail")

    def __init__(self, prediction: Prediction, report: Report, limit: int = TAIL_BYTES) -> None:
        self._prediction = prediction
        self._report = report
        self._tail = UsageTail(limit)

    def feed(self, data: bytes) -> None:
        self._tail.feed(data)

    def finish(self) -> dict[str, int] | None:
        usage = parse_usage(self._tail.tail())
        if usage is None:
            return None
        out = predictions(self._prediction, usage)
        self._report(usage, out, max(1, self._prediction.block_size))
        return out
