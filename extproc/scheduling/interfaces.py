"""Plugin contracts of the scheduler. Scoring is pure and synchronous: endpoints + request in, scores out.

- `Filter.filter(request, endpoints)` returns the endpoints that may serve the request, in order.
- `Scorer.score(request, endpoints)` returns one score in [0, 1] per endpoint (higher is better);
  the scheduler clamps and multiplies by the scorer's weight.
- `Picker.pick(endpoints, totals, n)` returns up to n endpoints, best first.

`SchedulingRequest` carries what plugins read; the scheduler fills `prefix_match` (blocks held per
endpoint) explicitly before scorers run, so no scorer silently produces data for another. With KV
events on, the director adds `token_keys` (our keys of the prompt's token blocks) and the scheduler
fills `precise_match` and `precise_usable` from the `PreciseSource` (extproc/kvevents/manager.py).
With an affinity hint (extproc/control/affinity.py) the director sets `affinity_hash` and the
scheduler fills `affinity_match`: the candidates that recorded the same hash before.
Scorers that keep state about where requests went (predicted-ttft-scorer's backlogs) are
`PickObserver`s: the scheduler tells them the pick, a fallback's move and the response's end.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from extproc.core.datastore import Endpoint


@dataclass(slots=True)
class Routing:
    """What predicted-ttft-scorer charged the request on the endpoint it routed it to, kept until
    its response ends (occupancy and calibration, extproc/scheduling/latency.py)."""

    endpoint: str
    at: float  # clock of the pick
    base_ms: float  # predicted TTFT without the endpoint's slowdown and slot wait
    wait_ms: float  # the slot wait charged (extproc/scheduling/slots.py)
    decode_ms: float  # predicted decode time of its output without slowdown; -1: output length unknown
    token: int = 0  # its place among the endpoint's own in-flight requests (slots.py's ages)


@dataclass(slots=True)
class SchedulingRequest:
    request_id: str
    model: str
    block_hashes: list[int] = field(default_factory=list)
    priority: int = 0
    prefix_match: dict[str, int] = field(default_factory=dict)
    token_keys: list[int] | None = None  # None: no precise lookup for this request
    # Where tokenizing stopped at the first block no endpoint holds (extproc/kvevents/lookahead.py):
    # the whole prompt's blocks, estimated; else 0 (token_keys are all of them).
    token_blocks: int = 0
    precise_match: dict[str, int] = field(default_factory=dict)  # leading blocks held, on any KV cache tier
    precise_usable: frozenset[str] = frozenset()  # endpoints whose KV events are trustworthy now
    # precise_match weighed by the tier holding each block (extproc/kvevents/tiers.py): what the
    # scorers count as cached; precise_match itself where every block is on GPU.
    precise_weighted: Mapping[str, float] = field(default_factory=dict)
    affinity_hash: int | None = None  # None: the request carries no affinity hint
    affinity_match: frozenset[str] = frozenset()  # endpoints that recorded affinity_hash before
    prompt_bytes: int = 0  # the prompt's bytes (its segments), for token estimates
    prompt_tokens: int = 0  # exact prompt tokens when the request was tokenized, else 0
    max_output_tokens: int = 0  # the body's max_tokens (or max_completion_tokens); 0: not set
    # Filled by predicted-ttft-scorer: per candidate key, (predicted TTFT ms, uncached tokens).
    predictions: dict[str, tuple[float, float]] = field(default_factory=dict)
    backlog_mark: tuple[str, float] | None = None  # (endpoint, its routed-token count once this was added)
    routing: Routing | None = None  # set by predicted-ttft-scorer at the pick
    reuse: tuple[str, int] | None = None  # (endpoint, reuse key) counted by predicted-ttft-scorer
    # The chosen endpoint's key (and those bounded reuse priced out): the signals its prediction
    # used, for --explain-decisions.
    signals: dict[str, str] = field(default_factory=dict)
    # Set where the scheduler scores a shortlist of a large pool (shortlist.py): every candidate
    # and its load, for pool-wide quantities; empty where every candidate is scored.
    pool: Sequence[Endpoint] = ()
    pool_loads: Sequence[float] = ()

    @property
    def total_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def prompt_token_blocks(self) -> int:
        """The precise match's denominator: the prompt's token blocks, keyed or estimated."""
        return max(self.token_blocks, len(self.token_keys or ()))


class Deferred(Protocol):
    """An index whose records can be made after the answer: `record_later` queues one (True when
    nothing was pending), `flush` makes them, and the index's own reads flush first."""

    def record_later(self, endpoint: str, keys: Sequence[int], /) -> bool: ...

    def flush(self) -> None: ...


class PreciseSource(Deferred, Protocol):
    """The precise index as the scheduler sees it (extproc/kvevents/manager.py): its match
    (`precise_match`, `precise_usable`, `precise_weighted`), the endpoint the decision chose after
    it, and its speculative records made after the answer (`Deferred`)."""

    def match(self, keys: Sequence[int], candidates: Sequence[str]) \
        -> tuple[dict[str, int], frozenset[str], Mapping[str, float]]: ...

    def chosen(self, endpoint: str, /) -> None: ...


class Filter(Protocol):
    name: str

    def filter(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]: ...


class Scorer(Protocol):
    """`approximate_use` (optional; read with getattr, "all" where a scorer does not say):
    which candidates' `prefix_match` it reads: "all", "fallback" (only those outside
    `precise_usable`) or "none". When every scorer says "fallback" or "none", the scheduler
    asks the approximate index only for candidates whose KV events are not usable."""

    name: str

    def score(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[float]: ...


@runtime_checkable
class PickObserver(Protocol):
    """A stateful plugin told where the request went (after the pick, and after a fallback move)."""

    def picked(self, request: SchedulingRequest, chosen: Endpoint) -> None: ...

    def moved(self, request: SchedulingRequest, primary: Endpoint, served: Endpoint) -> None: ...

    def finished(self, request: SchedulingRequest, endpoint: Endpoint, ok: bool = True) -> None:
        """The response ended; `ok` False: it failed (release what is held, learn nothing from it)."""


@runtime_checkable
class QueueRanker(Protocol):
    """A scorer that can rank endpoints by what a new prompt would wait there before its own
    prefill (predicted-ttft-scorer); a large pool's shortlist takes the least-waiting ones."""

    def queue_costs(self, endpoints: Sequence[Endpoint], keys: Sequence[str]) -> tuple[list[float], list[float]]:
        """(each endpoint's load, what a prompt held whole would wait there), in the order given."""

    def least_waiting(self, k: int, rng: random.Random) -> list[int]:
        """Positions, in the last `queue_costs` call's list, of the k endpoints where a prompt
        would wait least; of those tied at the k-th, as many as fit, drawn with `rng`."""


class Picker(Protocol):
    name: str

    def pick(self, endpoints: Sequence[Endpoint], totals: Sequence[float], n: int) -> list[Endpoint]: ...
