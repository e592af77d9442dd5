"""prefill-filter and decode-filter: the endpoints whose `llm-d.ai/role` may serve a stage (llm-d's names).

An endpoint's role is its pod's `llm-d.ai/role` label (Kubernetes discovery keeps every pod label
in `EndpointSpec.labels`; static endpoints get it from --endpoint-roles):

| role | prefill-filter | decode-filter |
|---|---|---|
| prefill | kept | dropped |
| decode | dropped | kept |
| prefill-decode (and `both`, its deprecated name) | kept | kept |
| none (unlabelled) | dropped | kept |
| any other value | dropped | dropped |

An unlabelled endpoint counts as decode, as llm-d counts it, so a pool without role labels
routes under a P/D configuration exactly as it does without one. llm-d's encode roles that also
prefill or decode (`encode-prefill`, `encode-prefill-decode`) are kept where llm-d keeps them.
Order is preserved; an empty result fails the request (the scheduler's 503).
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.datastore import Endpoint
from extproc.scheduling.interfaces import SchedulingRequest

PREFILL_ROLES = frozenset({"prefill", "prefill-decode", "both", "encode-prefill", "encode-prefill-decode"})
DECODE_ROLES = frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"})


class RoleFilter:
    """Keeps the endpoints whose role is in `roles` (and the unlabelled ones when `unlabelled`)."""

    def __init__(self, name: str, roles: frozenset[str], unlabelled: bool) -> None:
        self.name = name
        self.roles = roles
        self.unlabelled = unlabelled

    def filter(self, request: SchedulingRequest, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        out = []
        for ep in endpoints:
            role = ep.spec.role
            if role in self.roles or (not role and self.unlabelled):
                out.append(ep)
        return out


def prefill_filter() -> RoleFilter:
    return RoleFilter("prefill-filter", PREFILL_ROLES, unlabelled=False)


def decode_filter() -> RoleFilter:
    return RoleFilter("decode-filter", DECODE_ROLES, unlabelled=True)
