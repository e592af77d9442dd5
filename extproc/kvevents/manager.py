"""KV-event subscriptions that follow the datastore, and the precise view the scheduler reads.

Subscriptions: the datastore's on_added/on_removed listeners start and stop one `Subscriber` task
per (endpoint, data-parallel rank) while `run()` is active, at the addresses of
extproc/kvevents/ranks.py (`--kv-events-port` 5557 + the rank, or the endpoint's own; replay
likewise when asked for). Entries are kept per (endpoint, rank); an endpoint's match is its best
rank.
A changed `kv_events_endpoint` on an existing endpoint takes effect when it is re-added.

Request path (never waits on a subscriber):
- `keys_for(model, cache_salt, tokens)`: our block keys at the engine block size (the scraped
  `vllm:cache_config_info` block_size, else the latest `BlockStored.block_size`, else
  `--kv-events-block-size`, 16), chained from the adapter's root when `model` is a LoRA adapter
  seen in events. A request with a `cache_salt` gets None (vLLM salts its first block).
- `lookahead(model, cache_salt)`: the same keys, made while the prompt is tokenized, which stops
  at the first block no endpoint holds (extproc/kvevents/lookahead.py).
- `match(keys, candidates)` -> (leading blocks held per endpoint, endpoints whose events are
  usable, the blocks weighed by the KV cache tier holding them: extproc/kvevents/tiers.py);
  `chosen(endpoint)` counts the chosen endpoint's matched blocks by tier (`hits`).
  Usable = every rank heard from its publisher and none uncertain, and not *silent*: requests
  were routed to it `--kv-events-silence-timeout` (10 s) ago and no message came since (an idle
  engine publishes nothing, so plain silence is no evidence). Entries of a silent endpoint are
  kept; the next message makes it usable again.
- `record_later(endpoint, keys)` and `flush()`: speculative entries for the chosen endpoint (TTL
  `--kv-events-speculative-ttl`, 2 s, from the time queued), made by `flush` or the next `match`
  (the scheduler flushes after its answer); `on_record` listeners see them when they are made
  (peer sync shares them), `apply_speculative` records a peer's without telling the listeners.
  A timer on the event loop drops each record's entries between decisions, a hundredth of the TTL
  before they come due (so the decisions arriving right after do not race it): `match` drops
  whatever is due too (its answer never counts an expired entry), but finds little left to do. At
  256 endpoints, dropping one 8k-token prompt's 500 entries from holders of millions was a tenth
  of a precise decision on average, and half a millisecond where a decision paid for it
  (docs/scale.md).

Maintenance every `maintenance_interval_s` (0.5 s): expire speculative entries, size each
endpoint's slots from its scraped `num_gpu_blocks`, refresh the block size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

import zmq.asyncio

from extproc.config.settings import KVEventsConfig
from extproc.core.background import supervise
from extproc.core.datastore import Datastore, Endpoint
from extproc.kvevents.index import PreciseIndex
from extproc.kvevents.keys import KeyChain, chain_keys, key_seed
from extproc.kvevents.lookahead import HeldPrefix
from extproc.kvevents.ranks import RankOwners, source_addresses
from extproc.kvevents.subscriber import Loss, SourceState, Subscriber, SubscriberStats
from extproc.kvevents.tiers import TierMatch
from extproc.kvevents.wire import GPU, TIERS

log = logging.getLogger("prefix_epp.kvevents")
# The expiry timer drops entries this share of the TTL before it ends (20 ms of the default 2 s):
# on time, the drop would race the decisions arriving just after (each then pays for it, a
# decision's tail at 256 endpoints: docs/scale.md), and records coming due together go in one call.
EXPIRY_EARLY_SHARE = 0.01


class KVEventsManager:
    def __init__(self, config: KVEventsConfig, datastore: Datastore, *,
                 clock: Callable[[], float] = time.monotonic, loss: Loss | None = None) -> None:
        self.config = config
        self.datastore = datastore
        self.index = PreciseIndex(config.index_capacity, config.speculative_ttl_s, config.tier_weights)
        self.hits = [0] * len(TIERS)  # matched blocks of the chosen endpoints, by the tier holding them
        self._last: TierMatch | None = None  # the last match, for `chosen`
        self.stats = SubscriberStats()
        self.block_size = config.block_size
        self._clock = clock
        self._loss = loss
        self._ctx: zmq.asyncio.Context | None = None
        self._subs: dict[str, list[Subscriber]] = {}
        self._owners = RankOwners()  # which endpoint holds each rank of a pod
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._awaiting: dict[str, float] = {}  # endpoint -> first routing since its last message
        # usable_among's last answer: ((states' revision, this manager's), candidates, usable), and
        # the time until which it holds unless a revision moves.
        self._usable: tuple[tuple[int, int], list[str], frozenset[str]] | None = None
        self._usable_until = -math.inf
        self._expiry_early_s = config.speculative_ttl_s * EXPIRY_EARLY_SHARE
        self._revision = 0  # bumped when an endpoint's subscriptions come or go, or it speaks after a silence
        self._capacity: dict[str, int] = {}
        self._listeners: list[Callable[[str, Sequence[int]], None]] = []
        self._pending: list[tuple[str, Sequence[int], float]] = []  # record_later's, oldest first
        self._expiry: asyncio.TimerHandle | None = None  # drops speculative entries as they come due
        datastore.on_added(self._added)
        datastore.on_removed(self._removed)
        datastore.on_restarted(self._restarted)

    # -- subscriptions -----------------------------------------------------------------------
    def _added(self, ep: Endpoint) -> None:
        if self._ctx is None or ep.key in self._subs:
            return
        try:
            addresses = source_addresses(ep, self.config)
        except ValueError as exc:
            log.warning("kv events address invalid; endpoint scored approximately",
                        extra={"endpoint": ep.key, "error": str(exc)})
            return
        self._owners.add(ep.key, ep.address, [a.rank for a in addresses])
        owners = self._owners

        def owner(rank: int, host: str = ep.address) -> str | None:
            return owners.owner(host, rank)

        subs = [Subscriber(a, self._ctx, self.index, self.config, self.stats, self._clock, on_heard=self._heard,
                           loss=self._loss, owner=owner) for a in addresses]
        self._subs[ep.key] = subs
        self._revision += 1
        self._tasks[ep.key] = [supervise(f"kv-events {s.address.events}", s.run, restart_on_return=False).task
                               for s in subs]
        log.info("kv events subscribed", extra={"endpoint": ep.key, "ranks": [a.rank for a in addresses],
                                                "events": [a.events for a in addresses],
                                                "replay": [a.replay for a in addresses]})

    def _removed(self, ep: Endpoint) -> None:
        self.flush()
        for task in self._tasks.pop(ep.key, ()):
            task.cancel()
        self._subs.pop(ep.key, None)
        self._owners.remove(ep.key)
        self._awaiting.pop(ep.key, None)
        self._revision += 1
        self._capacity.pop(ep.key, None)
        self.index.remove_endpoint(ep.key)

    def _restarted(self, ep: Endpoint) -> None:
        """The engine's process started anew: what its old publisher said no longer holds."""
        for sub in self._subs.get(ep.key, ()):
            sub.publisher_restarted()

    def _heard(self, endpoint: str) -> None:
        since = self._awaiting.pop(endpoint, None)
        if since is not None and self._clock() - since > self.config.silence_timeout_s:
            self._revision += 1  # it was silent, so not usable: now it is

    def now(self) -> float:
        return self._clock()

    def subscribers(self, endpoint: str) -> list[Subscriber]:
        return self._subs.get(endpoint, [])

    async def run(self) -> None:
        """Subscribe to every endpoint, now and as they come, until cancelled."""
        self._ctx = zmq.asyncio.Context()
        try:
            for ep in self.datastore.snapshot():
                self._added(ep)
            while True:
                await asyncio.sleep(self.config.maintenance_interval_s)
                self.maintain()
        finally:
            tasks = [t for ts in self._tasks.values() for t in ts]
            self._tasks.clear()
            self._subs.clear()
            self._owners.clear()
            self._revision += 1
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx, self._ctx = self._ctx, None
            ctx.destroy(linger=0)
            if self._expiry is not None:
                self._expiry.cancel()
                self._expiry = None

    def maintain(self) -> None:
        self.index.expire(self._clock())
        block_size = 0
        for ep in self.datastore.snapshot():
            m = ep.metrics
            if m is None or m.num_gpu_blocks <= 0:
                continue
            block_size = block_size or m.block_size
            if self._capacity.get(ep.key) != m.num_gpu_blocks:
                self._capacity[ep.key] = m.num_gpu_blocks
                with contextlib.suppress(ValueError):
                    self.index.set_capacity(ep.key, m.num_gpu_blocks)
        self.block_size = block_size or self.index.last_block_size or self.config.block_size

    # -- request path ------------------------------------------------------------------------
    def _root(self, model: str, cache_salt: str) -> int | None:
        """The chain's root for a request; None with a cache salt (vLLM salts its first block)."""
        if cache_salt:
            return None
        return key_seed(model if model in self.index.lora_names else None)

    def keys_for(self, model: str, cache_salt: str, tokens: Sequence[int]) -> list[int] | None:
        root = self._root(model, cache_salt)
        if root is None:
            return None
        try:
            return chain_keys(tokens, self.block_size, root, self.config.max_blocks)
        except ValueError:
            return None

    def lookahead(self, model: str, cache_salt: str) -> HeldPrefix | None:
        """The predicate that stops tokenizing at the first block no endpoint holds
        (extproc/kvevents/lookahead.py); None where the prompt gets no keys (a cache salt)."""
        root = self._root(model, cache_salt)
        if root is None:
            return None
        return HeldPrefix(KeyChain(self.block_size, root, self.config.max_blocks), self.index.held_anywhere)

    @property
    def max_tokens(self) -> int:
        """Prompt tokens the precise lookup can use at most (max_blocks full blocks)."""
        return self.config.max_blocks * self.block_size

    def usable(self, endpoint: str, now: float) -> bool:
        return bool(self._usable_now((endpoint,), now)[0])

    def usable_among(self, candidates: Sequence[str], now: float) -> frozenset[str]:
        """The candidates whose events are usable now (the module docstring's rule). The request
        path asks it for the whole pool at every decision, and the answer changes only when a
        source's state does (`SourceState.revision`), an endpoint joins, leaves or is heard from
        after a silence, or time reaches the next moment one of them changes by itself (an
        uncertain source's window ends, a routed endpoint's silence runs out): the last answer is
        kept until one of these, so a decision pays for a pass over the pool only after a change."""
        kept = self._usable
        revision = (SourceState.revision, self._revision)
        if kept is not None and kept[0] == revision and now < self._usable_until and kept[1] == candidates:
            return kept[2]
        usable, self._usable_until = self._usable_now(candidates, now)
        # The revision read after the pass: a window that ended in it changed a state.
        self._usable = ((SourceState.revision, self._revision), list(candidates), usable)
        return usable

    def _usable_now(self, candidates: Sequence[str], now: float) -> tuple[frozenset[str], float]:
        """(the usable candidates, the next time that answer can change with time alone); one pass
        with the settings read once."""
        subs_of, awaiting = self._subs, self._awaiting
        window, silence = self.config.resync_window_s, self.config.silence_timeout_s
        usable = []
        until = math.inf
        for ep in candidates:
            subs = subs_of.get(ep)
            if not subs:
                continue
            for sub in subs:
                st = sub.state
                if not st.usable(now, window):
                    if st.fresh_since is not None and st.fresh_since + window < until:
                        until = st.fresh_since + window
                    break
            else:
                since = awaiting.get(ep)
                if since is None:
                    usable.append(ep)
                elif now - since <= silence:
                    usable.append(ep)
                    if since + silence < until:
                        until = since + silence
        return frozenset(usable), until

    def match(self, keys: Sequence[int], candidates: Sequence[str]) \
            -> tuple[dict[str, int], frozenset[str], Mapping[str, float]]:
        if self._pending:
            self.flush()
        now = self._clock()
        found = self._last = self.index.match_tiers(keys, candidates, now)
        return found.runs, self.usable_among(candidates, now), found.weighted

    def chosen(self, endpoint: str) -> None:
        """The decision after the last `match` chose `endpoint`: its matched blocks count as hits of
        the tiers that held them (speculative entries as GPU)."""
        found = self._last
        if found is None:
            return
        blocks = found.blocks.get(endpoint)
        if blocks is None:
            self.hits[GPU] += found.runs.get(endpoint, 0)
        else:
            for tier, n in enumerate(blocks):
                self.hits[tier] += n

    def record_later(self, endpoint: str, keys: Sequence[int]) -> bool:
        """Speculative entries as of now, made by `flush` or the next `match`, whichever comes first
        (the scheduler's after-the-answer records, extproc/scheduling/scheduler.py); True when
        nothing was pending before (the caller then arranges one `flush`)."""
        first = not self._pending
        self._pending.append((endpoint, keys, self._clock()))
        return first

    def flush(self) -> None:
        pending = self._pending
        if pending:
            self._pending = []
            for endpoint, keys, at in pending:
                self._record(endpoint, keys, at)
            self._arm_expiry()

    def _arm_expiry(self) -> None:
        """A timer for the oldest speculative record's expiry, if none is set (no loop: none)."""
        if self._expiry is not None:
            return
        due = self.index.next_expiry()
        if due is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._expiry = loop.call_later(max(due - self._expiry_early_s - self._clock(), 0.0), self._expire_due)

    def _expire_due(self) -> None:
        self._expiry = None
        self.index.expire(self._clock() + self._expiry_early_s)
        self._arm_expiry()

    def _record(self, endpoint: str, keys: Sequence[int], now: float) -> None:
        if endpoint not in self._awaiting:
            self._awaiting[endpoint] = now
            # Usable until its silence runs out: the kept answer holds no longer.
            self._usable_until = min(self._usable_until, now + self.config.silence_timeout_s)
        self.index.record_speculative(endpoint, keys, now)
        for listener in self._listeners:
            listener(endpoint, keys)

    def on_record(self, listener: Callable[[str, Sequence[int]], None]) -> None:
        self._listeners.append(listener)

    def apply_speculative(self, endpoint: str, keys: Sequence[int]) -> None:
        """A peer routed these keys to `endpoint`: speculative here too (same TTL)."""
        self.index.record_speculative(endpoint, keys, self._clock())
        self._arm_expiry()


def precise_routing(config: KVEventsConfig, scorer_types: Sequence[str]) -> bool:
    """The scheduler routes on the precise index: --prefix-scorer precise, or a profile with its scorer."""
    return config.prefix_scorer == "precise" or "precise-prefix-cache-scorer" in scorer_types


def kv_events_wanted(config: KVEventsConfig, scorer_types: Sequence[str]) -> bool:
    """Subscribe when asked (--kv-events), or when a scorer of the profile needs the precise index."""
    return config.enabled or precise_routing(config, scorer_types)
