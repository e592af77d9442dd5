"""Gateway behaviours as static Envoy configurations, for the conformance-style suite.

Each `Gateway` is what a known gateway does on the ext_proc stream and the upstream cluster,
applied to `prefix-epp envoy-config`'s configuration (`patch`):

| name | request body | response | served metadata | upstream |
|---|---|---|---|---|
| envoy-gateway | FULL_DUPLEX_STREAMED | headers only, trailers never | no | endpoint override: the list |
| ai-gateway-buffered | BUFFERED | headers, FULL_DUPLEX_STREAMED body | no | ORIGINAL_DST: one endpoint |
| ai-gateway-full-duplex | FULL_DUPLEX_STREAMED | headers, FULL_DUPLEX_STREAMED body | no | ORIGINAL_DST: one endpoint |
| istio | FULL_DUPLEX_STREAMED | headers, FULL_DUPLEX_STREAMED body | yes | the list, with retries |

Envoy Gateway's EnvoyExtensionPolicy (`processingMode.request.body: FullDuplexStreamed`,
`processingMode.response: {}`) has no trailer modes: request trailers are SEND because Envoy
requires it with full-duplex request bodies, response trailers are never sent, so the ext_proc
stream ends with the response headers; it forbids fail-open with full-duplex bodies. Envoy AI
Gateway v1.1 sends neither fallbacks nor `x-gateway-destination-endpoint-served`, and with the
annotation `aigateway.envoyproxy.io/processing-body-mode` runs the picker with BUFFERED request
bodies; Istio reports the served endpoint in the `envoy.lb` metadata (here: envoy-config's
header-to-metadata wiring). Without served metadata the route adds no served header and nothing
is forwarded to the picker on the response path. Every upstream with a list retries down it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.transport.responses import LB_NAMESPACE


@dataclass(frozen=True)
class Gateway:
    name: str
    request_body_mode: str
    response_body: bool  # response body FULL_DUPLEX_STREAMED (and trailers SEND); else headers only
    served_metadata: bool  # x-gateway-destination-endpoint-served reaches the picker
    fallbacks: bool  # the upstream walks the picker's list (else ORIGINAL_DST: one endpoint)

    @property
    def max_endpoints(self) -> int:
        return 2 if self.fallbacks else 1

    def patch(self, config: dict[str, Any]) -> None:
        """Make envoy-config's configuration behave as this gateway does."""
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ext_proc = hcm["http_filters"][0]["typed_config"]
        mode = ext_proc["processing_mode"]
        mode.update(request_body_mode=self.request_body_mode, request_trailer_mode="SEND", response_header_mode="SEND",
                    response_body_mode="FULL_DUPLEX_STREAMED" if self.response_body else "NONE",
                    response_trailer_mode="SEND" if self.response_body else "SKIP")
        if not self.served_metadata:
            served = "envoy.filters.http.header_to_metadata"
            hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != served]
            ext_proc["metadata_options"] = {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}}
            for host in hcm["route_config"]["virtual_hosts"]:
                for route in host["routes"]:
                    route.pop("response_headers_to_add", None)


GATEWAYS = (
    Gateway("envoy-gateway", "FULL_DUPLEX_STREAMED", response_body=False, served_metadata=False, fallbacks=True),
    Gateway("ai-gateway-buffered", "BUFFERED", response_body=True, served_metadata=False, fallbacks=False),
    Gateway("ai-gateway-full-duplex", "FULL_DUPLEX_STREAMED", response_body=True, served_metadata=False,
            fallbacks=False),
    Gateway("istio", "FULL_DUPLEX_STREAMED", response_body=True, served_metadata=True, fallbacks=True),
)
