"""Which endpoints' load inputs changed, in order, for readers that keep only those up to date.

The queue ranking (extproc/scheduling/queue_ranking.py) keeps each endpoint's predicted queue
between decisions and recomputes an endpoint only where its in-flight count or its scrape
changed. Finding those by comparing every endpoint's count and metrics with what it saw last is a
pass over the pool at every decision (tens of microseconds at 256 endpoints). Instead the
datastore appends an endpoint's key here whenever it changes one of them (a request routed or
answered, a scrape landing, an endpoint added), and a reader asks for the keys appended since the
position it read last: its work per decision is the number of changes, not the pool's size.

Listeners (`listen`) are called after every key added: flow control's dispatcher wakes on them
(extproc/flowcontrol/controller.py), as a change of load may let a held request go.

Bounded: once more than LIMIT keys are kept, the older half is dropped; a reader whose position
lies before what is kept gets None from `since` and recomputes everything, as at its first read.
"""

from __future__ import annotations

from collections.abc import Callable

LIMIT = 4096


class Changes:
    __slots__ = ("_keys", "_listeners", "_start")

    def __init__(self) -> None:
        self._keys: list[str] = []
        self._start = 0  # the position of _keys[0]
        self._listeners: list[Callable[[], None]] = []

    def listen(self, fn: Callable[[], None]) -> None:
        """Call `fn()` after each key added (keep it O(1): it runs on every request's start and end)."""
        self._listeners.append(fn)

    def add(self, key: str) -> None:
        keys = self._keys
        keys.append(key)
        if len(keys) > LIMIT:
            drop = len(keys) - LIMIT // 2
            del keys[:drop]
            self._start += drop
        for fn in self._listeners:
            fn()

    @property
    def position(self) -> int:
        """The position after the last key added: `since(position)` is empty until the next."""
        return self._start + len(self._keys)

    def since(self, position: int) -> list[str] | None:
        """The keys added from `position` on, oldest first (a key may repeat); None when some of
        them were dropped (the reader recomputes everything)."""
        if position < self._start:
            return None
        return self._keys[position - self._start:]
