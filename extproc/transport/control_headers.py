"""The request headers the picker reads as control input, and what each lets a client do.

Every one of them is written by the client (Envoy forwards them as sent; `:path` and `:method`
are the request line), so each is treated as untrusted input:

- `:path`: the API the body is parsed as (completions, chat, responses, embeddings, other);
- `:method`: recorded, nothing acts on it;
- `x-request-id`: the request id of logs and error replies (echoed up to 256 characters);
  a client names its own request;
- `content-length`: only an early refusal (above the per-request limit 413, above the budget's
  free bytes 429), before any byte; nothing is reserved for it;
- `x-gateway-inference-objective` (or llm-d's `x-llm-d-inference-objective`, which wins): the
  named InferenceObjective's priority. Without flow control it only decides shedding: priority < 0
  is shed (429) while the pool is saturated. No header, or a name the picker does not know, is
  priority 0 and never shed, so shedding is the client's choice. With flow control it picks the
  priority band: a client that names a higher objective goes first;
- with flow control only (docs/flow-control.md): `x-llm-d-inference-fairness-id` (or
  `x-gateway-inference-fairness-id`), the tenant whose queue the request joins, so a client
  that sends another tenant's id takes that tenant's turns; `x-llm-d-inference-ttl`, which can
  only shorten the request's wait. A deployment whose clients are not trusted with these strips
  them at the gateway (docs/security.md);
- the `--session-header` (none unless set): an affinity hint, only hashed; a client groups its
  requests on one endpoint as far as the hot-spot filter allows;
- `test-epp-endpoint-selection`: with `--enable-test-endpoint-selection` only, the endpoints
  the request may go to (a client picks its endpoint); without the flag ignored and counted.

`x-prefiller-host-port` (llm-d's prefill endpoint for a decode pod's sidecar) is not read: the
picker's routing reply sets it on a disaggregated request and removes it from every other
(extproc/transport/responses.py), so a client's copy never reaches the engine.

`read_control_headers` is the one place they are read. A control header whose bytes are not
UTF-8 is reported back (-> 400); an ignored one is not read at all, so it cannot fail a request.
The proxy's own inputs (the subset hint and the served endpoint) come from filter metadata
(extproc/transport/lb_metadata.py), not from these headers.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.control.director import RequestContext
from extproc.pb import envoy_core_pb2 as core

TEST_SELECTION_HEADER = "test-epp-endpoint-selection"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
LLMD_OBJECTIVE_HEADER = "x-llm-d-inference-objective"
FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
GATEWAY_FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
TTL_HEADER = "x-llm-d-inference-ttl"
# The headers the picker may ignore on purpose: the label values of prefix_epp_ignored_headers_total.
IGNORABLE_HEADERS = (TEST_SELECTION_HEADER,)
_ALWAYS_READ = frozenset({":path", ":method", "x-request-id", OBJECTIVE_HEADER, "content-length",
                          LLMD_OBJECTIVE_HEADER, FAIRNESS_HEADER, GATEWAY_FAIRNESS_HEADER, TTL_HEADER})


@dataclass(slots=True)
class ControlHeaders:
    """What the headers said beyond what went into the request context."""

    bad: str = ""  # the first control header whose bytes are not UTF-8
    declared: str = ""  # content-length as sent
    ignored: str = ""  # an ignorable header that was sent and ignored


def read_control_headers(headers: core.HeaderMap, ctx: RequestContext, session_header: str,
                         test_selection: bool) -> ControlHeaders:
    """Fill `ctx` from the control headers; `session_header` "" reads none, `test_selection`
    False ignores test-epp-endpoint-selection."""
    out = ControlHeaders()
    llmd_objective = llmd_fairness = False  # llm-d's header seen: its x-gateway- alias no longer counts
    for h in headers.headers:
        key = h.key
        if key == TEST_SELECTION_HEADER and not test_selection:
            out.ignored = key
            continue
        if key not in _ALWAYS_READ and key != TEST_SELECTION_HEADER and key != session_header:
            continue
        if h.raw_value:
            try:
                value = h.raw_value.decode()
            except UnicodeDecodeError:
                out.bad = out.bad or key
                continue
        else:
            value = h.value
        if key == session_header:  # may also be one of the headers below
            ctx.session = value
        if key == ":path":
            ctx.path = value
        elif key == ":method":
            ctx.method = value
        elif key == "x-request-id":
            ctx.request_id = value
        elif key == TEST_SELECTION_HEADER:
            ctx.test_selection = value
        elif key == "content-length":
            out.declared = value
        elif key == LLMD_OBJECTIVE_HEADER or (key == OBJECTIVE_HEADER and not llmd_objective):
            ctx.objective = value
            llmd_objective = llmd_objective or key == LLMD_OBJECTIVE_HEADER
        elif key == FAIRNESS_HEADER or (key == GATEWAY_FAIRNESS_HEADER and not llmd_fairness):
            ctx.fairness_id = value
            llmd_fairness = llmd_fairness or key == FAIRNESS_HEADER
        elif key == TTL_HEADER:
            ctx.request_ttl = value
    return out
