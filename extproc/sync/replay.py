"""Replay guard: a frame with a sequence number its origin already used is refused.

Every frame carries (origin, seq), seq counting 1, 2, 3, ... per origin (extproc/sync/wire.py).
Per origin the receiver keeps the highest seq seen and a bitmap of the `window` seqs below it
(the anti-replay window of IPsec, RFC 4303 section 3.4.3):
- seq above the highest: accepted; the window slides up.
- seq inside the window: accepted once (its bit is set), refused after.
- seq below the window: refused (too old to tell).
A window rather than a strict "greater than the last" because one origin's frames reach a worker
on several paths that do not keep order: straight from the peer, forwarded by a sibling worker
(queues of 256 frames), answers to its own requests. 4,096 covers both queues many times over.

Only authenticated frames reach the guard, so only processes holding the secret create state.
State per origin is ~600 bytes; at most `max_origins` (4,096) origins are kept. An origin not
heard from for twice the clock-skew bound is forgotten: each of its frames is then refused as
stale anyway, so forgetting opens no replay. When every slot is taken by live origins, the least
recently heard one is forgotten and counted (`evicted`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Window:
    highest: int
    seen: int  # bit i set: seq `highest - i` was accepted
    heard_at: float


class ReplayGuard:
    def __init__(self, *, window: int, max_origins: int, forget_after_s: float) -> None:
        if window <= 0 or max_origins <= 0:
            raise ValueError("replay window and origin cap must be positive")
        self.window = window
        self.max_origins = max_origins
        self.forget_after_s = forget_after_s
        self._origins: OrderedDict[int, _Window] = OrderedDict()  # least recently heard first
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._origins)

    def accept(self, origin: int, seq: int, now: float) -> bool:
        """True the first time (origin, seq) is offered within the window; False for a replay."""
        if seq <= 0:
            return False
        self._forget_stale(now)
        w = self._origins.get(origin)
        if w is None:
            if len(self._origins) >= self.max_origins:
                self._origins.popitem(last=False)
                self.evicted += 1
            self._origins[origin] = _Window(seq, 1, now)
            return True
        self._origins.move_to_end(origin)
        w.heard_at = now
        if seq > w.highest:
            shift = seq - w.highest
            w.seen = ((w.seen << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            w.highest = seq
            return True
        age = w.highest - seq
        if age >= self.window or w.seen >> age & 1:
            return False
        w.seen |= 1 << age
        return True

    def _forget_stale(self, now: float) -> None:
        origins = self._origins
        while origins:
            origin, w = next(iter(origins.items()))
            if now - w.heard_at <= self.forget_after_s:
                return
            del origins[origin]
