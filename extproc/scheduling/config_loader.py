"""EndpointPickerConfig YAML (`--config-file` / `--config-text`, the Go EPP's format) -> EppConfig + Profile.

Accepted shape (apiVersion `inference.networking.x-k8s.io/v1alpha1`, `llm-d.ai/v1alpha1` or
`llm-d.ai/v1`, kind `EndpointPickerConfig`); decoding is strict: an unknown top-level field, plugin type,
parameter, profile entry key or reference is a `ConfigError` naming it.

    plugins: [{type, name (defaults to type), parameters}]
    schedulingProfiles: [{name, plugins: [{pluginRef, weight}]}]   # one profile
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

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from extproc.config.flag_kinds import check_tier_weights
from extproc.config.flow_control import FEATURE_GATE as FLOW_CONTROL_GATE
from extproc.config.flow_control import parse_flow_control
from extproc.config.settings import NEW_PREFIX_PLACEMENTS, EppConfig
from extproc.config.values import ConfigError, mapping, parse_duration
from extproc.scheduling.build import FILTERS, PICKERS, SCORERS, Profile

API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1", "llm-d.ai/v1alpha1", "llm-d.ai/v1")
TOP_LEVEL = ("apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector",
             "dataLayer", "parser", "flowControl")
FEATURE_GATES = ("dataLayer", FLOW_CONTROL_GATE)
ENGINE_LABEL_KEY = "inference.networking.k8s.io/engine-type"


Apply = Callable[[EppConfig, Any], EppConfig]
Convert = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Param:
    convert: Convert
    apply: Apply


def _int(lo: int) -> Convert:
    def conv(v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{where}: expected an integer >= {lo}, got {v!r}")
        return v
    return conv


def _num(lo: float, hi: float = float("inf"), lo_open: bool = False) -> Convert:
    def conv(v: Any, where: str) -> float:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            raise ConfigError(f"{where}: expected a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
        return float(v)
    return conv


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: expected true or false, got {v!r}")
    return v


def _choice(*choices: str) -> Convert:
    def conv(v: Any, where: str) -> str:
        if v not in choices:
            raise ConfigError(f"{where}: expected one of {list(choices)}, got {v!r}")
        return str(v)
    return conv


def _path(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise ConfigError(f"{where}: expected a URL path starting with '/', got {v!r}")
    return v


def _tier_weights(v: Any, where: str) -> tuple[tuple[str, float], ...]:
    """llm-d's kvCacheBackendConfigs: a list of {name, weight} (names as its lower-cased media)."""
    if not isinstance(v, list):
        raise ConfigError(f"{where}: expected a list of {{name, weight}}, got {v!r}")
    pairs = []
    for n, item in enumerate(v):
        entry = mapping(item, f"{where}[{n}]", ("name", "weight"))
        name, weight = entry.get("name"), entry.get("weight")
        if not isinstance(name, str) or isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(f"{where}[{n}]: expected a tier name and a numeric weight, got {item!r}")
        pairs.append((name.lower(), float(weight)))
    return check_tier_weights(pairs, where)


def _set(section: str, name: str) -> Apply:
    def apply(cfg: EppConfig, value: Any) -> EppConfig:
        if not section:
            return replace(cfg, **{name: value})
        return replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    return apply


def _block_tokens(cfg: EppConfig, tokens: int) -> EppConfig:
    return replace(cfg, prefix=replace(cfg.prefix, block_size_bytes=tokens * cfg.prefix.bytes_per_token))


def _default_engine(cfg: EppConfig, engine: str) -> EppConfig:
    return cfg  # validated to be "vllm": the only metric names scraped (extproc/scraping/scraper.py)


def _concurrency(name: str) -> Apply:
    def apply(cfg: EppConfig, value: Any) -> EppConfig:
        fc = cfg.flow_control
        return replace(cfg, flow_control=replace(fc, concurrency=replace(fc.concurrency, **{name: value})))
    return apply


_SATURATION_PARAMS = {
    "queueDepthThreshold": Param(_num(0, lo_open=True), _set("saturation", "queue_depth_threshold")),
    "kvCacheUtilThreshold": Param(_num(0, 1, lo_open=True), _set("saturation", "kv_cache_util_threshold")),
    "metricsStalenessThreshold": Param(parse_duration, _set("saturation", "metrics_staleness_threshold_s")),
    "headroom": Param(_num(0), _set("saturation", "headroom")),
}

PLUGIN_PARAMS: dict[str, dict[str, Param]] = {
    "prefix-cache-scorer": {
        "blockSizeTokens": Param(_int(1), _block_tokens),
        "blockSize": Param(_int(1), _set("prefix", "block_size_bytes")),
        "maxPrefixBlocksToMatch": Param(_int(1), _set("prefix", "max_prefix_blocks")),
        "lruCapacityPerServer": Param(_int(1), _set("prefix", "lru_capacity_per_server")),
        "autoTune": Param(_bool, _set("prefix", "auto_tune")),
    },
    "precise-prefix-cache-scorer": {
        "blockSize": Param(_int(1), _set("kv_events", "block_size")),
        "maxPrefixBlocksToMatch": Param(_int(1), _set("kv_events", "max_blocks")),
        "lruCapacityPerServer": Param(_int(1), _set("kv_events", "index_capacity")),
        "speculativeTTL": Param(parse_duration, _set("kv_events", "speculative_ttl_s")),
        "kvCacheBackendConfigs": Param(_tier_weights, _set("kv_events", "tier_weights")),
    },
    "queue-scorer": {},
    "kv-cache-utilization-scorer": {},
    "lora-affinity-scorer": {},
    "inflight-load-scorer": {},
    "predicted-ttft-scorer": {
        "prefillMsPerToken": Param(_num(0, lo_open=True), _set("latency", "prefill_ms_per_token")),
        "decodeStepMs": Param(_num(0, lo_open=True), _set("latency", "decode_step_ms")),
        "evictionWeight": Param(_num(0), _set("latency", "eviction_weight")),
        "affinityCredit": Param(_num(0), _set("latency", "affinity_credit")),
        "newPrefixPlacement": Param(_choice(*NEW_PREFIX_PLACEMENTS), _set("latency", "new_prefix_placement")),
        "calibrate": Param(_bool, _set("latency", "calibrate")),
        "balanceFactor": Param(_num(0), _set("balance", "factor")),
        "balanceSlack": Param(_num(0), _set("balance", "slack")),
    },
    "cache-aware-scorer": {
        "cacheThreshold": Param(_num(0, 1), _set("cache_aware", "cache_threshold")),
        "balanceAbsThreshold": Param(_int(0), _set("cache_aware", "balance_abs")),
        "balanceRelThreshold": Param(_num(1), _set("cache_aware", "balance_rel")),
    },
    "hot-spot-spill-filter": {
        "relative": Param(_num(1), _set("spill", "relative")),
        "absolute": Param(_num(0), _set("spill", "absolute")),
    },
    "max-score-picker": {"maxNumOfEndpoints": Param(_int(1), _set("", "max_endpoints"))},
    "utilization-detector": _SATURATION_PARAMS,
    "metrics-data-source": {
        "scheme": Param(_choice("http", "https"), _set("metrics_source", "scheme")),
        "path": Param(_path, _set("metrics_source", "path")),
        "insecureSkipVerify": Param(_bool, _set("metrics_source", "insecure_skip_verify")),
    },
    "core-metrics-extractor": {
        # The picker reads no engine label: every pod is treated as defaultEngine (vllm). Only the Go
        # EPP's default key is accepted, so a config that relies on another label is refused, not ignored.
        "engineLabelKey": Param(_choice(ENGINE_LABEL_KEY), lambda cfg, _v: cfg),
        "defaultEngine": Param(_choice("vllm"), _default_engine),
    },
    "single-profile-handler": {},
    "openai-parser": {},
    # Flow control (extproc/config/flow_control.py): referenced from the flowControl section.
    "global-strict-fairness-policy": {},
    "round-robin-fairness-policy": {},
    "fcfs-ordering-policy": {},
    "concurrency-detector": {
        "maxConcurrency": Param(_int(1), _concurrency("max_concurrency")),
        # Only request counting: token counting needs an estimate of each request's tokens.
        "concurrencyMode": Param(_choice("requests"), lambda cfg, _v: cfg),
        "headroom": Param(_num(0), _concurrency("headroom")),
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
            self.apply_params(ptype, doc.get("parameters"), f"{where} ({name}).parameters")

    def apply_params(self, ptype: str, params: Any, where: str) -> None:
        schema = PLUGIN_PARAMS[ptype]
        if params is not None and not isinstance(params, dict):
            raise ConfigError(f"{where}: expected a mapping")
        for key, value in (params or {}).items():
            if key not in schema:
                known = ", ".join(schema) or "none"
                raise ConfigError(f"{where}: unknown parameter {key!r} for {ptype} (known: {known})")
            p = schema[key]
            self.cfg = p.apply(self.cfg, p.convert(value, f"{where}.{key}"))

    def profile(self, profiles: list[Any]) -> Profile | None:
        if len(profiles) > 1:
            raise ConfigError("schedulingProfiles: prefix-epp runs one profile (single-profile-handler)")
        if not profiles:
            names = [n for n, t in self.plugins.items() if t in FILTERS or t in SCORERS or t in PICKERS]
            if not names:
                return None
            entries: list[tuple[str, Any, str]] = [(n, None, f"plugins ({n})") for n in names]
            pname = "default"
        else:
            doc = mapping(profiles[0], "schedulingProfiles[0]", ("name", "plugins"))
            pname = str(doc.get("name") or "default")
            entries = []
            for i, e in enumerate(_list(doc.get("plugins"), "schedulingProfiles[0].plugins")):
                where = f"schedulingProfiles[0].plugins[{i}]"
                d = mapping(e, where, ("pluginRef", "weight"))
                entries.append((self.ref({"pluginRef": d.get("pluginRef")}, where), d.get("weight"), where))
        filters: list[str] = []
        scorers: list[tuple[str, float]] = []
        pickers: list[str] = []
        for name, weight, where in entries:
            ptype = self.plugins[name]
            if ptype in SCORERS:
                w = self.cfg.weights.unlisted if weight is None else _num(0)(weight, f"{where}.weight")
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
            raise ConfigError(f"schedulingProfiles[0]: more than one picker ({', '.join(pickers)})")
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
