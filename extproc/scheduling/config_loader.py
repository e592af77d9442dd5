"""EndpointPickerConfig YAML (`--config-file` / `--config-text`, the Go EPP's format) -> EppConfig + Profile.

Accepted shape (apiVersion `inference.networking.x-k8s.io/v1alpha1`, `llm-d.ai/v1alpha1` or
`llm-d.ai/v1`, kind `EndpointPickerConfig`); decoding is strict: an unknown top-level field, plugin type,
parameter, profile entry key or reference is a `ConfigError` naming it.

    plugins: [{type, name (defaults to type), parameters}]
    schedulingProfiles: [{name, plugins: [{pluginRef, weight}]}]   # one profile; decode and
                                                                   # prefill with a P/D handler
    saturationDetector: {pluginRef} | {queueDepthThreshold, kvCacheUtilThreshold, metricsStalenessThreshold}
    dataLayer: {sources: [{pluginRef, extractors: [{pluginRef}]}]}
    parser: {pluginRef}
    featureGates: [dataLayer, flowControl]
    flowControl: {...}                     # extproc/config/flow_control.py (used with its feature gate)

Plugin types and parameters (every default comes from EppConfig, i.e. from the CLI flags):
| type | role | parameters -> EppConfig field |
|---|---|---|
| prefix-cache-scorer | scorer | blockSizeTokens (x bytes_per_token -> prefix.block_size_bytes), |
| | | blockSize (bytes, legacy), maxPrefixBlocksToMatch, lruCapacityPerServer, autoTune -> prefix |
| precise-prefix-cache-scorer | scorer | blockSize (engine tokens), maxPrefixBlocksToMatch, |
| | | lruCapacityPerServer, speculativeTTL (Go duration), kvCacheBackendConfigs (llm-d's |
| | | [{name: gpu/cpu/storage, weight}]) -> kv_events; turns KV events on |
| queue-scorer, kv-cache-utilization-scorer, lora-affinity-scorer, inflight-load-scorer | scorer | - |
| predicted-ttft-scorer | scorer | prefillMsPerToken, decodeStepMs, evictionWeight, newPrefixPlacement, |
| | | affinityCredit, calibrate -> latency |
| cache-aware-scorer | scorer | cacheThreshold, balanceAbsThreshold, balanceRelThreshold -> cache_aware |
| hot-spot-spill-filter | filter | relative, absolute -> spill |
| max-score-picker | picker | maxNumOfEndpoints -> max_endpoints |
| utilization-detector | detector (a filter in a profile) | queueDepthThreshold, kvCacheUtilThreshold, |
| | | metricsStalenessThreshold (Go duration), headroom -> saturation |
| metrics-data-source | data source | scheme (http/https), path, insecureSkipVerify -> metrics_source |
| core-metrics-extractor | extractor | engineLabelKey (the Go default only), defaultEngine (vllm only): |
| | | every pod is scraped with vLLM's metric names |
| approx-prefix-cache-producer | data producer | blockSizeTokens, maxPrefixTokensToMatch (/ block -> |
| | | prefix.max_prefix_blocks), lruCapacityPerServer, autoTune -> prefix |
| prefill-filter, decode-filter | filter | - (the llm-d.ai/role label: extproc/scheduling/filters/roles.py) |
| prefix-based-pd-decider | P/D decider | nonCachedTokens, promptTokens -> disagg |
| always-disagg-pd-decider | P/D decider | - |
| disagg-profile-handler, pd-profile-handler | P/D profile handler | profiles, deciders (extproc/scheduling/ |
| | | pd_config.py): profiles `decode` and `prefill`, decode first (extproc/scheduling/disagg.py) |
| single-profile-handler, openai-parser | accepted | - |
| global-strict-fairness-policy, round-robin-fairness-policy, fcfs-ordering-policy | flow control | - |
| concurrency-detector | flow control detector | maxConcurrency, concurrencyMode (requests), headroom |
| | | -> flow_control.concurrency |

Because parameters land in EppConfig fields, each type may appear once. Profile rules (Go EPP):
a scorer without a weight gets WeightsConfig.unlisted (1); no picker -> max-score-picker; no
`schedulingProfiles` -> one profile with every filter, scorer and picker in plugin order; no
filter, scorer or picker at all -> the default profile (extproc/scheduling/build.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from extproc.config.flow_control import FEATURE_GATE as FLOW_CONTROL_GATE
from extproc.config.flow_control import parse_flow_control
from extproc.config.settings import NEW_PREFIX_PLACEMENTS, EppConfig
from extproc.config.values import ConfigError, mapping, parse_duration
from extproc.scheduling.build import FILTERS, PICKERS, SCORERS, Profile
from extproc.scheduling.config_params import (
    APPLIED_LAST,
    Param,
    at_least,
    block_tokens,
    boolean,
    concurrency,
    default_engine,
    number,
    one_of,
    prefix_tokens,
    set_field,
    tier_weights,
    url_path,
)
from extproc.scheduling.pd_config import DISAGG, HANDLERS, PD, parse_handler

API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1", "llm-d.ai/v1")
TOP_LEVEL = ("apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector",
             "dataLayer", "parser", "flowControl")
FEATURE_GATES = ("dataLayer", FLOW_CONTROL_GATE)
ENGINE_LABEL_KEY = "inference.networking.k8s.io/engine-type"


_SATURATION_PARAMS = {
    "queueDepthThreshold": Param(number(0, lo_open=True), set_field("saturation", "queue_depth_threshold")),
    "kvCacheUtilThreshold": Param(number(0, 1, lo_open=True), set_field("saturation", "kv_cache_util_threshold")),
    "metricsStalenessThreshold": Param(parse_duration, set_field("saturation", "metrics_staleness_threshold_s")),
    "headroom": Param(number(0), set_field("saturation", "headroom")),
}

PLUGIN_PARAMS: dict[str, dict[str, Param]] = {
    "prefix-cache-scorer": {
        "blockSizeTokens": Param(at_least(1), block_tokens),
        "blockSize": Param(at_least(1), set_field("prefix", "block_size_bytes")),
        "maxPrefixBlocksToMatch": Param(at_least(1), set_field("prefix", "max_prefix_blocks")),
        "lruCapacityPerServer": Param(at_least(1), set_field("prefix", "lru_capacity_per_server")),
        "autoTune": Param(boolean, set_field("prefix", "auto_tune")),
    },
    "approx-prefix-cache-producer": {
        "blockSizeTokens": Param(at_least(1), block_tokens),
        "maxPrefixTokensToMatch": Param(at_least(1), prefix_tokens),  # applied after blockSizeTokens
        "lruCapacityPerServer": Param(at_least(1), set_field("prefix", "lru_capacity_per_server")),
        "autoTune": Param(boolean, set_field("prefix", "auto_tune")),
    },
    "precise-prefix-cache-scorer": {
        "blockSize": Param(at_least(1), set_field("kv_events", "block_size")),
        "maxPrefixBlocksToMatch": Param(at_least(1), set_field("kv_events", "max_blocks")),
        "lruCapacityPerServer": Param(at_least(1), set_field("kv_events", "index_capacity")),
        "speculativeTTL": Param(parse_duration, set_field("kv_events", "speculative_ttl_s")),
        "kvCacheBackendConfigs": Param(tier_weights, set_field("kv_events", "tier_weights")),
    },
    "queue-scorer": {},
    "kv-cache-utilization-scorer": {},
    "lora-affinity-scorer": {},
    "inflight-load-scorer": {},
    "predicted-ttft-scorer": {
        "prefillMsPerToken": Param(number(0, lo_open=True), set_field("latency", "prefill_ms_per_token")),
        "decodeStepMs": Param(number(0, lo_open=True), set_field("latency", "decode_step_ms")),
        "evictionWeight": Param(number(0), set_field("latency", "eviction_weight")),
        "affinityCredit": Param(number(0), set_field("latency", "affinity_credit")),
        "newPrefixPlacement": Param(one_of(*NEW_PREFIX_PLACEMENTS), set_field("latency", "new_prefix_placement")),
        "calibrate": Param(boolean, set_field("latency", "calibrate")),
        "balanceFactor": Param(number(0), set_field("balance", "factor")),
        "balanceSlack": Param(number(0), set_field("balance", "slack")),
    },
    "cache-aware-scorer": {
        "cacheThreshold": Param(number(0, 1), set_field("cache_aware", "cache_threshold")),
        "balanceAbsThreshold": Param(at_least(0), set_field("cache_aware", "balance_abs")),
        "balanceRelThreshold": Param(number(1), set_field("cache_aware", "balance_rel")),
    },
    "hot-spot-spill-filter": {
        "relative": Param(number(1), set_field("spill", "relative")),
        "absolute": Param(number(0), set_field("spill", "absolute")),
    },
    "max-score-picker": {"maxNumOfEndpoints": Param(at_least(1), set_field("", "max_endpoints"))},
    "utilization-detector": _SATURATION_PARAMS,
    "metrics-data-source": {
        "scheme": Param(one_of("http", "https"), set_field("metrics_source", "scheme")),
        "path": Param(url_path, set_field("metrics_source", "path")),
        "insecureSkipVerify": Param(boolean, set_field("metrics_source", "insecure_skip_verify")),
    },
    "core-metrics-extractor": {
        # The picker reads no engine label: every pod is treated as defaultEngine (vllm). Only the Go
        # EPP's default key is accepted, so a config that relies on another label is refused, not ignored.
        "engineLabelKey": Param(one_of(ENGINE_LABEL_KEY), lambda cfg, _v: cfg),
        "defaultEngine": Param(one_of("vllm"), default_engine),
    },
    "prefill-filter": {},
    "decode-filter": {},
    "prefix-based-pd-decider": {
        "nonCachedTokens": Param(at_least(0), set_field("disagg", "non_cached_tokens")),
        "promptTokens": Param(at_least(0), set_field("disagg", "prompt_tokens")),
    },
    "always-disagg-pd-decider": {},
    # Their parameters name profiles and plugins (extproc/scheduling/pd_config.py), not EppConfig fields.
    DISAGG: {},
    PD: {},
    "single-profile-handler": {},
    "openai-parser": {},
    # Flow control (extproc/config/flow_control.py): referenced from the flowControl section.
    "global-strict-fairness-policy": {},
    "round-robin-fairness-policy": {},
    "fcfs-ordering-policy": {},
    "concurrency-detector": {
        "maxConcurrency": Param(at_least(1), concurrency("max_concurrency")),
        # Only request counting: token counting needs an estimate of each request's tokens.
        "concurrencyMode": Param(one_of("requests"), lambda cfg, _v: cfg),
        "headroom": Param(number(0), concurrency("headroom")),
    },
}


def _list(v: Any, where: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise ConfigError(f"{where}: expected a list, got {type(v).__name__}")
    return v


class _Loader:
    def __init__(self, base: EppConfig) -> None:
        self.cfg = base
        self.plugins: dict[str, str] = {}  # name -> type, in order
        self.handler: tuple[str, str, Any] | None = None  # a P/D handler: (name, type, parameters)

    def ref(self, entry: Any, where: str, types: tuple[str, ...] | None = None) -> str:
        doc = mapping(entry, where, ("pluginRef",))
        name = doc.get("pluginRef")
        if name not in self.plugins:
            raise ConfigError(f"{where}.pluginRef: no plugin named {name!r}")
        if types is not None and self.plugins[name] not in types:
            raise ConfigError(f"{where}.pluginRef: {name!r} is a {self.plugins[name]}, expected {' or '.join(types)}")
        return str(name)

    def load_plugins(self, entries: list[Any]) -> None:
        seen_types: set[str] = set()
        for i, entry in enumerate(entries):
            where = f"plugins[{i}]"
            doc = mapping(entry, where, ("type", "name", "parameters"))
            ptype = doc.get("type")
            if ptype not in PLUGIN_PARAMS:
                raise ConfigError(f"{where}: unknown plugin type {ptype!r} (known: {', '.join(PLUGIN_PARAMS)})")
            name = doc.get("name") or ptype
            if not isinstance(name, str) or name in self.plugins:
                raise ConfigError(f"{where}: plugin name {name!r} is invalid or used twice")
            if ptype in seen_types:
                raise ConfigError(f"{where}: plugin type {ptype!r} is configured twice; prefix-epp takes one of each")
            seen_types.add(ptype)
            self.plugins[name] = ptype
            if ptype in HANDLERS:  # read once every plugin it may name is known
                if self.handler is not None:
                    raise ConfigError(f"{where}: a second P/D profile handler ({ptype})")
                self.handler = (name, ptype, doc.get("parameters"))
                continue
            self.apply_params(ptype, doc.get("parameters"), f"{where} ({name}).parameters")

    def apply_params(self, ptype: str, params: Any, where: str) -> None:
        schema = PLUGIN_PARAMS[ptype]
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"{where}: expected a mapping")
        for key, value in sorted((params or {}).items(), key=lambda kv: kv[0] in APPLIED_LAST):
            if key not in schema:
                known = ", ".join(schema) or "none"
                raise ConfigError(f"{where}: unknown parameter {key!r} for {ptype} (known: {known})")
            p = schema[key]
            self.cfg = p.apply(self.cfg, p.convert(value, f"{where}.{key}"))

    def profile(self, profiles: list[Any]) -> Profile | None:
        if self.handler is not None:
            return self.pd_profiles(profiles)
        if len(profiles) > 1:
            raise ConfigError("schedulingProfiles: prefix-epp runs one profile (single-profile-handler), "
                              "or decode and prefill with disagg-profile-handler")
        if not profiles:
            names = [n for n, t in self.plugins.items() if t in FILTERS or t in SCORERS or t in PICKERS]
            if not names:
                return None
            entries: list[tuple[str, Any, str]] = [(n, None, f"plugins ({n})") for n in names]
            return self.one_profile("default", entries, "plugins")
        return self.listed_profile(profiles[0], 0)

    def pd_profiles(self, profiles: list[Any]) -> Profile:
        """The decode profile, with the prefill profile and decider where the handler names a decider."""
        assert self.handler is not None
        name, ptype, params = self.handler
        handler = parse_handler(ptype, params, f"plugins ({name}).parameters", self.plugins)
        named: dict[str, Profile] = {}
        for i, entry in enumerate(profiles):
            p = self.listed_profile(entry, i)
            if p.name not in (handler.decode, handler.prefill) or p.name in named:
                raise ConfigError(f"schedulingProfiles[{i}]: {ptype} runs the profiles {handler.decode!r} and "
                                  f"{handler.prefill!r}, each once; got {p.name!r}")
            named[p.name] = p
        wanted = (handler.decode, handler.prefill) if handler.decider else (handler.decode,)
        for pname in wanted:
            if pname not in named:
                raise ConfigError(f"schedulingProfiles: {ptype} needs a profile named {pname!r}")
        decode = named[handler.decode]
        if not handler.decider:  # llm-d: no prefill decider, no disaggregation
            return decode
        return replace(decode, prefill=named[handler.prefill], decider=handler.decider)

    def listed_profile(self, entry: Any, n: int) -> Profile:
        doc = mapping(entry, f"schedulingProfiles[{n}]", ("name", "plugins"))
        entries = []
        for i, e in enumerate(_list(doc.get("plugins"), f"schedulingProfiles[{n}].plugins")):
            where = f"schedulingProfiles[{n}].plugins[{i}]"
            d = mapping(e, where, ("pluginRef", "weight"))
            entries.append((self.ref({"pluginRef": d.get("pluginRef")}, where), d.get("weight"), where))
        return self.one_profile(str(doc.get("name") or "default"), entries, f"schedulingProfiles[{n}]")

    def one_profile(self, pname: str, entries: list[tuple[str, Any, str]], where_profile: str) -> Profile:
        filters: list[str] = []
        scorers: list[tuple[str, float]] = []
        pickers: list[str] = []
        for name, weight, where in entries:
            ptype = self.plugins[name]
            if ptype in SCORERS:
                w = self.cfg.weights.unlisted if weight is None else number(0)(weight, f"{where}.weight")
                scorers.append((ptype, w))
            elif weight is not None:
                raise ConfigError(f"{where}.weight: only scorers take a weight ({name!r} is a {ptype})")
            elif ptype in FILTERS:
                filters.append(ptype)
            elif ptype in PICKERS:
                pickers.append(ptype)
            else:
                raise ConfigError(f"{where}: {name!r} ({ptype}) cannot be part of a scheduling profile")
        if len(pickers) > 1:
            raise ConfigError(f"{where_profile}: more than one picker ({', '.join(pickers)})")
        return Profile(name=pname, filters=tuple(filters), scorers=tuple(scorers),
                       picker=pickers[0] if pickers else "max-score-picker")

    def saturation_detector(self, section: Any) -> None:
        if section is None:
            return
        if isinstance(section, dict) and "pluginRef" in section:
            self.ref(section, "saturationDetector", ("utilization-detector",))
            return
        doc = mapping(section, "saturationDetector", ("pluginRef", *_SATURATION_PARAMS))
        self.apply_params("utilization-detector", doc, "saturationDetector")

    def data_layer(self, section: Any) -> None:
        doc = mapping(section, "dataLayer", ("sources",))
        for i, src in enumerate(_list(doc.get("sources"), "dataLayer.sources")):
            where = f"dataLayer.sources[{i}]"
            s = mapping(src, where, ("pluginRef", "extractors"))
            self.ref({"pluginRef": s.get("pluginRef")}, where, ("metrics-data-source",))
            for j, ex in enumerate(_list(s.get("extractors"), f"{where}.extractors")):
                self.ref(ex, f"{where}.extractors[{j}]", ("core-metrics-extractor",))


def load_text(text: str, base: EppConfig, source: str = "--config-text") -> tuple[EppConfig, Profile | None]:
    """Parse and validate one EndpointPickerConfig; returns the updated config and its profile."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    try:
        return _load(doc, base)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _load(doc: Any, base: EppConfig) -> tuple[EppConfig, Profile | None]:
    top = mapping(doc, "EndpointPickerConfig", TOP_LEVEL)
    if top.get("apiVersion") not in API_VERSIONS:
        raise ConfigError(f"apiVersion must be one of {list(API_VERSIONS)}, got {top.get('apiVersion')!r}")
    if top.get("kind") != "EndpointPickerConfig":
        raise ConfigError(f"kind must be EndpointPickerConfig, got {top.get('kind')!r}")
    gates = _list(top.get("featureGates"), "featureGates")
    for i, gate in enumerate(gates):
        if gate not in FEATURE_GATES:
            raise ConfigError(f"featureGates[{i}]: unsupported feature gate {gate!r} "
                              f"(supported: {', '.join(FEATURE_GATES)})")
    loader = _Loader(base)
    loader.load_plugins(_list(top.get("plugins"), "plugins"))
    profile = loader.profile(_list(top.get("schedulingProfiles"), "schedulingProfiles"))
    loader.saturation_detector(top.get("saturationDetector"))
    if "dataLayer" in top:
        loader.data_layer(top["dataLayer"])
    if "parser" in top:
        loader.ref(top["parser"], "parser", ("openai-parser",))
    cfg = loader.cfg
    flow = parse_flow_control(top.get("flowControl"), loader.plugins, FLOW_CONTROL_GATE in gates, cfg.flow_control)
    return replace(cfg, flow_control=flow), profile


def load_config(config: EppConfig) -> tuple[EppConfig, Profile | None]:
    """Apply `config.config_file` or `config.config_text` (not both); no config -> (config, None)."""
    if config.config_file and config.config_text:
        raise ConfigError("give --config-file or --config-text, not both")
    if config.config_file:
        try:
            text = Path(config.config_file).read_text()
        except OSError as exc:
            raise ConfigError(f"--config-file {config.config_file}: {exc.strerror}") from None
        return load_text(text, config, f"--config-file {config.config_file}")
    if config.config_text:
        return load_text(config.config_text, config)
    return config, None
