"""The flag table of `prefix-epp serve`: every flag defined once, as one row of `FLAGS`.

A row (`Flag`) holds the flag's name, the EppConfig field it sets (a dotted path such as
`kv_events.resync_window_s`), its kind (how its text is parsed: int, float, Go-style bool, Go
duration, comma list, choice, text), its range for numbers, its `--help` group, metavar and help,
and what an EndpointPickerConfig does to it: `parameters` names the plugin parameters of the same
meaning (the file's value wins; serve logs each flag it replaced), `profile_only` marks the flags
that only shape the built-in profile (an error together with a file that defines the profile).
A row never holds a default: it is read from `EppConfig()` through the path. The one kind of row
without a path is a flag the command reads itself (`--log-level`); it carries its own default.

Everything else is derived from the table:
- `add_arguments(parser)`: the argparse groups and arguments (`prefix-epp serve --help-all`; `--help`
  shows the rows marked `first`, the flags a first deployment sets);
- `config_from_args(args)`: the EppConfig the parsed flags describe;
- extproc/config/validate.py: the range rules, `PARAMETER_FLAGS` and `PROFILE_FLAGS`;
- `render_markdown()`: the CLI reference, docs/cli.md (`python -m extproc.config.flags > docs/cli.md`,
  or `make docs-cli`; tests/config/test_flags.py fails while the page differs from the table).

A row's type and its kinds of value are in extproc/config/flag_kinds.py.

A new flag is one row of the flag table, nowhere else: add its field to extproc/config/settings.py
(with its default), add the row here, and regenerate docs/cli.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from extproc.config.flag_kinds import (
    BOOL,
    DURATION,
    ENDPOINTS,
    FLOAT,
    HEADER,
    INT,
    LIST,
    ROLES,
    TEXT,
    TIER_WEIGHTS,
    Flag,
    Kind,
    Range,
    choice,
    value_at,
    with_value,
)
from extproc.config.settings import ABLATIONS, NEW_PREFIX_PLACEMENTS, SCHEDULERS, EppConfig

__all__ = ["BOOL", "DURATION", "ENDPOINTS", "FLAGS", "FLOAT", "HEADER", "INT", "LIST", "ROLES", "TEXT",
           "TIER_WEIGHTS", "Flag", "Kind", "Range", "add_arguments", "choice", "config_from_args",
           "render_markdown", "value_at", "with_value"]


SERVING = "serving"
DISCOVERY = "discovery"
METRICS = "model-server metrics"
SCHEDULING = "scheduling"
KV_EVENTS = "precise prefix routing (KV events, extproc/kvevents/)"
REPLICAS = "replicas, workers and drain (extproc/sync/, extproc/runtime/)"
LOGGING = "logging"
PORT = Range(1, 65535)
PORT_OR_OFF = Range(0, 65535)
POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_1 = Range(1)
_TTFT = "predicted-ttft-scorer."
_PRECISE = "precise-prefix-cache-scorer."
_CACHE_AWARE = "cache-aware-scorer."

FLAGS: tuple[Flag, ...] = (
    Flag("--grpc-port", "grpc_port", INT, SERVING, "ext_proc gRPC port", PORT, first=True),
    Flag("--grpc-health-port", "grpc_health_port", INT, SERVING, "gRPC health port (services liveness, readiness "
         "and envoy.service.ext_proc.v3.ExternalProcessor)", PORT, first=True),
    Flag("--metrics-port", "metrics_port", INT, SERVING, "Prometheus /metrics port (0: off)", PORT_OR_OFF,
         first=True),
    Flag("--bind-address", "bind_address", TEXT, SERVING,
         "IP address the ext_proc port listens on, and every listener without an address of its own"),
    Flag("--metrics-bind-address", "metrics_bind_address", TEXT, SERVING,
         "IP address of the /metrics listener (empty: --bind-address)"),
    Flag("--health-bind-address", "health_bind_address", TEXT, SERVING,
         "IP address of the gRPC health listener (empty: --bind-address)"),
    Flag("--secure-serving", "secure_serving", BOOL, SERVING,
         "serve ext_proc over TLS (--secure-serving=false: plaintext; the gateway must match: envoy-config "
         "--epp-tls, the chart's tls.enabled)", first=True),
    Flag("--cert-path", "cert_path", TEXT, SERVING,
         "directory with tls.crt and tls.key; a self-signed ECDSA certificate when empty", first=True),
    Flag("--client-ca-file", "client_ca_file", TEXT, SERVING,
         "PEM CA bundle: ext_proc over TLS then requires a client certificate it signed (mutual TLS); "
         "empty: no client authentication"),
    Flag("--endpoints", "endpoints", ENDPOINTS, DISCOVERY,
         "static endpoints IP:port[@tcp://events[@tcp://replay]],... instead of a pool; IPv6 as [::1]:8000, "
         "no host names (the gateway routes by address)", first=True),
    Flag("--endpoint-roles", "endpoint_roles", ROLES, DISCOVERY,
         "prefill/decode roles of static endpoints, as pods' llm-d.ai/role label gives them: prefill, decode, "
         "prefill-decode (both stages; both is its old name); unnamed endpoints are unlabelled (decode); "
         "only an EndpointPickerConfig with disagg-profile-handler reads them (docs/scheduling.md)"),
    Flag("--pool-name", "pool_name", TEXT, DISCOVERY, "InferencePool to serve", first=True),
    Flag("--pool-namespace", "pool_namespace", TEXT, DISCOVERY, "its namespace (else env NAMESPACE, else default)",
         first=True),
    Flag("--pool-group", "pool_group", TEXT, DISCOVERY,
         "InferencePool API group (inference.networking.x-k8s.io reads the v1alpha2 shape)"),
    Flag("--kubeconfig", "kubeconfig", TEXT, DISCOVERY, "kubeconfig path (in-cluster config if empty)"),
    Flag("--refresh-metrics-interval", "refresh_metrics_interval_s", DURATION, METRICS,
         "scrape interval per endpoint, e.g. 50ms or 0.05 (0: no scraping)", NON_NEGATIVE),
    Flag("--scrape-budget", "scrape_budget_per_s", FLOAT, METRICS,
         "metrics scrapes per second for the whole pool: each endpoint is scraped every "
         "max(--refresh-metrics-interval, endpoints / budget) (0: unbounded)", NON_NEGATIVE),
    Flag("--scrape-engine-share", "scrape_engine_share", FLOAT, METRICS,
         "share of an engine's server time that scraping it may take, all pickers and workers together: an "
         "endpoint whose scrape takes c seconds is scraped at most every c x pickers / share, and at least "
         "once a second (0: no such floor)", Range(0, 1)),
    Flag("--metrics-staleness-threshold", "metrics_staleness_threshold_s", DURATION, METRICS,
         "older scrapes count as stale: saturated for scorers, left out of the pool gauges", POSITIVE),
    Flag("--config-file", "config_file", TEXT, SCHEDULING, "EndpointPickerConfig YAML file", first=True),
    Flag("--config-text", "config_text", TEXT, SCHEDULING, "EndpointPickerConfig YAML text"),
    Flag("--max-endpoints", "max_endpoints", INT, SCHEDULING,
         "endpoints returned per request, best first (>1: fallbacks)", AT_LEAST_1,
         parameters=("max-score-picker.maxNumOfEndpoints",), first=True),
    Flag("--outlier-consecutive-failures", "outlier.consecutive_failures", INT, SCHEDULING,
         "eject an endpoint after this many routed requests in a row failed (5xx, reset, failed "
         "connection), for --outlier-ejection-time doubling per ejection in a row (0: never)", Range(0, 1000)),
    Flag("--outlier-ejection-time", "outlier.base_ejection_s", DURATION, SCHEDULING,
         "how long a first ejection lasts; then the endpoint is probed back", POSITIVE),
    Flag("--max-scored-endpoints", "max_scored_endpoints", INT, SCHEDULING,
         "above this many candidates, score only those holding part of the prompt, the "
         "least waiting and a random sample, this many in all (0: score every candidate)", Range(0)),
    Flag("--max-request-body-bytes", "max_request_body_bytes", INT, SCHEDULING,
         "larger request bodies are refused with 413 (the picker buffers the body)", AT_LEAST_1),
    Flag("--usage-sample-rate", "usage_sample_rate", FLOAT, SCHEDULING,
         "share of requests whose response body the picker asks for, to compare predicted and reported "
         "cached tokens (0..1; needs a gateway that honours mode_override)", Range(0, 1)),
    Flag("--max-buffered-bytes", "max_buffered_bytes", INT, SCHEDULING,
         "request-body bytes buffered by all streams together, counted as received; beyond it 429 with "
         "Retry-After (a declared content-length larger than what is free is refused at once, never reserved)",
         AT_LEAST_1),
    Flag("--request-body-timeout", "request_body_timeout_s", DURATION, SCHEDULING,
         "time from the request headers to the end of the body; a slower body gets 408 and its stream is ended",
         POSITIVE),
    Flag("--enable-test-endpoint-selection", "test_endpoint_selection", BOOL, SCHEDULING,
         "honour the test-epp-endpoint-selection request header (conformance tests): any client may then choose "
         "its endpoint; off, the header is ignored and counted in prefix_epp_ignored_headers_total"),
    Flag("--explain-decisions", "explain_decisions", BOOL, SCHEDULING,
         "add an x-prefix-epp-decision response header: the endpoint, matched/total blocks, affinity=hit or miss, "
         "each scorer's score, each candidate's predicted TTFT", first=True),
    Flag("--disable-endpoint-subset-filter", "disable_endpoint_subset_filter", BOOL, SCHEDULING,
         "ignore the proxy's envoy.lb.subset_hint"),
    Flag("--prefix-block-size", "prefix.block_size_bytes", INT, SCHEDULING,
         "prefix block size in bytes (~4 bytes per token)", AT_LEAST_1,
         parameters=("prefix-cache-scorer.blockSizeTokens", "prefix-cache-scorer.blockSize")),
    Flag("--prefix-max-blocks", "prefix.max_prefix_blocks", INT, SCHEDULING, "blocks of a prompt considered at most",
         AT_LEAST_1, parameters=("prefix-cache-scorer.maxPrefixBlocksToMatch",)),
    Flag("--prefix-lru-capacity", "prefix.lru_capacity_per_server", INT, SCHEDULING,
         "prefix index capacity per endpoint, in blocks", AT_LEAST_1,
         parameters=("prefix-cache-scorer.lruCapacityPerServer",)),
    Flag("--scheduler", "scheduler", choice(*SCHEDULERS), SCHEDULING,
         "built-in profile: least predicted time to first token, the weighted sum of prefix, queue, KV-cache "
         "and in-flight scorers behind the hot-spot spill filter, or cache-aware (sglang-router's cache_aware "
         "policy, a reference)", profile_only=True, first=True),
    Flag("--prefill-ms-per-token", "latency.prefill_ms_per_token", FLOAT, SCHEDULING,
         "predicted-ttft prior: prefill milliseconds per prompt token (learned per endpoint from its TTFT "
         "histogram)", POSITIVE, parameters=(_TTFT + "prefillMsPerToken",)),
    Flag("--decode-step-ms", "latency.decode_step_ms", FLOAT, SCHEDULING,
         "predicted-ttft prior: milliseconds of one decode step at batch 1 (calibrates engines without a TTFT "
         "histogram from the response ends)", POSITIVE, parameters=(_TTFT + "decodeStepMs",)),
    Flag("--eviction-weight", "latency.eviction_weight", FLOAT, SCHEDULING,
         "predicted-ttft: multiple of the prefill time charged for each token of other prefixes a copy evicts "
         "from a full cache (0: ignore capacity)", NON_NEGATIVE, parameters=(_TTFT + "evictionWeight",)),
    Flag("--new-prefix-placement", "latency.new_prefix_placement", choice(*NEW_PREFIX_PLACEMENTS), SCHEDULING,
         "predicted-ttft: on full caches, place a prompt no endpoint holds where fewer prefix families live "
         "(homes) or where fewer tokens were recently inserted (churn)", parameters=(_TTFT + "newPrefixPlacement",)),
    Flag("--affinity-credit", "latency.affinity_credit", FLOAT, SCHEDULING,
         "predicted-ttft: an endpoint that served the request's affinity key is credited with this share of the "
         "request's uncached prefill time", NON_NEGATIVE, parameters=(_TTFT + "affinityCredit",)),
    Flag("--ttft-calibration", "latency.calibrate", BOOL, SCHEDULING,
         "learn each endpoint's slowdown from its vllm:time_to_first_token_seconds histogram (else from the "
         "response ends)",
         parameters=(_TTFT + "calibrate",)),
    Flag("--ablate", "latency.ablate", LIST, SCHEDULING,
         "benchmark only, never in production: predicted-ttft mechanisms to turn off, each replaced by the "
         "simplest behaviour (docs/ablation.md): " + ", ".join(ABLATIONS)),
    Flag("--affinity-hints", "affinity.enabled", BOOL, SCHEDULING,
         "treat requests with the same prompt_cache_key (else the same --session-header value) as sharing a "
         "prefix; keys are only hashed, never logged"),
    Flag("--session-header", "affinity.session_header", HEADER, SCHEDULING,
         "request header whose value is an affinity hint when the body has no prompt_cache_key (lower-cased; "
         "empty: none)"),
    Flag("--spill-relative", "spill.relative", FLOAT, SCHEDULING,
         "hot-spot guard: skip endpoints with load > R * min load + A", AT_LEAST_1,
         parameters=("hot-spot-spill-filter.relative",)),
    Flag("--spill-absolute", "spill.absolute", FLOAT, SCHEDULING, "the A of --spill-relative", NON_NEGATIVE,
         parameters=("hot-spot-spill-filter.absolute",)),
    Flag("--balance-factor", "balance.factor", FLOAT, SCHEDULING,
         "predicted-ttft: a cached prefix does not count on an endpoint where more than S in-flight requests "
         "reuse it and which holds more than ceil(F * (pool load + 1) / endpoints) requests (0: no bound)",
         NON_NEGATIVE, parameters=(_TTFT + "balanceFactor",)),
    Flag("--balance-slack", "balance.slack", FLOAT, SCHEDULING, "the S of --balance-factor", NON_NEGATIVE,
         parameters=(_TTFT + "balanceSlack",)),
    Flag("--prefix-weight", "weights.prefix", FLOAT, SCHEDULING, "weight of the prefix scorer (weighted profile)",
         NON_NEGATIVE, profile_only=True),
    Flag("--inflight-weight", "weights.inflight", FLOAT, SCHEDULING,
         "weight of the in-flight scorer (weighted profile)", NON_NEGATIVE, profile_only=True),
    Flag("--cache-threshold", "cache_aware.cache_threshold", FLOAT, SCHEDULING,
         "cache-aware: the endpoint with the longest prefix match takes the request when the match is more than "
         "this share of the prompt's blocks, else the least loaded", Range(0, 1),
         parameters=(_CACHE_AWARE + "cacheThreshold",)),
    Flag("--balance-abs-threshold", "cache_aware.balance_abs", INT, SCHEDULING,
         "cache-aware: loads count as imbalanced, and the least loaded endpoint takes the request whatever it "
         "holds, when max - min in-flight > this and max > --balance-rel-threshold x min", NON_NEGATIVE,
         parameters=(_CACHE_AWARE + "balanceAbsThreshold",)),
    Flag("--balance-rel-threshold", "cache_aware.balance_rel", FLOAT, SCHEDULING,
         "cache-aware: the relative bound of --balance-abs-threshold", AT_LEAST_1,
         parameters=(_CACHE_AWARE + "balanceRelThreshold",)),
    Flag("--seed", "seed", INT, SCHEDULING, "seed for random tie-breaks (tests)"),
    Flag("--model-names", "model_names", LIST, SCHEDULING,
         "comma-separated model names that keep their own metric label (the engines' own model names always do; "
         "any other name is counted as 'other')"),
    Flag("--prefix-scorer", "kv_events.prefix_scorer", choice("approximate", "precise"), KV_EVENTS,
         "prefix scorer of the default profile; precise subscribes to the engines' KV events", profile_only=True),
    Flag("--kv-events", "kv_events.enabled", BOOL, KV_EVENTS,
         "subscribe to KV events and compare both scorers' predictions even when the approximate scorer routes "
         "(only the sampled requests, --usage-sample-rate, are tokenized for it)"),
    Flag("--kv-events-port", "kv_events.port", INT, KV_EVENTS, "engine KV-events publisher port on the endpoint's "
         "host, of rank 0: rank r (a pool's r-th target port) publishes on port + r (per endpoint: "
         "host:port@tcp://h:p)", PORT),
    Flag("--kv-events-replay-port", "kv_events.replay_port", INT, KV_EVENTS,
         "engine replay (ROUTER) port on the same host, of rank 0 (rank r: + r; at least the ranks' count "
         "from --kv-events-port); 0: no replay, resync instead", PORT_OR_OFF),
    Flag("--kv-events-dp-size", "kv_events.dp_size", INT, KV_EVENTS,
         "data-parallel ranks behind each endpoint's port (vLLM's internal balancer); the r-th target "
         "port holds ranks r*N .. r*N + N - 1", AT_LEAST_1),
    Flag("--kv-events-block-size", "kv_events.block_size", INT, KV_EVENTS,
         "engine tokens per block until vllm:cache_config_info or an event reports it", AT_LEAST_1,
         parameters=(_PRECISE + "blockSize",)),
    Flag("--kv-events-index-capacity", "kv_events.index_capacity", INT, KV_EVENTS,
         "precise index entries per endpoint rank until num_gpu_blocks is scraped, and per CPU or storage "
         "tier of a rank", AT_LEAST_1,
         parameters=(_PRECISE + "lruCapacityPerServer",)),
    Flag("--kv-events-max-blocks", "kv_events.max_blocks", INT, KV_EVENTS,
         "leading token blocks of a prompt looked up at most", AT_LEAST_1,
         parameters=(_PRECISE + "maxPrefixBlocksToMatch",)),
    Flag("--kv-tier-weights", "kv_events.tier_weights", TIER_WEIGHTS, KV_EVENTS,
         "what a block held on each KV cache tier counts for in the precise match (tiers left out keep their "
         "default; 0: the tier's events are not indexed); a lower tier's share 1 - weight counts as prefill work",
         parameters=(_PRECISE + "kvCacheBackendConfigs",)),
    Flag("--kv-events-speculative-ttl", "kv_events.speculative_ttl_s", DURATION, KV_EVENTS,
         "how long decision-time entries count before events confirm them", POSITIVE,
         parameters=(_PRECISE + "speculativeTTL",)),
    Flag("--kv-events-resync-window", "kv_events.resync_window_s", DURATION, KV_EVENTS,
         "after lost events, fresh events needed this long before precise scoring resumes", NON_NEGATIVE),
    Flag("--kv-events-silence-timeout", "kv_events.silence_timeout_s", DURATION, KV_EVENTS,
         "an endpoint routed to without any event for this long is scored approximately", POSITIVE),
    Flag("--kv-events-replay-timeout", "kv_events.replay_timeout_s", DURATION, KV_EVENTS,
         "wait per replayed message", POSITIVE),
    Flag("--kv-events-max-message-bytes", "kv_events.max_message_bytes", INT, KV_EVENTS,
         "largest KV-event frame accepted (ZMQ_MAXMSGSIZE); a publisher sending a larger one is disconnected",
         Range(1024)),
    Flag("--kv-events-max-bytes-per-second", "kv_events.max_bytes_per_second", INT, KV_EVENTS,
         "KV-event bytes taken per second from one engine rank (2 s burst); beyond it messages are dropped "
         "and counted, and the endpoint is scored approximately", AT_LEAST_1),
    Flag("--tokenizer", "kv_events.tokenizer", TEXT, KV_EVENTS,
         "builtin (the simulator's), remote (the engine's POST /tokenize), render (vLLM's render endpoints: "
         "the engine's own tokens for every shape) or a tokenizer.json path"),
    Flag("--tokenizer-timeout", "kv_events.tokenize_timeout_s", DURATION, KV_EVENTS,
         "timeout of a remote tokenization (then the approximate index scores the request)", POSITIVE),
    Flag("--sync-port", "sync.port", INT, REPLICAS,
         "peer-sync gRPC port: share the prefix index with peer replicas (0: off)", PORT_OR_OFF),
    Flag("--sync-bind-address", "sync_bind_address", TEXT, REPLICAS,
         "IP address of the peer-sync listener (empty: --bind-address)"),
    Flag("--peers", "sync.peers", LIST, REPLICAS,
         "static peers host:port,... (their --sync-port; this replica may be listed)"),
    Flag("--peer-selector", "sync.peer_selector", TEXT, REPLICAS,
         "Kubernetes label selector of this picker's own pods: peers are the ready ones"),
    Flag("--sync-secret-file", "sync.secret_file", TEXT, REPLICAS,
         "file with the peers' shared secret (else env PREFIX_EPP_SYNC_SECRET); frames without its HMAC are refused"),
    Flag("--sync-tls", "sync.tls", BOOL, REPLICAS,
         "serve and dial peer sync over TLS with the --cert-path certificate (peers verify it)"),
    Flag("--sync-warm-timeout", "sync.warm_timeout_s", DURATION, REPLICAS,
         "wait at most this long for a peer's index snapshot before reporting ready", NON_NEGATIVE),
    Flag("--drain-timeout", "drain.timeout_s", DURATION, REPLICAS,
         "on SIGTERM, wait this long at most for open streams to end; streams still open then are "
         "cut and the exit status is 1", NON_NEGATIVE),
    Flag("--drain-readiness-delay", "drain.readiness_delay_s", DURATION, REPLICAS,
         "on SIGTERM, keep taking new streams this long (readiness NOT_SERVING propagates), less "
         "if none comes; then close the ext_proc port", NON_NEGATIVE),
    Flag("--workers", "workers", INT, REPLICAS,
         "picker processes sharing the ext_proc port (SO_REUSEPORT), one core each", Range(1, 64)),
    # Not a config field: `prefix-epp serve` sets up its logs from args.log_level before anything else.
    Flag("--log-level", None, choice("debug", "info", "warning", "error"), LOGGING,
         "JSON logs on stderr at this level; prompt text is never logged", default="info", first=True),
)


def add_arguments(parser: argparse.ArgumentParser, *, first_only: bool = False) -> None:
    """One argparse group per table group, in table order; each flag's default is EppConfig's.
    With `first_only` (`prefix-epp serve --help`) every flag parses the same, but only the rows
    marked `first` appear in the help and usage."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in FLAGS:
        group = groups.get(flag.group) or groups.setdefault(flag.group, parser.add_argument_group(flag.group))
        kind, default = flag.kind, flag.default_value
        shown = flag.first or not first_only
        options: dict[str, Any] = {"type": kind.parse,
                                   "help": flag.help.replace("%", "%%") if shown else argparse.SUPPRESS}
        # argparse parses a string default as if it were given, so a list keeps its parser's form.
        options["default"] = kind.show(default) if kind in (LIST, ENDPOINTS) else default
        if kind.choices:
            options["choices"] = kind.choices
        if kind is BOOL:
            options.update(nargs="?", const=True)
        if metavar := flag.metavar or kind.metavar:
            options["metavar"] = metavar
        group.add_argument(flag.name, **options)


def config_from_args(args: argparse.Namespace) -> EppConfig:
    """EppConfig() with the field of every row set to its parsed flag (rows without a path are skipped)."""
    config = EppConfig()
    for flag in FLAGS:
        if flag.path is not None:
            config = with_value(config, flag.path, getattr(args, flag.dest))
    return config


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _values(flag: Flag) -> str:
    if flag.kind.choices:
        return "one of " + ", ".join(f"`{c}`" for c in flag.kind.choices)
    return flag.kind.name + (f" {flag.range.describe()}" if flag.range else "")


def _meaning(flag: Flag) -> str:
    text = flag.help
    if flag.parameters:
        named = " or ".join(f"`{p}`" for p in flag.parameters)
        text += f". Config file: {named} wins"
    if flag.profile_only:
        text += ". Built-in profile only"
    return _cell(text)


def render_markdown() -> str:
    """The CLI reference (docs/cli.md): one table per group, in table order."""
    lines = [
        "<!-- Generated from the flag table (extproc/config/flags.py) by `make docs-cli`, i.e. "
        "`python -m extproc.config.flags > docs/cli.md`; edit the table, not this page. -->",
        "# `prefix-epp serve` flags",
        "",
        "Flag names and defaults follow the Go EPP where they exist. Every default comes from `EppConfig` "
        "(extproc/config/settings.py); the ranges are checked at start-up (extproc/config/validate.py), and the "
        "picker refuses to start with a value outside them.",
        "",
        "Values: a bool is Go-style (`--flag`, `--flag=true`, `--flag=false`); a duration is a Go duration or a "
        "number of seconds (`50ms`, `2s`, `0.05`); a comma list is `a,b,c`.",
        "",
        "With `--config-file` (`--config-text`): where a flag says *Config file: `plugin-type.parameter` wins*, "
        "that parameter of the EndpointPickerConfig, when set, replaces the flag's value (a warning names each "
        "flag it replaced); a flag marked *Built-in profile only* shapes the built-in scheduling profile, and "
        "giving it together with a file that defines the profile is an error.",
        "",
        "`prefix-epp serve --help` shows the flags a first deployment sets: "
        + ", ".join(f"`{flag.name}`" for flag in FLAGS if flag.first)
        + "; `prefix-epp serve --help-all` shows every flag, as this page does.",
    ]
    for group in dict.fromkeys(flag.group for flag in FLAGS):
        lines += ["", f"## {group}", "", "| flag | default | meaning | range |", "|---|---|---|---|"]
        for flag in (f for f in FLAGS if f.group == group):
            default = flag.default_value
            shown = "" if default is None or default in ("", ()) else f"`{flag.kind.show(default)}`"
            lines.append(f"| `{flag.name}` | {shown} | {_meaning(flag)} | {_values(flag)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
