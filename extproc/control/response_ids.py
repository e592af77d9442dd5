"""Response ids: which endpoint served a `/v1/responses` response, for the next turn's affinity.

A Responses chain sends `previous_response_id` instead of the history; the history lives on the
server that produced that response (extproc/control/affinity.py). To route the next turn there,
the picker reads the id of each `/v1/responses` response and records it, as an affinity hash
(`response_key(id)`, with the request's model and cache salt), on the endpoint that served it:
the one the proxy reports when a fallback answered. The record goes into the prefix index like
any affinity hash, so it obeys the index's per-endpoint LRU bound, leaves with its endpoint and
peer sync spreads it to the other picker replicas; nothing else is kept.

Reading is bounded: `ResponseIdReader` looks only at the first `HEAD_BYTES` (4 KiB) of the body
for the first `"id": "<string>"` (at most `MAX_ID` characters). Both of vLLM's forms carry it
first: a JSON response opens with `{"id": "resp_..."`, a stream's first event is
`response.created`, whose response object opens with its id. Chunks after the id or after the
first 4 KiB are not inspected. Cost: the proxy sends the picker a `/v1/responses` request's
response body (STREAMED; the picker answers each chunk at once), since only the body names the
response; `--affinity-hints=false` turns this off with the hints.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from extproc.control.usage import UsageTracker

HEAD_BYTES = 4096
MAX_ID = 256
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,%d})"' % MAX_ID)


class ResponseIdReader:
    """The response's id from the head of its body, fed chunk by chunk."""

    __slots__ = ("_head",)

    def __init__(self) -> None:
        self._head = b""

    def feed(self, data: bytes) -> str | None:
        """The id once the head names it; None while it does not (or never: past HEAD_BYTES)."""
        room = HEAD_BYTES - len(self._head)
        if room <= 0:
            return None
        self._head += data[:room]
        found = _ID.search(self._head)
        return found.group(1).decode("utf-8", "replace") if found is not None else None


class ResponseWatch:
    """What the picker reads of one response: the usage sample, the response id, or both.

    `endpoint` is the key of the endpoint that serves the response (the processor moves it when
    the proxy reports a fallback); `learn(endpoint, id)` records the id there."""

    __slots__ = ("_learn", "_reader", "endpoint", "usage")

    def __init__(self, endpoint: str, usage: UsageTracker | None,
                 learn: Callable[[str, str], None] | None) -> None:
        self.endpoint = endpoint
        self.usage = usage
        self._learn = learn
        self._reader = ResponseIdReader() if learn is not None else None

    def feed(self, data: bytes) -> None:
        if self.usage is not None:
            self.usage.feed(data)
        reader = self._reader
        if reader is not None:
            response_id = reader.feed(data)
            if response_id is not None and self._learn is not None:
                self._reader = None
                self._learn(self.endpoint, response_id)

    def finish(self) -> dict[str, int] | None:
        return self.usage.finish() if self.usage is not None else None
