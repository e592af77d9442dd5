"""List-then-watch of one Kubernetes collection, run in a worker thread (the client is synchronous).

Algorithm (the client-go reflector's, simplified):
1. LIST (raw JSON, no model deserialisation) -> `on_list(result)` replaces the consumer's view;
   the list's `metadata.resourceVersion` becomes the resume point.
2. WATCH from the resume point with `allow_watch_bookmarks=True`, server-side `timeoutSeconds`
   drawn from [T, 2T] and a client-side read timeout of that plus min(5 s, T/2)
   (`_request_timeout`; kmock ignores timeoutSeconds). ADDED/MODIFIED/DELETED -> `on_event(type, object)`; every event's
   and BOOKMARK's `metadata.resourceVersion` becomes the resume point.
3. The stream ends cleanly (server timeout) or the read times out -> re-watch from the resume
   point. A stream that ends within a second without any event counts as a failure (no spinning).
4. 410 Gone (HTTP 410 or an ERROR event with code 410), any other ERROR event or HTTP error, a
   connection failure, a malformed line, or `relist()` -> LIST again (1), after a backoff unless
   the relist was requested.
Backoff: `initial` doubled per consecutive failure up to `cap`, jittered in [d/2, d]; the first
410 of a streak relists at once; a healthy watch (an event, or a clean end after a second) resets
it. Defaults (EppConfig.discovery): T=60 s, initial 0.2 s, cap 5 s, LIST timeout 10 s.

Handlers must be idempotent: a real apiserver may replay, kmock replays every object as ADDED on
each watch. Callbacks run in the worker thread; the consumer hands them to its own event loop.
`stop()` sets a flag and shuts down the socket of the in-flight response, so a thread blocked in
a read returns at once; `join(timeout)` bounds the wait. Failures are logged once per transition.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import urllib3

from extproc.config.settings import DiscoveryConfig

log = logging.getLogger("prefix_epp.discovery")

GONE = 410
_DEFAULTS = DiscoveryConfig()


@dataclass(slots=True)
class ListResult:
    items: list[dict[str, Any]]
    resource_version: str
    query: dict[str, Any] = field(default_factory=dict)  # the extra arguments the LIST used


class WatchExpired(Exception):
    """410 Gone: the resume point is too old; only a fresh LIST helps."""


class Backoff:
    def __init__(self, initial: float, cap: float, rng: random.Random | None = None) -> None:
        self.initial = initial
        self.cap = cap
        self._rng = rng or random.Random()
        self._failures = 0

    def next(self, first_free: bool = False) -> float:
        """The next delay; with `first_free`, the first failure of a streak retries at once."""
        if first_free and self._failures == 0:
            self._failures = 1
            return 0.0
        delay = min(self.cap, self.initial * (2 ** min(self._failures, 30)))
        self._failures += 1
        return self._rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._failures = 0


ListFn = Callable[..., Any]


class ListWatch:
    """Keeps one collection in sync through `on_list` / `on_event`, in its own daemon thread."""

    def __init__(
        self,
        name: str,
        list_fn: ListFn,
        args: tuple[Any, ...],
        on_list: Callable[[ListResult], None],
        on_event: Callable[[str, dict[str, Any]], None],
        *,
        query: Callable[[], dict[str, Any]] = dict,
        watch_timeout_s: float = _DEFAULTS.watch_timeout_s,
        request_timeout_s: float = _DEFAULTS.request_timeout_s,
        backoff: Backoff | None = None,
    ) -> None:
        self.name = name
        self._list_fn = list_fn
        self._args = args
        self._on_list = on_list
        self._on_event = on_event
        self._query = query
        self._watch_timeout = watch_timeout_s
        self._request_timeout = request_timeout_s
        self._backoff = backoff or Backoff(_DEFAULTS.backoff_initial_s, _DEFAULTS.backoff_max_s)
        self._stop = threading.Event()
        self._relist = threading.Event()
        self._resp: Any = None
        self._resp_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._failing = False
        self.lists = 0  # successful LISTs so far (tests and logs)
        self.failures = 0  # failed LIST or WATCH requests so far (tests and logs)

    # -- control (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._abort()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds; True when the thread has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def relist(self) -> None:
        """Drop the current watch and LIST again at once (e.g. the query changed)."""
        self._relist.set()
        self._abort()

    def _abort(self) -> None:
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):  # best effort: the socket may already be gone
                resp.shutdown()

    def _hold(self, resp: Any) -> None:
        with self._resp_lock:
            self._resp = resp
        if self._stop.is_set() or (resp is not None and self._relist.is_set()):
            self._abort()

    # -- the loop (worker thread) ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rv = self._list()
            except Exception as exc:
                if self._stop.is_set():
                    break
                self._failed("list", exc)
                continue
            self._recovered()
            while not self._stop.is_set() and not self._relist.is_set():
                try:
                    rv = self._watch(rv)
                except Exception as exc:
                    if self._stop.is_set() or self._relist.is_set():
                        break
                    self._failed("watch", exc)
                    break

    def _failed(self, phase: str, exc: Exception) -> None:
        self.failures += 1
        expired = isinstance(exc, WatchExpired) or getattr(exc, "status", None) == GONE
        delay = self._backoff.next(first_free=expired)
        fields = {"watch": self.name, "phase": phase, "error": _describe(exc), "retry_in_s": round(delay, 3)}
        if expired:
            log.info("watch expired (410 Gone); listing again", extra=fields)
        elif not self._failing:
            log.warning("kubernetes API request failed; retrying with backoff", extra=fields)
        else:
            log.debug("kubernetes API request failed again", extra=fields)
        self._failing = self._failing or not expired
        self._stop.wait(delay)

    def _recovered(self) -> None:
        if self._failing:
            log.info("kubernetes API reachable again", extra={"watch": self.name})
            self._failing = False

    def _list(self) -> str:
        self._relist.clear()
        query = self._query()
        resp = self._list_fn(*self._args, **query, _preload_content=False,
                             _request_timeout=(self._request_timeout, self._request_timeout))
        self._hold(resp)
        try:
            doc = orjson.loads(resp.data)
        finally:
            self._hold(None)
            resp.release_conn()
        items = doc.get("items") or []
        rv = str((doc.get("metadata") or {}).get("resourceVersion") or "")
        self.lists += 1
        self._on_list(ListResult(items=items, resource_version=rv, query=query))
        return rv

    def _watch(self, rv: str) -> str:
        server_timeout = max(1, round(self._watch_timeout * (1 + random.random())))
        read_timeout = server_timeout + min(5.0, self._watch_timeout / 2)
        kwargs: dict[str, Any] = dict(self._query())
        if rv:
            kwargs["resource_version"] = rv
        started = time.monotonic()
        resp = self._list_fn(*self._args, **kwargs, watch=True, allow_watch_bookmarks=True,
                             timeout_seconds=server_timeout, _preload_content=False,
                             _request_timeout=(self._request_timeout, read_timeout))
        self._hold(resp)
        events = 0
        try:
            for line in _lines(resp):
                rv = self._handle_line(line, rv)
                events += 1
                if events == 1:
                    self._backoff.reset()
        except urllib3.exceptions.ReadTimeoutError:
            self._backoff.reset()
            return rv  # quiet stream: a normal re-watch
        except urllib3.exceptions.ProtocolError as exc:
            if isinstance(exc.__context__, urllib3.exceptions.ReadTimeoutError) or "Read timed out" in str(exc):
                self._backoff.reset()
                return rv
            raise
        finally:
            self._hold(None)
            resp.release_conn()
        if events == 0 and time.monotonic() - started < 1.0 and not self._stop.is_set():
            raise ConnectionError("watch stream ended at once")
        self._backoff.reset()  # a healthy watch ends the failure streak
        return rv

    def _handle_line(self, line: bytes, rv: str) -> str:
        event = orjson.loads(line)
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            if code == GONE:
                raise WatchExpired(str(obj.get("message", "")))
            raise RuntimeError(f"watch ERROR event: {code} {obj.get('reason', '')}")
        new_rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._on_event(kind, obj)
        elif kind != "BOOKMARK":
            raise RuntimeError(f"unknown watch event type {kind!r}")
        return str(new_rv) if new_rv else rv


def _lines(resp: Any) -> Any:
    """Yield the non-empty lines of a chunked watch response."""
    buf = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1:]
            if line.strip():
                yield line
    if buf.strip():
        yield buf


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if status:
        return f"HTTP {status} {getattr(exc, 'reason', '')}".strip()
    return f"{type(exc).__name__}: {exc}"[:300]
