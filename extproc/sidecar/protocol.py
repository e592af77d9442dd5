"""The prefill/decode protocol of the sidecar, as pure functions: no I/O.

A disaggregated request (one that carries `x-prefiller-host-port`, set by the picker) runs as
two requests, in llm-d's pd-sidecar protocol:

1. The prefill, to the prefill engine named by the header: the client's body with
   `max_tokens` 1 (chat: `max_completion_tokens` 1 too), `min_tokens` removed, `stream` false
   and `stream_options` removed. With `nixlv2` it also carries `kv_transfer_params`
   {do_remote_decode: true, do_remote_prefill: false, remote_*: null}, which asks vLLM's
   NixlConnector to keep the prompt's KV blocks for a remote decode.
2. The decode, to the local engine. `nixlv2`: the client's body plus the `kv_transfer_params` of
   the prefill's answer (remote_block_ids, remote_engine_id, remote_host, remote_port, ...), which
   tell the decode engine where to pull the blocks from; an answer without them leaves the
   client's body as it is (the decode engine then computes the prompt itself). `shared-storage`:
   the client's body unchanged, byte for byte; the decode engine finds what the prefill engine
   wrote to the storage both share.

Only /v1/completions and /v1/chat/completions are disaggregated (`DISAGGREGATED`); every other
path is forwarded to the decode engine as it is.

Headers: `HOP_BY_HOP` (RFC 9110 section 7.6.1, and those a `Connection` header names) belong to
one connection and are never forwarded either way; `x-prefiller-host-port` is removed before
either engine sees it. The header's value must be one literal IP address and port (`host_port`):
the picker writes it from an endpoint's address and removes any copy a client sent, so anything
else is refused (400) rather than dialled.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from extproc.config.sidecar import Connector

PREFILLER_HEADER = "x-prefiller-host-port"
REQUEST_ID_HEADER = "x-request-id"
Kind = Literal["completion", "chat"]
DISAGGREGATED: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"})
# Set again for the message the sidecar sends: the address it dials and the body's length.
RESET = frozenset({"host", "content-length", "expect"})

NIXL_PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}


def host_port(value: str) -> str:
    """The prefill endpoint `value` names, as `ip:port` (`[ip6]:port`); ValueError otherwise."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{PREFILLER_HEADER} must be IP:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        addr = ipaddress.ip_address(host) if ":" in host else None
        if addr is None:
            raise ValueError(f"{PREFILLER_HEADER}: a bracketed host must be an IPv6 address")
        return f"[{addr}]:{int(port)}"
    try:
        addr4 = ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"{PREFILLER_HEADER} must be IP:PORT (an IPv6 address in brackets)") from None
    return f"{addr4}:{int(port)}"


def prefill_body(body: Mapping[str, Any], kind: Kind, connector: Connector) -> dict[str, Any]:
    """The prefill request: the client's body computing one token, not streamed (module docstring)."""
    out = dict(body)
    out["max_tokens"] = 1
    if kind == "chat":  # chat's own cap, which vLLM prefers when both are set
        out["max_completion_tokens"] = 1
    out.pop("min_tokens", None)  # vLLM refuses min_tokens > max_tokens
    out["stream"] = False
    out.pop("stream_options", None)  # vLLM refuses stream_options without stream
    if connector == "nixlv2":
        out["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
    return out


def decode_params(prefill_answer: Any) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill's answer (a JSON object), None if it has none."""
    if not isinstance(prefill_answer, dict):
        return None
    params = prefill_answer.get("kv_transfer_params")
    return params if isinstance(params, dict) else None


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """nixlv2's decode request: the client's body with the prefill's `kv_transfer_params`."""
    out = dict(body)
    out["kv_transfer_params"] = dict(params)
    return out


def connection_tokens(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """Header names a `Connection` header lists: hop-by-hop for this message only."""
    return frozenset(token.strip().lower() for name, value in headers if name.lower() == "connection"
                     for token in value.split(",") if token.strip())


def forwarded(headers: Iterable[tuple[str, str]], *, keep_length: bool = False) -> list[tuple[str, str]]:
    """The end-to-end headers of a message, to send on: hop-by-hop ones, those `Connection` names,
    the prefill header and what the sender sets again (`RESET`; `keep_length` keeps Content-Length,
    for a body passed through unchanged) removed. Repeated headers stay repeated, in order."""
    items = list(headers)
    drop = HOP_BY_HOP | connection_tokens(items) | {PREFILLER_HEADER}
    drop |= (RESET - {"content-length"}) if keep_length else RESET
    return [(name, value) for name, value in items if name.lower() not in drop]


def error_body(status: int, message: str) -> dict[str, Any]:
    """An OpenAI-style error, as vLLM answers one."""
    kinds = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLarge",
             502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
    return {"error": {"message": message, "type": kinds.get(status, "InternalServerError"), "param": None,
                      "code": status}}
