"""Prefill/decode disaggregation: llm-d's disagg-profile-handler, decode first.

The scheduler of the `decode` profile runs as every scheduler does (its filters, decode-filter
among them, its scorers, its picker: the destination and, with --max-endpoints > 1, its decode
fallbacks; the prompt recorded and pinned for it). Then `PrefillStage.after` (its `prefill`):

1. The decider looks at the decode pick (extproc/scheduling/deciders.py): decode-only, or
   disaggregated.
2. Disaggregated: the `prefill` profile's own scheduler (prefill-filter, its prefix and load
   scorers, one endpoint) picks the prefill endpoint among the same candidates (those in
   rotation, with room under flow control) less the decode pick, for a copy of the request's
   inputs with one output token (the prefill runs with max_tokens 1) and no affinity hint. It
   records and pins the prompt for the prefill endpoint as any pick does, so the approximate
   index holds it for both endpoints (the decode engine receives the prefill's KV). Its
   `Decision` becomes the decode decision's `prefill`; the transport names it in
   `x-prefiller-host-port`; the director counts the request in flight on both endpoints until
   the response ends (the prefill engine's work is over by the first byte, but the picker only
   sees the response's end on the decode side: holding it that long keeps the prefill endpoint's
   count an upper bound, never an undercount).
3. No prefill endpoint left: where the decode pick can prefill itself (prefill-decode), the
   request stays decode-only; else it fails (503) as llm-d fails it, and the decode pick's
   records are undone (`Scheduler.finished` with ok False).

`Scheduler.finished` ends the prefill decision with the decode one; a fallback that served the
request instead (`reassign`) moves only the decode records (the prefill endpoint did its work).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from extproc.core.datastore import Endpoint
from extproc.core.errors import EppError, ErrorCode
from extproc.scheduling.deciders import Decider
from extproc.scheduling.filters.roles import PREFILL_ROLES
from extproc.scheduling.interfaces import SchedulingRequest

if TYPE_CHECKING:
    from extproc.scheduling.scheduler import Decision, Scheduler

DISAGGREGATED = "disaggregated"
DECODE_ONLY = "decode-only"


def prefill_request(request: SchedulingRequest) -> SchedulingRequest:
    """The request's inputs for the prefill pick, without what the decode pick filled in."""
    return SchedulingRequest(
        request_id=request.request_id, model=request.model, block_hashes=request.block_hashes,
        priority=request.priority, token_keys=request.token_keys, token_blocks=request.token_blocks,
        prompt_bytes=request.prompt_bytes, prompt_tokens=request.prompt_tokens, max_output_tokens=1)


class PrefillStage:
    def __init__(self, scheduler: Scheduler, decider: Decider) -> None:
        self.scheduler = scheduler  # the prefill profile's
        self.decider = decider

    def after(self, request: SchedulingRequest, candidates: Sequence[Endpoint], decode: Decision,
              decode_scheduler: Scheduler) -> None:
        """Decide, and pick the prefill endpoint into `decode.prefill` (module docstring)."""
        disaggregate, decode.uncached_tokens = self.decider.decide(request, decode)
        decode.pd = DECODE_ONLY
        if not disaggregate:
            return
        chosen = decode.primary
        others = [ep for ep in candidates if ep is not chosen]
        try:
            if not others:
                raise EppError(ErrorCode.SERVICE_UNAVAILABLE, "no other endpoint")
            decode.prefill = self.scheduler.schedule(prefill_request(request), others)
        except EppError as err:
            if chosen.spec.role in PREFILL_ROLES:
                return  # it prefills itself
            decode_scheduler.finished(decode, chosen, ok=False)
            raise EppError(ErrorCode.SERVICE_UNAVAILABLE,
                           f"no prefill endpoint for a disaggregated request ({err.message})") from None
        decode.pd = DISAGGREGATED
