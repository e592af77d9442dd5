"""What Envoy's filter metadata tells the picker about a request (the Inference Extension's protocol,
../shared/reference/epp-protocol.md): the subset of endpoints it may choose from, and the endpoint
that served the response when fallbacks were offered, and the response's status."""

from __future__ import annotations

from extproc.pb import external_processor_pb2 as pb
from extproc.transport import responses as R


def served_endpoint(msg: pb.ProcessingRequest | None, headers: pb.HttpHeaders) -> str:
    """x-gateway-destination-endpoint-served: the envoy.lb metadata the protocol defines, else
    the response header of the same name (the proxy sets it; prefix-epp envoy-config does both)."""
    if msg is not None:
        fm = msg.metadata_context.filter_metadata
        if R.LB_NAMESPACE in fm:
            value = fm[R.LB_NAMESPACE].fields.get(R.SERVED_HEADER)
            if value is not None and value.string_value:
                return str(value.string_value)
    for h in headers.headers.headers:
        if h.key == R.SERVED_HEADER:
            return h.raw_value.decode(errors="replace") if h.raw_value else str(h.value)
    return ""


def response_status(headers: pb.HttpHeaders) -> int:
    """The response's `:status` (Envoy's own replies included: 503 for a failed connection or a
    reset upstream); 0 when absent or not a status code."""
    for h in headers.headers.headers:
        if h.key == ":status":
            value = h.raw_value if h.raw_value else h.value.encode()
            return int(value) if len(value) == 3 and value.isdigit() else 0
    return 0


def subset_hint(msg: pb.ProcessingRequest) -> list[str] | None:
    fm = msg.metadata_context.filter_metadata
    if R.SUBSET_NAMESPACE not in fm:
        return None
    fields = fm[R.SUBSET_NAMESPACE].fields
    if R.SUBSET_HEADER not in fields:
        return None
    value = fields[R.SUBSET_HEADER]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return [value.string_value]
    return []

