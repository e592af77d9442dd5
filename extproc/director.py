"""The director: from a parsed request to a routing decision, the picker's request-path logic.

route(ctx):
1. Parse the body (400 on invalid JSON, a non-object or a missing model).
2. Resolve the request's priority from its InferenceObjective header.
3. Candidates: the datastore's endpoints, narrowed by the proxy's subset hint and by the
   `test-epp-endpoint-selection` header; none left -> 503.
4. Admission (saturation: sheddable requests get 429 while the pool is saturated).
5. Hash the prompt into prefix blocks and run the scheduler.
6. Count the request in flight on the chosen endpoint until `complete()`.

Bodiless requests (GET /v1/models) skip 1, 4 and 5: a random candidate is chosen.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.config import EppConfig
from extproc.datastore import Datastore, Endpoint, split_host_port
from extproc.errors import EppError, ErrorCode
from extproc.prefix.hashing import block_hashes
from extproc.request.openai import ParsedRequest, api_from_path, parse_request
from extproc.scheduling.interfaces import SchedulingRequest
from extproc.scheduling.scheduler import Decision, Scheduler

Admission = Callable[[SchedulingRequest, Sequence[Endpoint]], None]


@dataclass(slots=True)
class RequestContext:
    path: str = "/"
    method: str = "POST"
    request_id: str = ""
    objective: str = ""
    test_selection: str = ""
    subset: list[str] | None = None
    parsed: ParsedRequest | None = None


def _matches(ep: Endpoint, wanted: set[str]) -> bool:
    return ep.key in wanted or ep.address in wanted


def _parse_endpoint_list(values: Sequence[str]) -> set[str]:
    """Entries may be `ip`, `ip:port` or `[ipv6]:port`, possibly comma-separated."""
    wanted: set[str] = set()
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            wanted.add(item)
            try:
                host, port = split_host_port(item)
            except ValueError:
                continue
            wanted.add(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return wanted


class Director:
    def __init__(
        self,
        config: EppConfig,
        datastore: Datastore,
        scheduler: Scheduler,
        admission: Admission | None = None,
        priority_of: Callable[[str], int] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.datastore = datastore
        self.scheduler = scheduler
        self.admission = admission
        self.priority_of = priority_of or (lambda _name: 0)
        self._rng = rng or random.Random()

    def candidates(self, ctx: RequestContext) -> list[Endpoint]:
        endpoints: list[Endpoint] = list(self.datastore.snapshot())
        if not endpoints:
            raise EppError(ErrorCode.SERVICE_UNAVAILABLE, "no ready endpoints in the pool")
        if ctx.subset is not None and not self.config.disable_endpoint_subset_filter:
            wanted = _parse_endpoint_list(ctx.subset)
            endpoints = [ep for ep in endpoints if _matches(ep, wanted)]
            if not endpoints:
                raise EppError(ErrorCode.SERVICE_UNAVAILABLE, "no eligible endpoint in the subset hint")
        if ctx.test_selection:
            wanted = _parse_endpoint_list([ctx.test_selection])
            endpoints = [ep for ep in endpoints if _matches(ep, wanted)]
            if not endpoints:
                raise EppError(ErrorCode.SERVICE_UNAVAILABLE,
                               "no endpoint matches the test-epp-endpoint-selection header")
        return endpoints

    def new_request_id(self) -> str:
        return str(uuid.uuid4())

    def route(self, ctx: RequestContext, body: bytes) -> Decision:
        parsed = parse_request(api_from_path(ctx.path), body)
        ctx.parsed = parsed
        candidates = self.candidates(ctx)
        pcfg = self.config.prefix
        request = SchedulingRequest(
            request_id=ctx.request_id,
            model=parsed.model,
            block_hashes=block_hashes(parsed.segments, parsed.model, parsed.cache_salt,
                                      pcfg.block_size_bytes, pcfg.max_prefix_blocks),
            priority=self.priority_of(ctx.objective) if ctx.objective else 0,
        )
        if self.admission is not None:
            self.admission(request, candidates)
        decision = self.scheduler.schedule(request, candidates)
        self.datastore.acquire(decision.primary.key)
        return decision

    def route_bodiless(self, ctx: RequestContext) -> Endpoint:
        candidates = self.candidates(ctx)
        ep = candidates[self._rng.randrange(len(candidates))]
        self.datastore.acquire(ep.key)
        return ep

    def complete(self, ep: Endpoint) -> None:
        self.datastore.release(ep)
