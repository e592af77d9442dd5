"""A first token that is late says the engine is slow before any first token is measured.

Calibration (extproc/scheduling/latency.py) learns an endpoint's slowdown from first tokens that
arrived: with MIN_FIRST_TOKENS a window, an engine 4x slower than the prior, given its share of
a burst of new prompts, queues them for seconds before its first window closes. Meanwhile its
TTFT histogram says something already: the first tokens it has NOT produced yet.

Per endpoint (`FirstTokenWait`) the picker keeps its own requests routed there since the
engine's first-token count was first seen and whose responses have not ended, oldest first, each
with its routing time, its predicted base TTFT (without the slowdown) and the slot wait it was
charged. At a new scrape the engine has produced F first tokens since then; E of the requests
ended meanwhile (each had its first token, or failed), so at most P = F - E of the remaining W
requests have theirs. If P < |W|, one of the P + 1 oldest has none: whichever engine order
served them, that many first tokens cannot cover P + 1 requests. Its TTFT is at least its
`elapsed` time, so the engine is at least

    s_j   = (elapsed_j / MARGIN - wait_j) / (base_j + share_j)     (elapsed: since its routing)
    share_j = min(L_j, step_tokens - u_j mod step_tokens) x prefill_ms_per_token
    bound = min over the P + 1 oldest of s_j
    slowdown <- the bound, seen twice (below)     when it is > slowdown

times slower than the prior, the minimum because which of them is late is unknown. share_j
prices the requests that may share the engine step finishing j's prefill (u_j uncached tokens):
the step's first token comes at its end, and the scheduler fills its token budget with requests
that arrived before it began. L_j: the prompt tokens of those routed after j, still awaiting a
first token, and before j's last step was predicted to begin (its routing plus its base
prediction but its own prefill, at the current slowdown); a step already running takes none. Unpriced, a warm
1,200-token prompt queued behind a cold one read a healthy replica 2x slow when the next cold
prompt routed there shared its step: spared from then on, it got no window to correct it. MARGIN
is 1: the bound is what was observed, no guess about the spread (a healthy engine's late
request raises it a little, until the next histogram window averages it away). And at
least |W| - P of them have no first token, so their prefill is not done: the endpoint's
backlog is at least the prompt tokens of the |W| - P - 1 smallest of them (one may be part-way),
which the drain at a slowdown learned too late would have counted as done. First tokens of other
pickers' requests count in F, so P only grows and the bound only falls: it stays a lower bound.
With more than CHECKED (64) in flight no bound is drawn that scrape (bounded work per scrape).
A lateness is believed once two scrapes in a row show it. One pause of the host (a first token
held ~0.5 s while the engine's process waited for a core) is one late request, and the bound
drawn at the scrape that finds it is as large as a slow engine's. A pause ends and the first
token follows at the engine's own speed; a slower engine's request stays late. So a bound is
taken where the endpoint's previous scrape drew one above the slowdown too, as the smaller of
the two (the late request may change as first tokens come). A scrape that finds nothing later
than the slowdown ends the pair; a guarded one (below) says nothing either way. On the two vLLM
CPU engines of tests/e2e/test_real_vllm.py, taken at once, such a pause read one engine 8.6x slow
while its twin kept about 1x, and its warm prefixes went to the twin; spared from then on, it got
no window to correct it. The price is one scrape interval: a wait in proportion to the
lateness's age finds a slower replica later, while cold prompts still go to it.
The bound must not read a wait for a sequence slot, which a slot limit not learned yet left
uncharged, as slowness: that read a decode-bound engine's queue as a 12x slower engine. So it is
drawn from a scrape without a waiting queue (every request there is admitted now), or from a queued
one where each of the P + 1 oldest was routed while the endpoint held fewer requests than the
most running sequences any endpoint of the pool was seen to hold (`queued` False at `add`):
replicas of one pool run one configuration, so each of them was admitted on arrival and its
late first token is slow prefill, however long the queue behind it (a prompt queued behind
another's prefill, which is what a slower engine shows first). Admitted now is not admitted on
arrival: a request that may have queued is no proof either once a scrape after its routing showed
a queue with every slot taken (the endpoint's admission limit or the pool's, slots.py), queue or
none at the scrape that finds it late; the slot it waited for is in its lateness. On a
decode-bound pool of 8 slots (requests holding them ~3 s) the scrape after such a queue drained
raised two replicas of four, alike, to 1.9x and 2.3x, and new prompts went to the other two's
queues. Not where the endpoint's last
scrape before the routing showed a queue for capacity (slots.py's `engine_says_capacity`: a
KV-cache limit admits fewer sequences as the prompts grow, so a count seen once proves nothing),
and never from a scrape that shows one (`capacity`): any late request may be waiting for KV
blocks. Nor is a bound drawn where one of
the P + 1 oldest was predicted mostly fixed cost (`readable` False at `add`: its base below twice
the per-request overhead, a warm or short prompt): its lateness may be a larger fixed cost per
request (a CPU engine, a busy API server), which the one slowdown factor would then charge every
cold prompt's prefill with. On the two vLLM CPU engines of tests/e2e/test_real_vllm.py, a warm
931-token prompt predicted at 13 ms, still without its first token some 100 ms on, raised the
engine serving it to 8x while its twin kept about 1x, and its warm prefixes went to the twin to
be computed again. The TTFT histogram's windows still average such requests in. A raise is a
measurement of the
endpoint itself (calibration source "first-token-wait"); the next histogram window averages it
with what arrived, and it is shared with the endpoints not calibrated yet except those whose
own first tokens so far read them faster (calibration.py).
"""

from __future__ import annotations

import math
from itertools import islice

MARGIN = 1.0
CHECKED = 64  # at most this many of the oldest requests are read per scrape
MAX_AWAITING = 1024  # own requests remembered per endpoint (the oldest are dropped)


class FirstTokenWait:
    __slots__ = ("_awaiting", "_base_count", "_ended", "_pending", "_readable_guard", "_slot_guard", "_slot_queue_at",
                 "_twice")

    def __init__(self, twice: bool = True, slot_guard: bool = True, readable_guard: bool = True) -> None:
        self._twice = twice  # False: a bound is taken at the first scrape that draws it
        # False (--ablate): a request that may have waited for a slot, or whose prediction is
        # mostly fixed cost, still draws a bound (the guards below).
        self._slot_guard, self._readable_guard = slot_guard, readable_guard
        self._pending = 0.0  # the bound the previous scrape drew above the slowdown; 0: none
        # token -> (routed at s, base ms, slot wait ms, uncached tokens, maybe queued for a slot,
        # readable: its lateness would be prefill speed), oldest first.
        self._awaiting: dict[int, tuple[float, float, float, float, bool, bool]] = {}
        self._base_count = -1.0  # the engine's first-token count when counting began; -1: not yet
        self._ended = 0  # requests of `_awaiting` whose response ended since then
        self._slot_queue_at = -math.inf  # the latest scrape showing a queue with every slot taken

    def __len__(self) -> int:
        return len(self._awaiting)

    def add(self, token: int, at: float, base_ms: float, wait_ms: float, uncached: float,
            queued: bool = True, readable: bool = True) -> None:
        """A request routed at `at`; `queued` False: it was admitted on arrival; `readable` False:
        its prediction is mostly fixed cost (module docstring)."""
        awaiting = self._awaiting
        if len(awaiting) >= MAX_AWAITING:
            del awaiting[next(iter(awaiting))]
            self._ended += 1  # forgotten as if it had ended: P stays an upper bound
        awaiting[token] = (at, base_ms, wait_ms, uncached, queued, readable)

    def rescale(self, f: float) -> None:
        """The prompt tokens these requests were estimated at were f times too many (bytes per token
        moved, calibration.py `_rescale`): their base predictions and prompt tokens shrink by f, so
        a request routed before the move is read late against what it costs in the measured
        units. Kept at the prior's, a replica 4x slower than the others read at most 2.5x until
        its first requests ended, and looked idle to the next cold prompt."""
        awaiting = self._awaiting
        for token, (at, base_ms, wait_ms, uncached, queued, readable) in awaiting.items():
            awaiting[token] = (at, base_ms * f, wait_ms, uncached * f, queued, readable)
        self._pending /= f  # a bound awaiting its second scrape was drawn against the old predictions

    @staticmethod
    def _shared_ms(entries: list[tuple[float, float, float, float, bool, bool]], j: int, slowdown: float,
                   step_tokens: int, ms_per_token: float) -> float:
        """share_j (module docstring): the prefill of requests routed after entry j and before its
        last step began (predicted: its routing plus its base prediction but its own prefill, at
        `slowdown`), up to the step budget its own tokens leave."""
        routed_at, base_ms, _, uncached, _, _ = entries[j]
        starts = routed_at + max(0.0, base_ms - uncached * ms_per_token) * slowdown / 1000.0
        later = 0.0
        for e in islice(entries, j + 1, None):
            if e[0] > starts:
                break
            later += e[3]
        return min(later, step_tokens - uncached % step_tokens) * ms_per_token

    def remove(self, token: int) -> None:
        if self._awaiting.pop(token, None) is not None:
            self._ended += 1

    def observe(self, first_tokens: float, at: float, slowdown: float, queue: bool = False,
                step_tokens: int = 0, ms_per_token: float = 0.0,
                capacity: bool = False, slot_queue: bool = False) -> tuple[float | None, float]:
        """A scrape at `at` shows `first_tokens` produced in all, and `queue`: whether requests wait
        there: (the slowdown the late requests prove, or None when they prove no more than
        `slowdown` or may have waited for a slot; the prompt tokens still to be prefilled at least),
        module docstring. `step_tokens` (the engine's prefill tokens per step) and `ms_per_token`
        (the prior's prefill cost) price the requests routed after each one that may share the
        step that finishes its prefill; 0: not priced. `capacity`: the scrape shows a capacity
        queue (slots.py): any of them may be waiting for KV blocks, so no bound is drawn.
        `slot_queue`: the scrape shows a queue with every slot of the endpoint taken (its admission
        limit or the pool's, slots.py); a request routed before it that may have queued (`queued` at
        `add`) may have waited for a slot then, so it proves nothing at later scrapes either, queue
        or none."""
        if slot_queue:
            self._slot_queue_at = at
        if self._base_count < 0 or first_tokens < self._base_count:  # first sight, or a restart
            if self._base_count >= 0 or first_tokens > 0:
                self._awaiting.clear()  # which of those routed before were served is unknown
            self._base_count, self._ended = first_tokens, 0
            self._pending = 0.0
            return None, 0.0
        awaiting = self._awaiting
        served = max(int(first_tokens - self._base_count) - self._ended, 0)
        if served >= len(awaiting):
            self._pending = 0.0  # nothing is late: a lateness seen before has ended
            return None, 0.0
        if len(awaiting) > CHECKED:
            return None, 0.0
        entries = list(awaiting.values())  # at most CHECKED
        oldest = entries[:served + 1]
        since = self._slot_queue_at
        # A guarded scrape proves nothing either way: it neither draws a bound nor ends a pair.
        if capacity or (self._slot_guard and any(e[4] and (queue or e[0] <= since) for e in oldest)):
            confirmed = 0.0  # one of them may be waiting, or have waited, for a slot: no proof of slowness
        elif self._readable_guard and not all(e[5] for e in oldest):
            confirmed = 0.0  # one of them may be late by a fixed cost: no proof of slow prefill
        else:
            bound = math.inf
            for j, (routed_at, base_ms, wait_ms, _, _, _) in enumerate(oldest):
                if step_tokens > 0:
                    base_ms += self._shared_ms(entries, j, slowdown, step_tokens, ms_per_token)
                s = ((at - routed_at) * 1000.0 / MARGIN - wait_ms) / base_ms if base_ms > 0 else 0.0
                bound = min(bound, s)
            confirmed = self._held(bound, slowdown)
        # Without a first token, a request's prefill is not done: the len - served - 1 smallest
        # prompts among them are still to prefill in full (one may be part-way).
        unfinished = len(awaiting) - served - 1
        floor = sum(sorted(e[3] for e in entries)[:unfinished]) if unfinished > 0 else 0.0
        return (confirmed if confirmed > slowdown else None), floor

    def _held(self, bound: float, slowdown: float) -> float:
        """The bound a lateness seen at two scrapes in a row proves: the smaller of their two
        bounds (the late request may have changed as first tokens came); 0: not yet."""
        if bound <= slowdown:
            self._pending = 0.0  # nothing later than known: a lateness seen before has ended
            return 0.0
        if not self._twice:
            return bound
        held, self._pending = min(self._pending, bound), bound
        return held
