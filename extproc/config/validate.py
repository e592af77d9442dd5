"""Start-up validation of the whole configuration, after the EndpointPickerConfig is applied.

`check(config)` returns one message per invalid value, each naming the flag (and so the config
field) it came from, e.g. `--prefix-block-size must be >= 1, got 0` (numbers: `RULES`, the flags'
ranges from the flag table in extproc/config/flags.py and the config-file-only fields beside them
here; the `--session-header` name, the listen addresses (IP literals) and the cross-field checks:
`check` itself); `prefix-epp serve` refuses to start with them instead of turning Ready and failing
every request.

Flags and `--config-file` (`--config-text`), applied consistently:
- a plugin parameter set in the file wins over the flag with the same meaning (`PARAMETER_FLAGS`), and
  `overridden(flags, loaded)` lists each flag whose non-default value the file replaced, so
  serve logs one warning per such flag;
- flags that only shape the built-in profile (`--scheduler`, `--prefix-weight`, `--inflight-weight`,
  `--prefix-scorer`: `PROFILE_FLAGS`) cannot apply when the file defines the scheduling profile: giving them a
  non-default value together with such a file is an error (`profile_conflicts`).

Every refusal at start-up is a `StartupError`: `prefix-epp` prints its message as one line on
stderr, `prefix-epp serve: error: <message>`, and exits with status 2 (as for a malformed flag
value), without a traceback.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Any

from extproc.config.flags import FLAGS, value_at
from extproc.config.settings import ABLATIONS, MIN_SCORED_ENDPOINTS, EppConfig


class StartupError(SystemExit):
    """`prefix-epp serve` refuses to start: the message names the flag and what to do instead."""

    def __init__(self, message: str) -> None:
        # One line, whatever the cause wrote (a YAML error spans several, with a caret under the column).
        message = " ".join(line.strip() for line in message.splitlines() if line.strip() not in ("", "^"))
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def bind_message(flag: str, address_flag: str, address: str, port: int, exc: OSError | None = None) -> str:
    """One line naming the flag: why `address`:`port` cannot be listened on, and what to do."""
    code = exc.errno if exc is not None else None
    if code == errno.EADDRNOTAVAIL:
        return (f"{address_flag} {address}: not an address of this machine; use one of its own addresses, "
                "or 0.0.0.0 (::) for all")
    if code == errno.EACCES:
        return f"{flag} {port}: permission denied (ports below 1024 need privileges); choose a port from 1024 up"
    if code == errno.EADDRINUSE:
        return f"{flag} {port}: address already in use on {address}; choose a free port or stop the process holding it"
    if exc is None:  # gRPC says only that the bind failed
        return (f"{flag} {port}: cannot listen on {address} (the port in use, or the address not this "
                "machine's); choose a free port or stop the process holding it")
    return f"{flag} {port}: cannot listen on {address}: {exc.strerror}"


# RFC 9110 token, lower case (HTTP/2 and Envoy's ext_proc carry header names in lower case).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")


def valid_header_name(name: str) -> bool:
    return name == "" or _HEADER_NAME.fullmatch(name) is not None


def valid_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Rule:
    flag: str
    path: str  # dotted EppConfig field
    lo: float
    hi: float = math.inf
    lo_open: bool = False

    def problem(self, cfg: EppConfig) -> str | None:
        v = value_at(cfg, self.path)
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and (
            v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi
        if ok:
            return None
        bound = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        if self.hi != math.inf:
            bound += f" and <= {self.hi:g}"
        return f"{self.flag} must be {bound}, got {v!r}"


# The flags' ranges come from the flag table (extproc/config/flags.py); these fields are only
# reachable from an EndpointPickerConfig (utilization-detector / saturationDetector).
CONFIG_FILE_RULES = (
    Rule("saturationDetector.queueDepthThreshold", "saturation.queue_depth_threshold", 0, lo_open=True),
    Rule("saturationDetector.kvCacheUtilThreshold", "saturation.kv_cache_util_threshold", 0, 1, lo_open=True),
    Rule("saturationDetector.metricsStalenessThreshold", "saturation.metrics_staleness_threshold_s", 0,
         lo_open=True),
)
RULES = tuple(Rule(f.name, f.path, f.range.lo, f.range.hi, f.range.lo_open)
              for f in FLAGS if f.path is not None and f.range is not None) + CONFIG_FILE_RULES

# Flags with a plugin parameter of the same meaning (the file wins): flag -> EppConfig field.
PARAMETER_FLAGS = {f.name: f.path for f in FLAGS if f.path is not None and f.parameters}
# Flags that only shape the built-in profile: (flag, EppConfig field).
PROFILE_FLAGS = tuple((f.name, f.path) for f in FLAGS if f.path is not None and f.profile_only)


def check(config: EppConfig) -> list[str]:
    problems = [p for r in RULES if (p := r.problem(config)) is not None]
    if not problems and config.max_buffered_bytes < config.max_request_body_bytes:
        problems.append(f"--max-buffered-bytes ({config.max_buffered_bytes}) must be >= --max-request-body-bytes "
                        f"({config.max_request_body_bytes}), or a body of the allowed size could never be buffered")
    if 0 < config.max_scored_endpoints < MIN_SCORED_ENDPOINTS:
        problems.append(f"--max-scored-endpoints must be 0 (score every candidate) or >= {MIN_SCORED_ENDPOINTS} "
                        f"(room for the prompt's holders, the least waiting and a sample), "
                        f"got {config.max_scored_endpoints}")
    if unknown := [name for name in config.latency.ablate if name not in ABLATIONS]:
        problems.append(f"--ablate: unknown mechanism {', '.join(unknown)}; known: {', '.join(ABLATIONS)}")
    if not valid_header_name(config.affinity.session_header):
        problems.append(f"--session-header must be an HTTP header name (letters, digits, - and the other "
                        f"token characters) or empty, got {config.affinity.session_header!r}")
    if config.sync.tls and not config.cert_path:
        problems.append("--sync-tls needs --cert-path (tls.crt, tls.key): peers verify each other's certificate")
    for flag, address, may_be_empty in (("--bind-address", config.bind_address, False),
                                         ("--metrics-bind-address", config.metrics_bind_address, True),
                                         ("--health-bind-address", config.health_bind_address, True),
                                         ("--sync-bind-address", config.sync_bind_address, True)):
        if not (address == "" and may_be_empty) and not valid_ip(address):
            problems.append(f"{flag} must be an IP address such as 0.0.0.0, :: or 127.0.0.1"
                            f"{' (or empty)' if may_be_empty else ''}, got {address!r}")
    if config.client_ca_file and not config.secure_serving:
        problems.append("--client-ca-file needs --secure-serving: client certificates are checked in the TLS handshake")
    ports = [p for p in (config.grpc_port, config.grpc_health_port, config.metrics_port) if p]
    if len(set(ports)) != len(ports):
        problems.append("--grpc-port, --grpc-health-port and --metrics-port must differ")
    return problems


def overridden(flags: EppConfig, loaded: EppConfig) -> list[tuple[str, Any, Any]]:
    """(flag, flag value, file value) for each non-default flag value the config file replaced."""
    default = EppConfig()
    out = []
    for flag, path in PARAMETER_FLAGS.items():
        given, final = value_at(flags, path), value_at(loaded, path)
        if given != value_at(default, path) and final != given:
            out.append((flag, given, final))
    return out


def profile_conflicts(flags: EppConfig) -> list[str]:
    """Profile-only flags given a non-default value (an error when the config file defines the profile)."""
    default = EppConfig()
    return [f"{flag} {value_at(flags, path)}" for flag, path in PROFILE_FLAGS
            if value_at(flags, path) != value_at(default, path)]
