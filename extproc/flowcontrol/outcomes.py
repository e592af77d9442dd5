"""How a held request ends, and the HTTP answer of each end that is not a dispatch.

| outcome (metric label, llm-d's) | status | x-llm-d-request-dropped-reason |
|---|---|---|
| Dispatched | (routed) | - |
| RejectedCapacity: its band or the global limit is full | 429 | rejected-saturated |
| RejectedNoEndpoints: no endpoint and noEndpointRequestTTL 0 | 503 | rejected-no-endpoints |
| EvictedTTL: waited its TTL while the pool had endpoints | 429 | rejected-ttl-expired |
| EvictedNoEndpoints: waited noEndpointRequestTTL without endpoints | 503 | rejected-no-endpoints |
| EvictedContextCancelled: the client left (the ext_proc stream ended) | - (nobody to answer) | - |
| EvictedOther: the picker stops | 503 | rejected-shutting-down |

Every error body is the picker's OpenAI-style JSON (extproc/core/errors.py).
"""

from __future__ import annotations

from extproc.core.errors import EppError, ErrorCode

DISPATCHED = "Dispatched"
REJECTED_CAPACITY = "RejectedCapacity"
REJECTED_NO_ENDPOINTS = "RejectedNoEndpoints"
EVICTED_TTL = "EvictedTTL"
EVICTED_NO_ENDPOINTS = "EvictedNoEndpoints"
EVICTED_CANCELLED = "EvictedContextCancelled"
EVICTED_OTHER = "EvictedOther"
OUTCOMES = (DISPATCHED, REJECTED_CAPACITY, REJECTED_NO_ENDPOINTS, EVICTED_TTL, EVICTED_NO_ENDPOINTS,
            EVICTED_CANCELLED, EVICTED_OTHER)


def saturated(limit: str) -> EppError:
    return EppError(ErrorCode.RESOURCE_EXHAUSTED, f"the pool is saturated and the {limit} queue is full; retry later",
                    dropped_reason="rejected-saturated")


def ttl_expired(waited_s: float) -> EppError:
    return EppError(ErrorCode.RESOURCE_EXHAUSTED,
                    f"the pool stayed saturated for the request's whole queue time ({waited_s:.1f} s); retry later",
                    dropped_reason="rejected-ttl-expired")


def no_endpoints(waited_s: float) -> EppError:
    return EppError(ErrorCode.SERVICE_UNAVAILABLE,
                    f"no ready endpoints in the pool (waited {waited_s:.1f} s for one)",
                    dropped_reason="rejected-no-endpoints")


def shutting_down() -> EppError:
    return EppError(ErrorCode.SERVICE_UNAVAILABLE, "the endpoint picker is shutting down",
                    dropped_reason="rejected-shutting-down")
