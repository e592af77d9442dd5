"""Benchmark workloads: seeded request sequences, defined once and shared by every router.

A workload is a tuple of `Session`s. A session starts at a planned time (seconds after the run
begins; sessions start as a Poisson process, i.e. exponential gaps at `rate` per second, open
loop: a slow router does not slow the arrivals) and sends its turns one after another. Single-
shot workloads have one turn per session; a chat conversation sends turn k+1 `think_s[k]`
seconds after turn k's response ended, with turn k's actual answer in its history. `body()`
builds the request of a turn from the answers so far; the load generator (`bench.lib.client`) and
the oracle (`bench.lib.oracle`) both use it, so they see the same prompts.

Text: prompts are seeded random words of at most 10 letters, one token each under
`extproc.tokenization.builtin` (a fixed header is counted and topped up), so token lengths are exact.

Workloads (token counts are `extproc.tokenization.builtin` tokens; every request asks for `max_tokens` and
streams with usage):

- `shared-prefix` (/v1/completions): `groups` x `per_group` requests; a request is its group's
  system prompt (`system_tokens`) plus its own question (`question_tokens`). The requests are
  shuffled over the whole run, so a group's prompts arrive spread out in time, and arrive at
  `rate` per second.
- `multi-turn` (/v1/chat/completions): `conversations` chats of `turns` turns. Each uses one of
  `system_prompts` shared system prompts (`system_tokens`); its first user message carries
  `first_user_tokens` (a pasted document), later ones `user_tokens`; the history includes the
  previous assistant answers. Conversations start at `rate` per second; think time between
  turns is exponential with mean `think_s`.
- `hot-prefix` (/v1/completions): like `shared-prefix`, but a `hot_share` (0.5) of the requests
  use ONE system prompt (each with its own question); the rest are `groups` x `per_group`
  shared-prefix requests. The two kinds are shuffled together.
- `cache-pressure` (/v1/completions): `shared-prefix` traffic on small KV caches: the prefix
  working set is 1.15x the POOL's whole KV cache (no running headroom on top), so replicas evict
  and the approximate index, which only sees routing decisions, goes stale (precise vs approximate).
- `no-reuse` (/v1/completions): unrelated prompts of `system_tokens + question_tokens` tokens,
  each starting with its own header, so no two requests share a block.
- `mixed-length` (/v1/completions): request counts mislead. `short_requests` prompts of
  `short_system_tokens + short_question_tokens` (700 + 300) tokens, each from one of
  `short_systems` (8) shared system prompts with its own question, plus `long_docs` documents of
  `long_doc_tokens` (29,500) tokens, each asked 2 or 3 times (alternately) with its own
  `long_question_tokens` (500) question: 30,000-token prompts, 5% of the requests and about
  60% of the prompt tokens. All shuffled together, Poisson arrivals at `rate` per second. KV
  headroom is `MIXED_RUNNING_HEADROOM` (4) of the 30k-token requests, not 8.
- `mixed-shapes` (every shape: completions, chat with tools, /v1/messages, /v1/responses, chat
  with an image): conversations dealt over the shapes, see bench/lib/shapes_workload.py.
- `bursts` (/v1/completions): `bursts` bursts of `per_burst` (50) requests, one every `gap_s`
  (4) seconds; a burst's requests share a system prompt no earlier request used
  (`system_tokens`, 6000) and each has its own question (`question_tokens`, 1200); they arrive
  uniformly within `spread_s` (0.1) seconds of the burst's start. Nothing arrives between bursts.
  KV headroom is `BURST_RUNNING_HEADROOM` (16) requests per replica, so a burst spread over the
  pool is admitted at once.

Real vLLM (`--backend vllm`): bench/lib/vllm_workloads.py sizes shared-prefix, multi-turn and
cache-pressure for two one-core engines from these generators.

Scaling. The Inference Extension's prefix-cache benchmark sends 150 groups x 5 prompts with a
6000-token system prompt and a 1200-token question to a pool of GPUs. Here the prompt sizes are
kept (6000 + 1200 tokens: per-request prefill cost, which is what prefix caching saves, stays
that of the real benchmark) and the number of groups is cut to 48 (`--quick`: 16), so one run
takes about 50 s of load on simulated replicas running in real time (`--time-scale 1`); output
is 64 tokens instead of hundreds (decoding is what prefix routing does not change, and every
streamed token costs CPU on a 2-core machine). The KV cache is scaled with the workload (see
`kv_cache_blocks`), so cache pressure is what the real benchmark creates: the prefix working
set fits the pool but not one replica. Rates are calibrated (docs/benchmarks.md) so the
round-robin pool is busy (queues form on the replicas) but not collapsed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from extproc.tokenization.builtin import count

Api = Literal["completion", "chat", "completion_turns", "chat_tools", "messages", "responses", "chat_image"]
MODEL = "sim-model"
PATHS: Mapping[Api, str] = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
POOL_FACTOR = 2.0  # the pool holds the working set this many times over...
MAX_REPLICA_SHARE = 0.75  # ...but one replica never more than this share of it
RUNNING_HEADROOM = 8  # room for this many of the largest requests running, on top
PRESSURE_POOL_FACTOR = 1 / 1.15  # cache-pressure: working set = 1.15x the pool's KV cache, no headroom
MIXED_RUNNING_HEADROOM = 4  # mixed-length: room for 4 of its 30k-token requests running, not 8
BURST_RUNNING_HEADROOM = 16  # bursts: a quarter of a 50-request burst runs on each replica at once

# Short, common words: each is one token with its leading space (at most 10 letters).
_WORD_TEXT = """
time year people way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health
person art war history party result change morning reason research girl guy moment air teacher force
education foot boy age policy music market sense nation plan college interest death experience effect
class control care field development role effort rate heart drug show leader light voice wife police
mind price report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure street
image phone data picture practice piece land product doctor wall patient worker news test movie north
love support technology step baby computer type attention film tree source organization hair window
evidence population truth song energy period course summer plant opportunity term letter condition
choice rule daughter administration south husband floor campaign material
"""
_WORDS = tuple(w for w in _WORD_TEXT.split() if len(w) <= 10)


@dataclass(frozen=True)
class Session:
    """Requests one client sends one after another (one turn, or a conversation's turns)."""

    id: int
    start_s: float  # planned start, seconds after the run begins
    api: Api
    prompts: tuple[str, ...]  # completion: the prompt; chat: each turn's user message
    max_tokens: int
    system: str = ""  # chat: the system prompt
    think_s: tuple[float, ...] = ()  # chat: pause after turn k's response before turn k+1
    label: str = ""  # what the session belongs to ("g7", "hot", "conv12", ...), for analysis
    sampling: tuple[tuple[str, Any], ...] = ()  # extra body fields of every request (VLLM_SAMPLING)

    @property
    def turns(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    pool_factor: float = POOL_FACTOR  # KV-cache sizing, see kv_cache_blocks
    running_headroom: int = RUNNING_HEADROOM

    @property
    def requests(self) -> int:
        return sum(s.turns for s in self.sessions)

    @property
    def duration_s(self) -> float:
        """Planned start of the last session."""
        return max((s.start_s for s in self.sessions), default=0.0)


def body(session: Session, turn: int, answers: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of a session's turn, given the answers to its earlier turns."""
    common = {"model": MODEL, "max_tokens": session.max_tokens, "stream": True,
              "stream_options": {"include_usage": True}, **dict(session.sampling)}
    if session.api not in PATHS:  # the other shapes of `mixed-shapes` (bench.lib.shapes_workload)
        from bench.lib.shapes_workload import shaped_body

        return shaped_body(session.api, session.system, session.prompts, turn, answers, common)
    if session.api == "completion":
        return PATHS["completion"], {**common, "prompt": session.prompts[turn]}
    messages: list[dict[str, str]] = []
    if session.system:
        messages.append({"role": "system", "content": session.system})
    for k in range(turn):
        messages.append({"role": "user", "content": session.prompts[k]})
        messages.append({"role": "assistant", "content": answers[k]})
    messages.append({"role": "user", "content": session.prompts[turn]})
    return PATHS["chat"], {**common, "messages": messages}


def text(rng: random.Random, tokens: int, header: str) -> str:
    """`header` followed by random words, exactly `tokens` tokens long (at least the header's)."""
    fill = tokens - count(header)
    if fill <= 0:
        return header
    return header + "".join(" " + w for w in rng.choices(_WORDS, k=fill))


def poisson_starts(rng: random.Random, n: int, rate: float) -> list[float]:
    """n arrival times of a Poisson process with `rate` per second; the first at 0."""
    starts, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        starts.append(t)
    return starts


# --- the workloads --------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedPrefixParams:
    groups: int = 90
    per_group: int = 5
    system_tokens: int = 6000
    question_tokens: int = 1200
    max_tokens: int = 64
    rate: float = 10.0  # requests per second
    hot_share: float = 0.0  # hot-prefix: share of requests using the one hot system prompt
    hot_requests: int = 0  # hot-prefix: set by hot_prefix(); number of hot requests
    seed: int = 0


def _completion_sessions(rng: random.Random, rate: float, max_tokens: int,
                         items: list[tuple[str, str]]) -> tuple[Session, ...]:
    starts = poisson_starts(rng, len(items), rate)
    return tuple(Session(i, starts[i], "completion", (prompt,), max_tokens, label=label)
                 for i, (label, prompt) in enumerate(items))


def shared_prefix(p: SharedPrefixParams = SharedPrefixParams(), name: str = "shared-prefix") -> Workload:
    rng = random.Random(f"{name}:{p.seed}")
    systems = [text(rng, p.system_tokens, f"System prompt of group {g}:") for g in range(p.groups)]
    items: list[tuple[str, str]] = []
    for g in range(p.groups):
        for q in range(p.per_group):
            items.append((f"g{g}", systems[g] + text(rng, p.question_tokens, f"\nQuestion {g}.{q}:")))
    if p.hot_requests:
        hot = text(rng, p.system_tokens, "System prompt of the hot application:")
        for q in range(p.hot_requests):
            items.append(("hot", hot + text(rng, p.question_tokens, f"\nHot question {q}:")))
    rng.shuffle(items)
    return Workload(name, _completion_sessions(rng, p.rate, p.max_tokens, items), vars(p))


def hot_prefix(p: SharedPrefixParams = SharedPrefixParams(groups=45, hot_share=0.5)) -> Workload:
    """A `hot_share` of all requests uses one system prompt; the rest are `p.groups` x `p.per_group`."""
    rest = p.groups * p.per_group
    hot = round(rest * p.hot_share / (1.0 - p.hot_share))
    return shared_prefix(replace(p, hot_requests=hot), name="hot-prefix")


@dataclass(frozen=True)
class NoReuseParams:
    requests: int = 270
    tokens: int = 7200
    max_tokens: int = 64
    rate: float = 6.0
    seed: int = 0


def no_reuse(p: NoReuseParams = NoReuseParams()) -> Workload:
    rng = random.Random(f"no-reuse:{p.seed}")
    items = [("r", text(rng, p.tokens, f"Request {i} stands alone:")) for i in range(p.requests)]
    return Workload("no-reuse", _completion_sessions(rng, p.rate, p.max_tokens, items), vars(p))


@dataclass(frozen=True)
class MultiTurnParams:
    conversations: int = 112
    turns: int = 6
    system_prompts: int = 4
    system_tokens: int = 1500
    first_user_tokens: int = 3000
    user_tokens: int = 500
    max_tokens: int = 64
    rate: float = 3.5  # conversation starts per second
    think_s: float = 2.0  # mean pause between a response and the next user turn
    seed: int = 0


def multi_turn(p: MultiTurnParams = MultiTurnParams()) -> Workload:
    rng = random.Random(f"multi-turn:{p.seed}")
    systems = [text(rng, p.system_tokens, f"You are assistant number {a}.") for a in range(p.system_prompts)]
    starts = poisson_starts(rng, p.conversations, p.rate)
    sessions = []
    for c in range(p.conversations):
        prompts = tuple(
            text(rng, p.first_user_tokens if t == 0 else p.user_tokens, f"Conversation {c}, turn {t}:")
            for t in range(p.turns))
        think = tuple(rng.expovariate(1.0 / p.think_s) for _ in range(p.turns - 1))
        sessions.append(Session(c, starts[c], "chat", prompts, p.max_tokens, system=rng.choice(systems),
                                think_s=think, label=f"conv{c}"))
    return Workload("multi-turn", tuple(sessions), vars(p))


def cache_pressure(p: SharedPrefixParams = SharedPrefixParams()) -> Workload:
    """shared-prefix traffic (own seed); the pool's whole KV cache is 1/1.15 of its prefix working set."""
    w = shared_prefix(p, name="cache-pressure")
    return replace(w, pool_factor=PRESSURE_POOL_FACTOR, running_headroom=0,
                   params={**w.params, "pool_factor": round(PRESSURE_POOL_FACTOR, 4), "running_headroom": 0})


@dataclass(frozen=True)
class MixedLengthParams:
    short_requests: int = 950
    short_systems: int = 8
    short_system_tokens: int = 700
    short_question_tokens: int = 300
    long_docs: int = 20  # asked 2, 3, 2, 3, ... times: 50 long requests
    long_doc_tokens: int = 29_500
    long_question_tokens: int = 500
    max_tokens: int = 64
    rate: float = 20.0  # requests per second
    seed: int = 0


def mixed_length(p: MixedLengthParams = MixedLengthParams()) -> Workload:
    """Many ~1k-token prompts from a few shared system prompts; a few 30k-token documents asked 2-3 times."""
    rng = random.Random(f"mixed-length:{p.seed}")
    systems = [text(rng, p.short_system_tokens, f"System prompt of tool {s}:") for s in range(p.short_systems)]
    items: list[tuple[str, str]] = []
    for q in range(p.short_requests):
        s = rng.randrange(p.short_systems)
        items.append((f"s{s}", systems[s] + text(rng, p.short_question_tokens, f"\nShort question {q}:")))
    for d in range(p.long_docs):
        doc = text(rng, p.long_doc_tokens, f"Document {d} to read:")
        for q in range(2 + d % 2):
            items.append((f"doc{d}", doc + text(rng, p.long_question_tokens, f"\nAbout document {d}, question {q}:")))
    rng.shuffle(items)
    return Workload("mixed-length", _completion_sessions(rng, p.rate, p.max_tokens, items), vars(p),
                    running_headroom=MIXED_RUNNING_HEADROOM)


@dataclass(frozen=True)
class BurstParams:
    bursts: int = 12
    per_burst: int = 50
    gap_s: float = 4.0  # from one burst's start to the next
    spread_s: float = 0.1  # a burst's requests arrive within this many seconds
    system_tokens: int = 6000
    question_tokens: int = 1200
    max_tokens: int = 64
    seed: int = 0


def bursts(p: BurstParams = BurstParams()) -> Workload:
    """Bursts of `per_burst` requests on a new shared prefix each, every `gap_s` seconds, within `spread_s`."""
    rng = random.Random(f"bursts:{p.seed}")
    sessions: list[Session] = []
    for b in range(p.bursts):
        system = text(rng, p.system_tokens, f"System prompt of burst {b}:")
        starts = sorted(b * p.gap_s + rng.uniform(0.0, p.spread_s) for _ in range(p.per_burst))
        for q, start in enumerate(starts):
            prompt = system + text(rng, p.question_tokens, f"\nBurst {b} question {q}:")
            sessions.append(Session(len(sessions), start, "completion", (prompt,), p.max_tokens, label=f"b{b}"))
    return Workload("bursts", tuple(sessions), vars(p), running_headroom=BURST_RUNNING_HEADROOM)


WORKLOADS = ("shared-prefix", "multi-turn", "hot-prefix", "no-reuse", "cache-pressure", "mixed-length", "bursts",
             "mixed-shapes")


def build(name: str, quick: bool = False, seed: int = 0, load: float = 1.0, max_tokens: int = 0) -> Workload:
    """The named workload at benchmark scale (`quick`: about a third of the requests).

    `load` multiplies the arrival rate (for calibration on another machine); `max_tokens` (> 0)
    replaces every request's output length (a simulator profile's long outputs, bench.lib.profiles).
    """
    out = {"max_tokens": max_tokens} if max_tokens > 0 else {}
    if name == "shared-prefix":
        sp = SharedPrefixParams(groups=30 if quick else 90, seed=seed)
        return shared_prefix(replace(sp, rate=sp.rate * load, **out))
    if name == "hot-prefix":
        hp = SharedPrefixParams(groups=15 if quick else 45, hot_share=0.5, seed=seed)
        return hot_prefix(replace(hp, rate=hp.rate * load, **out))
    if name == "multi-turn":
        mt = MultiTurnParams(conversations=40 if quick else 112, seed=seed)
        return multi_turn(replace(mt, rate=mt.rate * load, **out))
    if name == "cache-pressure":
        cp = SharedPrefixParams(groups=30 if quick else 90, seed=seed)
        return cache_pressure(replace(cp, rate=cp.rate * load, **out))
    if name == "no-reuse":
        nr = NoReuseParams(requests=90 if quick else 270, seed=seed)
        return no_reuse(replace(nr, rate=nr.rate * load, **out))
    if name == "mixed-length":
        ml = MixedLengthParams(short_requests=317 if quick else 950, long_docs=7 if quick else 20, seed=seed)
        return mixed_length(replace(ml, rate=ml.rate * load, **out))
    if name == "bursts":  # `load` shortens the gaps; a burst stays 50 requests within 100 ms
        bp = BurstParams(bursts=4 if quick else 12, seed=seed)
        return bursts(replace(bp, gap_s=bp.gap_s / load, **out))
    if name == "mixed-shapes":  # every request shape (bench.lib.shapes_workload)
        from bench.lib.shapes_workload import MixedShapesParams, mixed_shapes

        ms = MixedShapesParams(conversations=30 if quick else 60, seed=seed)
        return mixed_shapes(replace(ms, rate=ms.rate * load, **out))
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def kv_cache_blocks(working_set_blocks: int, largest_request_blocks: int, replicas: int,
                    pool_factor: float = POOL_FACTOR, running_headroom: int = RUNNING_HEADROOM) -> int:
    """Per-replica KV-cache size: the pool holds the prefix working set, one replica does not.

    `pool_factor` (POOL_FACTOR, 2; cache-pressure 1/1.15, and no headroom: the pool is smaller than
    the working set) x the working set spread over the replicas, but at most MAX_REPLICA_SHARE
    (0.75) of it per replica, plus room for RUNNING_HEADROOM (8) of the largest requests (a
    running request reserves its prompt and output blocks; without the headroom the cached
    prefixes could not stay while requests run).
    """
    share = min(pool_factor / replicas, MAX_REPLICA_SHARE)
    return math.ceil(share * working_set_blocks) + running_headroom * largest_request_blocks
