"""The oracle bound: the prefix-cache hit rate with an infinite cache shared by every replica.

Every request is tokenised exactly as the simulator does (`extproc.tokenization.builtin`: a completion's
prompt as is, chat messages through `render_chat`) and cut into full blocks of `block_size` (16)
tokens hashed as chains (`prefix_epp_sim.kvcache.hash_blocks`). Requests are taken in session
order (sessions by planned start, a conversation's turns in order). A request's cached tokens
are its leading blocks already seen, capped as vLLM caps them (the last prompt token is always
computed: at most `(prompt_tokens - 1) // block_size` blocks); then its prompt blocks and the
full blocks of prompt + generated tokens (all but the last token, as the simulator stores them
at finish) become seen. No router can beat this with these caches; `hit_rate / oracle` reads
as the fraction of the possible.

The same pass yields the workload's prefix working set: the distinct blocks that some later
request hits (what `bench.lib.workloads.kv_cache_blocks` sizes the caches from).

Chat answers are the simulator's deterministic output (`prefix_epp_sim.output.output_text`), which
is what the load generator puts into the history of the next turn.

Real vLLM (`vllm_oracle`): the same pass at the engines' block size (32) over the tiny model's
real token ids (`extproc.tokenization.tokenizer_json.HFTokenizer` on its tokenizer.json: a
completion's prompt with its BOS, chat messages through the model's chat template, as vLLM's
/tokenize computes them). The model's answers are not known before it runs, so each answer
stands in as `max_tokens` words of the model's own vocabulary (`testkit.tiny_model.TEXT`) and its
generated ids as `max_tokens` placeholder tokens: the same lengths, other contents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import orjson

from bench.lib.cache_bound import BlockTrace
from bench.lib.workloads import MODEL, Session, Workload, body
from extproc.request.openai import Api, parse_request
from extproc.tokenization.builtin import encode, render_chat
from extproc.tokenization.tokenizer_json import HFTokenizer
from prefix_epp_sim.kvcache import block_hash_seed
from prefix_epp_sim.output import output_text, output_token_ids
from prefix_epp_sim.shapes import as_chat
from testkit.tiny_model import TEXT

BLOCK_SIZE = 16  # tokens per KV block of the bench's simulated replicas (bench.lib.routers.SimSettings)
VLLM_BLOCK_SIZE = 32  # tokens per KV block of the real engines (testkit.vllm.BLOCK_SIZE)
Tokens = Callable[[str, dict[str, object]], list[int]]  # (path, request body) -> prompt token ids
PLACEHOLDER = 2**32 - 1  # a generated token id outside the vocabulary (vllm_answer)
Answer = Callable[[int], tuple[str, list[int]]]  # max_tokens -> (answer text, generated token ids)


@dataclass(frozen=True)
class OracleResult:
    prompt_tokens: int
    cached_tokens: int
    working_set_blocks: int  # distinct blocks hit at least once
    largest_request_blocks: int  # blocks of the longest prompt + output

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def oracle(requests: Iterable[tuple[Sequence[int], Sequence[int]]], block_size: int = BLOCK_SIZE,
           seed: int = 0) -> OracleResult:
    """Infinite-cache hits of (prompt token ids, generated token ids) pairs, in order."""
    pairs = list(requests)
    return _traced(pairs, [BlockTrace.of(p, o, block_size, seed) for p, o in pairs], block_size)


def _traced(requests: Sequence[tuple[Sequence[int], Sequence[int]]], traces: Sequence[BlockTrace],
            block_size: int) -> OracleResult:
    """The oracle over the requests' blocks (`BlockTrace`: what each looks up and stores)."""
    seen: set[int] = set()
    reused: set[int] = set()
    prompt_total = cached_total = 0
    for trace in traces:
        hits = 0
        for h in trace.looked_up:
            if h not in seen:
                break
            reused.add(h)
            hits += 1
        prompt_total += trace.prompt_tokens
        cached_total += hits * block_size
        seen.update(trace.stored)
    largest = max((-(-(len(p) + len(o)) // block_size) for p, o in requests), default=0)
    return OracleResult(prompt_total, cached_total, len(reused), largest)


def prompt_tokens(path: str, request: dict[str, object]) -> list[int]:
    """Token ids the simulator computes for a request body (Messages and Responses as the chat
    request it serves them as, prefix_epp_sim/shapes.py)."""
    for suffix, shape in (("/v1/messages", "messages"), ("/v1/responses", "responses")):
        if path.endswith(suffix):
            request, path = as_chat(request, shape), "/v1/chat/completions"
    if path.endswith("/chat/completions"):
        messages = request["messages"]
        assert isinstance(messages, list)
        return encode(render_chat(messages))
    prompt = request["prompt"]
    assert isinstance(prompt, str)
    return encode(prompt)


def sim_answer(max_tokens: int) -> tuple[str, list[int]]:
    return output_text(0, max_tokens), output_token_ids(max_tokens)


def _in_order(workload: Workload) -> list[Session]:
    """The sessions in the order their requests are listed (`workload_requests`, `_request_keys`)."""
    return sorted(workload.sessions, key=lambda s: (s.start_s, s.id))


def _request_keys(workload: Workload) -> list[tuple[int, int]]:
    """(session id, turn) of each request, in the order `workload_requests` lists them."""
    return [(s.id, turn) for s in _in_order(workload) for turn in range(s.turns)]


def workload_requests(workload: Workload, tokens: Tokens = prompt_tokens,
                      answer: Answer = sim_answer) -> list[tuple[list[int], list[int]]]:
    out: list[tuple[list[int], list[int]]] = []
    for session in _in_order(workload):
        text, generated = answer(session.max_tokens)
        for turn in range(session.turns):
            path, request = body(session, turn, [text] * turn)
            out.append((tokens(path, request), generated))
    return out


def workload_oracle(workload: Workload, block_size: int = BLOCK_SIZE) -> OracleResult:
    return oracle(workload_requests(workload), block_size, block_hash_seed(MODEL))


def traced_oracle(workload: Workload, block_size: int = BLOCK_SIZE, tokens: Tokens = prompt_tokens,
                  answer: Answer = sim_answer) -> tuple[OracleResult, dict[tuple[int, int], BlockTrace]]:
    """The oracle, and each request's blocks by (session id, turn) for `bench.lib.cache_bound`,
    from one tokenization."""
    requests, seed = workload_requests(workload, tokens, answer), block_hash_seed(MODEL)
    traces = [BlockTrace.of(p, o, block_size, seed) for p, o in requests]
    return _traced(requests, traces, block_size), dict(zip(_request_keys(workload), traces, strict=True))


def vllm_tokens(tokenizer: HFTokenizer) -> Tokens:
    """Prompt token ids as vLLM computes them for a request body (module docstring)."""
    def tokens(path: str, request: dict[str, object]) -> list[int]:
        api = Api.CHAT if path.endswith("/chat/completions") else Api.COMPLETIONS
        ids = tokenizer.encode(parse_request(api, orjson.dumps(request)))
        if ids is None:
            raise ValueError(f"the model's tokenizer cannot encode a {path} request")
        return ids
    return tokens


def vllm_answer(max_tokens: int) -> tuple[str, list[int]]:
    words = TEXT.split()
    return " ".join(words[i % len(words)] for i in range(max_tokens)), [PLACEHOLDER] * max_tokens


def vllm_oracle(workload: Workload, tokenizer: HFTokenizer, block_size: int = VLLM_BLOCK_SIZE) -> OracleResult:
    """The infinite-cache bound on real vLLM: real token ids, the engines' block size."""
    return oracle(workload_requests(workload, vllm_tokens(tokenizer), vllm_answer), block_size,
                  block_hash_seed(MODEL))


def pooled_oracle(oracles: Sequence[dict[str, OracleResult]]) -> dict[str, OracleResult]:
    """Per workload, the oracle over several draws' requests (its hit rate: their pooled tokens)."""
    out: dict[str, OracleResult] = {}
    for w in oracles[0]:
        runs = [o[w] for o in oracles]
        out[w] = OracleResult(sum(o.prompt_tokens for o in runs), sum(o.cached_tokens for o in runs),
                              max(o.working_set_blocks for o in runs), max(o.largest_request_blocks for o in runs))
    return out
