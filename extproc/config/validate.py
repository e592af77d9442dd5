"""Start-up validation of the whole configuration, after the EndpointPickerConfig is applied.

`check(config)` returns one message per invalid value, each naming the flag (and so the config
field) it came from, e.g. `--prefix-block-size must be >= 1, got 0` (numbers: `RULES`; the
`--session-header` name and the cross-field checks: `check` itself); `prefix-epp serve` refuses
to start with them instead of turning Ready and failing every request.

Flags and `--config-file` (`--config-text`), applied consistently:
- a plugin parameter set in the file wins over the flag with the same meaning, and
  `overridden(flags, loaded)` lists each flag whose non-default value the file replaced, so
  serve logs one warning per such flag;
- flags that only shape the built-in profile (`--prefix-weight`, `--inflight-weight`,
  `--prefix-scorer`) cannot apply when the file defines the scheduling profile: giving them a
  non-default value together with such a file is an error (`profile_conflicts`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from extproc.config.settings import EppConfig

# RFC 9110 token, lower case (HTTP/2 and Envoy's ext_proc carry header names in lower case).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")


def valid_header_name(name: str) -> bool:
    return name == "" or _HEADER_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class Rule:
    flag: str
    path: str  # dotted EppConfig field
    lo: float
    hi: float = math.inf
    lo_open: bool = False

    def problem(self, cfg: EppConfig) -> str | None:
        v = _get(cfg, self.path)
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and (
            v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi
        if ok:
            return None
        bound = f"> {self.lo:g}" if self.lo_open else f">= {self.lo:g}"
        if self.hi != math.inf:
            bound += f" and <= {self.hi:g}"
        return f"{self.flag} must be {bound}, got {v!r}"


RULES = (
    Rule("--grpc-port", "grpc_port", 1, 65535),
    Rule("--grpc-health-port", "grpc_health_port", 1, 65535),
    Rule("--metrics-port", "metrics_port", 0, 65535),
    Rule("--max-endpoints", "max_endpoints", 1),
    Rule("--max-request-body-bytes", "max_request_body_bytes", 1),
    Rule("--max-buffered-bytes", "max_buffered_bytes", 1),
    Rule("--usage-sample-rate", "usage_sample_rate", 0, 1),
    Rule("--workers", "workers", 1, 64),
    Rule("--sync-port", "sync.port", 0, 65535),
    Rule("--sync-warm-timeout", "sync.warm_timeout_s", 0),
    Rule("--drain-timeout", "drain.timeout_s", 0),
    Rule("--refresh-metrics-interval", "refresh_metrics_interval_s", 0),
    Rule("--metrics-staleness-threshold", "metrics_staleness_threshold_s", 0, lo_open=True),
    Rule("--prefix-block-size", "prefix.block_size_bytes", 1),
    Rule("--prefix-max-blocks", "prefix.max_prefix_blocks", 1),
    Rule("--prefix-lru-capacity", "prefix.lru_capacity_per_server", 1),
    Rule("--spill-relative", "spill.relative", 1),
    Rule("--spill-absolute", "spill.absolute", 0),
    Rule("--prefix-weight", "weights.prefix", 0),
    Rule("--inflight-weight", "weights.inflight", 0),
    Rule("--prefill-ms-per-token", "latency.prefill_ms_per_token", 0, lo_open=True),
    Rule("--eviction-weight", "latency.eviction_weight", 0),
    Rule("--affinity-credit", "latency.affinity_credit", 0),
    Rule("--kv-events-port", "kv_events.port", 1, 65535),
    Rule("--kv-events-replay-port", "kv_events.replay_port", 0, 65535),
    Rule("--kv-events-dp-size", "kv_events.dp_size", 1),
    Rule("--kv-events-block-size", "kv_events.block_size", 1),
    Rule("--kv-events-index-capacity", "kv_events.index_capacity", 1),
    Rule("--kv-events-max-blocks", "kv_events.max_blocks", 1),
    Rule("--kv-events-speculative-ttl", "kv_events.speculative_ttl_s", 0, lo_open=True),
    Rule("--kv-events-resync-window", "kv_events.resync_window_s", 0),
    Rule("--kv-events-silence-timeout", "kv_events.silence_timeout_s", 0, lo_open=True),
    Rule("--kv-events-replay-timeout", "kv_events.replay_timeout_s", 0, lo_open=True),
    Rule("--tokenizer-timeout", "kv_events.tokenize_timeout_s", 0, lo_open=True),
    # Only reachable from an EndpointPickerConfig (utilization-detector / saturationDetector).
    Rule("saturationDetector.queueDepthThreshold", "saturation.queue_depth_threshold", 0, lo_open=True),
    Rule("saturationDetector.kvCacheUtilThreshold", "saturation.kv_cache_util_threshold", 0, 1, lo_open=True),
    Rule("saturationDetector.metricsStalenessThreshold", "saturation.metrics_staleness_threshold_s", 0,
         lo_open=True),
)

_BY_FLAG = {r.flag: r for r in RULES}
# Flags with a plugin parameter of the same meaning (the file wins): flag -> EppConfig field.
PARAMETER_FLAGS = {flag: _BY_FLAG[flag].path for flag in (
    "--prefix-block-size", "--prefix-max-blocks", "--prefix-lru-capacity", "--spill-relative", "--spill-absolute",
    "--max-endpoints", "--kv-events-block-size", "--kv-events-max-blocks", "--kv-events-index-capacity",
    "--kv-events-speculative-ttl", "--prefill-ms-per-token", "--eviction-weight", "--affinity-credit")}
PARAMETER_FLAGS["--new-prefix-placement"] = "latency.new_prefix_placement"
# Flags that only shape the built-in profile.
PROFILE_FLAGS = (("--prefix-weight", "weights.prefix"), ("--inflight-weight", "weights.inflight"),
                 ("--prefix-scorer", "kv_events.prefix_scorer"), ("--scheduler", "scheduler"))


def _get(cfg: EppConfig, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check(config: EppConfig) -> list[str]:
    problems = [p for r in RULES if (p := r.problem(config)) is not None]
    if not problems and config.max_buffered_bytes < config.max_request_body_bytes:
        problems.append(f"--max-buffered-bytes ({config.max_buffered_bytes}) must be >= --max-request-body-bytes "
                        f"({config.max_request_body_bytes}), or a body of the allowed size could never be buffered")
    if not valid_header_name(config.affinity.session_header):
        problems.append(f"--session-header must be an HTTP header name (letters, digits, - and the other "
                        f"token characters) or empty, got {config.affinity.session_header!r}")
    ports = [p for p in (config.grpc_port, config.grpc_health_port, config.metrics_port) if p]
    if len(set(ports)) != len(ports):
        problems.append("--grpc-port, --grpc-health-port and --metrics-port must differ")
    return problems


def overridden(flags: EppConfig, loaded: EppConfig) -> list[tuple[str, Any, Any]]:
    """(flag, flag value, file value) for each non-default flag value the config file replaced."""
    default = EppConfig()
    out = []
    for flag, path in PARAMETER_FLAGS.items():
        given, final = _get(flags, path), _get(loaded, path)
        if given != _get(default, path) and final != given:
            out.append((flag, given, final))
    return out


def profile_conflicts(flags: EppConfig) -> list[str]:
    """Profile-only flags given a non-default value (an error when the config file defines the profile)."""
    default = EppConfig()
    return [f"{flag} {_get(flags, path)}" for flag, path in PROFILE_FLAGS if _get(flags, path) != _get(default, path)]
