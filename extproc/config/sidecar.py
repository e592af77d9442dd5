"""Every default of `prefix-epp sidecar` (extproc/sidecar/), defined once.

The sidecar runs beside the decode engine on a decode pod of a prefill/decode pool. Flag names
follow llm-d's pd-sidecar where it has the same knob (`--port`, `--kv-connector`, `--enable-tls`,
`--tls-insecure-skip-verify`, `--secure-serving`, `--cert-path`, `--metrics-port`); its default
ports too: it listens on 8000, where the InferencePool's targetPort points, and the engine moves
to 8200 (llm-d's `--model-server-port` default), reached at `decode_url`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Connector = Literal["nixlv2", "shared-storage"]
CONNECTORS: tuple[Connector, ...] = ("nixlv2", "shared-storage")
TLS_STAGES = ("prefiller", "decoder")


@dataclass(frozen=True)
class SidecarConfig:
    port: int = 8000  # --port: where the gateway sends the decode pod's requests
    bind_address: str = "0.0.0.0"
    decode_url: str = "http://127.0.0.1:8200"  # --decode-url: the local decode engine
    # --kv-connector: how the KV reaches the decode engine. nixlv2 (llm-d's default): the prefill's
    # answer carries kv_transfer_params that the decode request passes on; shared-storage: the
    # decode engine loads what the prefill engine wrote (vLLM's ExampleConnector), the decode
    # request is the client's own.
    kv_connector: Connector = "nixlv2"
    enable_tls: tuple[str, ...] = ()  # --enable-tls prefiller,decoder: https to that stage
    tls_insecure_skip_verify: tuple[str, ...] = ()  # stages whose certificate is not verified
    ca_file: str = ""  # --ca-file: PEM CA bundle verifying the engines' certificates ("": the system's)
    secure_serving: bool = False  # --secure-serving: serve TLS (the gateway must then dial TLS)
    cert_path: str = ""  # directory with tls.crt and tls.key (required with --secure-serving)
    metrics_port: int = 0  # --metrics-port: the sidecar's own /metrics (0: off; /metrics on --port is the engine's)
    # The client's body is read whole to build the prefill request: bound it (413 above), as the
    # picker bounds what it buffers (EppConfig.max_request_body_bytes).
    max_request_body_bytes: int = 64 * 1024 * 1024
    # A prefill answer is one token: anything this large is not one (the sidecar answers 502).
    max_prefill_response_bytes: int = 4 * 1024 * 1024
    connect_timeout_s: float = 5.0  # TCP connect to either engine; past it the engine is unreachable (502)
    # A prefill computes a whole prompt once: minutes at most even for a long prompt on a busy engine.
    prefill_timeout_s: float = 300.0  # past it 504, and no decode
    # Outbound connections to the engines, all hosts together (aiohttp's pool; more requests wait).
    max_connections: int = 1024
    shutdown_grace_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
