"""P/D deciders: given the decode pick, should the prompt be prefilled elsewhere? (llm-d's names)

- `prefix-based-pd-decider` (parameters `nonCachedTokens`, `promptTokens`; EppConfig.disagg):
  disaggregate when the prompt's tokens NOT cached on the chosen decode endpoint are at least
  `nonCachedTokens`, and the prompt has at least `promptTokens` tokens (0: no such gate).
  `nonCachedTokens` 0 never disaggregates (llm-d's default, which turns the decider off).
  The prompt's tokens are the tokenizer's count where the request was tokenized (precise routing),
  else its UTF-8 bytes / PrefixConfig.bytes_per_token (4; llm-d's characters / 4), rounded up. The cached
  share is the decode endpoint's match: the precise index's (blocks matched / the prompt's blocks)
  where its KV events are usable, else the approximate index's (matched blocks x block bytes,
  at most the prompt, / the prompt's bytes). uncached = tokens x (1 - cached share).
- `always-disagg-pd-decider`: disaggregate every request.

`decide(request, decode)` returns (disaggregate?, the uncached tokens estimated); the number goes
into the decision's explanation either way.
"""

from __future__ import annotations

import math
from typing import Protocol

from extproc.config.settings import DisaggConfig
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scheduler import Decision

PREFIX_BASED = "prefix-based-pd-decider"
ALWAYS = "always-disagg-pd-decider"
DECIDERS = (PREFIX_BASED, ALWAYS)


class Decider(Protocol):
    name: str

    def decide(self, request: SchedulingRequest, decode: Decision) -> tuple[bool, int]: ...


def prompt_tokens(request: SchedulingRequest, bytes_per_token: int) -> int:
    """The tokenizer's count, else the prompt's bytes / bytes_per_token rounded up."""
    return request.prompt_tokens or math.ceil(request.prompt_bytes / bytes_per_token)


def uncached_tokens(request: SchedulingRequest, decode: Decision, block_size_bytes: int,
                    bytes_per_token: int) -> int:
    """The prompt's tokens the decode endpoint's cache does not hold, by the index that routed it."""
    tokens = prompt_tokens(request, bytes_per_token)
    if decode.precise_usable and decode.precise_total and decode.precise_matched is not None:
        share = decode.precise_matched / decode.precise_total
    elif request.prompt_bytes:
        share = min(decode.matched_blocks * block_size_bytes, request.prompt_bytes) / request.prompt_bytes
    else:
        share = 0.0
    return max(0, round(tokens * (1.0 - min(share, 1.0))))


class PrefixBasedDecider:
    name = PREFIX_BASED

    def __init__(self, config: DisaggConfig, block_size_bytes: int, bytes_per_token: int) -> None:
        self.non_cached_tokens = config.non_cached_tokens
        self.prompt_tokens = config.prompt_tokens
        self.block_size_bytes = block_size_bytes
        self.bytes_per_token = bytes_per_token

    def decide(self, request: SchedulingRequest, decode: Decision) -> tuple[bool, int]:
        uncached = uncached_tokens(request, decode, self.block_size_bytes, self.bytes_per_token)
        if self.non_cached_tokens <= 0:
            return False, uncached
        if self.prompt_tokens and prompt_tokens(request, self.bytes_per_token) < self.prompt_tokens:
            return False, uncached
        return uncached >= self.non_cached_tokens, uncached


class AlwaysDecider:
    name = ALWAYS

    def __init__(self, block_size_bytes: int, bytes_per_token: int) -> None:
        self.block_size_bytes = block_size_bytes
        self.bytes_per_token = bytes_per_token

    def decide(self, request: SchedulingRequest, decode: Decision) -> tuple[bool, int]:
        return True, uncached_tokens(request, decode, self.block_size_bytes, self.bytes_per_token)
