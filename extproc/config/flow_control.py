"""Flow control's configuration: the `flowControl:` section of an EndpointPickerConfig, in the
form llm-d's router reads it, with its defaults (extproc/flowcontrol/ runs it).

    featureGates: [flowControl]            # off without it: the section is validated, nothing queues
    flowControl:
      maxRequests: "1k"                    # all bands together; Kubernetes quantities; unset or 0: no limit
      maxBytes: "10Gi"
      defaultRequestTTL: 60s               # longest wait while the pool has endpoints; 0s: no limit
      noEndpointRequestTTL: 60s            # longest wait while it has none; default: defaultRequestTTL
      saturationDetector: {pluginRef: concurrency-detector}   # default utilization-detector
      defaultPriorityBand: {maxRequests: 5000, maxBytes: 1G, fairnessPolicyRef: ..., orderingPolicyRef: ...}
      defaultNegativePriorityBand: {...}   # template of bands below 0; default: defaultPriorityBand
      priorityBands:
      - {priority: 100, maxRequests: "500", defaultRequestTTL: 5s,
         fairnessPolicyRef: round-robin-fairness-policy, orderingPolicyRef: fcfs-ordering-policy}
      enableEviction: false                # only false: in-flight requests are never evicted

A band's `maxRequests`/`maxBytes` missing or 0 take the defaults (5000, 1G). A `*Ref` names a
plugin of the `plugins:` list (by its name, which defaults to its type); a reference to a type
that is not declared stands for a plugin of that type without parameters, as llm-d's router
injects its defaults. Policy plugin types: `global-strict-fairness-policy` (the default),
`round-robin-fairness-policy`, `fcfs-ordering-policy`; detectors: `utilization-detector`
(parameters in SaturationConfig, shared with the admission check) and `concurrency-detector`
(`maxConcurrency`, `concurrencyMode` requests only, `headroom`).
Not supported (an error naming them): `usageLimitPolicyPluginRef`,
`bandSelectionPolicyPluginRef`, `enableEviction: true`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from extproc.config.values import ConfigError, mapping

FEATURE_GATE = "flowControl"
GLOBAL_STRICT = "global-strict-fairness-policy"
ROUND_ROBIN = "round-robin-fairness-policy"
FCFS = "fcfs-ordering-policy"
FAIRNESS_POLICIES = (GLOBAL_STRICT, ROUND_ROBIN)
ORDERING_POLICIES = (FCFS,)
UTILIZATION = "utilization-detector"
CONCURRENCY = "concurrency-detector"
DETECTORS = (UTILIZATION, CONCURRENCY)


@dataclass(frozen=True)
class BandConfig:
    """One priority band: its queue limits, its wait limit and its policies (plugin types)."""

    priority: int = 0
    max_requests: int = 5000
    max_bytes: int = 1_000_000_000  # "1G"
    request_ttl_s: float | None = None  # None: FlowControlConfig.default_request_ttl_s; 0: no limit
    fairness: str = GLOBAL_STRICT
    ordering: str = FCFS


@dataclass(frozen=True)
class ConcurrencyDetectorConfig:
    """concurrency-detector: pool saturation = requests in flight / (endpoints x max_concurrency)."""

    max_concurrency: int = 100
    headroom: float = 0.0  # llm-d's burst allowance of its scheduling filter; accepted, not used here


@dataclass(frozen=True)
class FlowControlConfig:
    enabled: bool = False  # featureGates: [flowControl]
    max_requests: int = 0  # all bands together; 0: no limit of its own
    max_bytes: int = 0
    default_request_ttl_s: float = 60.0  # 0: a request waits until dispatched or its client leaves
    no_endpoint_request_ttl_s: float | None = None  # None: default_request_ttl_s
    bands: tuple[BandConfig, ...] = ()
    default_band: BandConfig = field(default_factory=BandConfig)
    default_negative_band: BandConfig | None = None  # None: default_band
    detector: str = UTILIZATION
    concurrency: ConcurrencyDetectorConfig = field(default_factory=ConcurrencyDetectorConfig)
    # Request headers read by flow control (fairness id, TTL): a longer value is refused (400).
    max_header_chars: int = 256
    # Distinct fairness ids that keep their own metric label; later ones share one overflow value.
    max_fairness_labels: int = 1000

    def band(self, priority: int) -> BandConfig:
        """The band of `priority`: listed, else made from its template."""
        for b in self.bands:
            if b.priority == priority:
                return b
        template = self.default_negative_band if priority < 0 and self.default_negative_band else self.default_band
        return replace(template, priority=priority)

    def ttl_s(self, band: BandConfig) -> float:
        return self.default_request_ttl_s if band.request_ttl_s is None else band.request_ttl_s

    @property
    def no_endpoint_ttl_s(self) -> float:
        t = self.no_endpoint_request_ttl_s
        return self.default_request_ttl_s if t is None else t

    def ttl_beyond(self, timeout_s: float) -> list[str]:
        """The TTLs (by field) a request may wait longer than `timeout_s`, the proxy's ext_proc
        message timeout: the proxy would answer 504 first. 0 (no limit) is among them."""
        ttls = [("defaultRequestTTL", self.default_request_ttl_s), ("noEndpointRequestTTL", self.no_endpoint_ttl_s)]
        ttls += [(f"priorityBands (priority {b.priority}).defaultRequestTTL", b.request_ttl_s)
                 for b in (*self.bands, self.default_band, self.default_negative_band)
                 if b is not None and b.request_ttl_s is not None]
        return [name for name, t in ttls if t == 0 or t >= timeout_s]


# -- values ---------------------------------------------------------------------------------------
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_SUFFIX = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_quantity(v: Any, where: str) -> int:
    """A Kubernetes quantity as a whole number >= 0: 5000, "500", "1k", "10Gi", "1G"."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    m = _QUANTITY.fullmatch(v) if isinstance(v, str) else None
    if m is not None:
        number = float(m.group(1)) * _SUFFIX[m.group(2)]
        if number == int(number):
            return int(number)
    raise ConfigError(f"{where}: expected a quantity such as 500, '1k' or '10Gi', got {v!r}")


def go_duration(v: Any) -> float | None:
    """A Go duration ("5s", "1m30s", "0s", "0") in seconds; None if `v` is not one."""
    if v == "0" or v == 0:
        return 0.0
    if not isinstance(v, str) or not v or len(v) > 64:
        return None
    pos, total = 0, 0.0
    while pos < len(v):
        m = _DURATION_PART.match(v, pos)
        if m is None:
            return None
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    return total


def _duration(v: Any, where: str) -> float:
    seconds = go_duration(v)
    if seconds is None:
        raise ConfigError(f"{where}: expected a duration such as '60s' ('0s': no limit), got {v!r}")
    return seconds


# -- the section ----------------------------------------------------------------------------------
SECTION_FIELDS = ("maxRequests", "maxBytes", "defaultRequestTTL", "noEndpointRequestTTL", "priorityBands",
                  "defaultPriorityBand", "defaultNegativePriorityBand", "saturationDetector", "enableEviction",
                  "usageLimitPolicyPluginRef", "bandSelectionPolicyPluginRef")
BAND_FIELDS = ("priority", "maxRequests", "maxBytes", "defaultRequestTTL", "fairnessPolicyRef", "orderingPolicyRef")
_UNSUPPORTED = ("usageLimitPolicyPluginRef", "bandSelectionPolicyPluginRef")


def _plugin_ref(name: Any, where: str, plugins: Mapping[str, str], types: tuple[str, ...]) -> str:
    """The plugin type `name` refers to: a declared plugin's, else a type named directly."""
    ptype = plugins.get(name) if isinstance(name, str) else None
    if ptype is None and name in types:
        ptype = name
    if ptype is None:
        raise ConfigError(f"{where}: no plugin named {name!r} (declare it under plugins, or name one of: "
                          f"{', '.join(types)})")
    if ptype not in types:
        raise ConfigError(f"{where}: {name!r} is a {ptype}, expected {' or '.join(types)}")
    return ptype


def _band(doc: Any, where: str, plugins: Mapping[str, str], base: BandConfig, *, listed: bool) -> BandConfig:
    d = mapping(doc, where, BAND_FIELDS if listed else BAND_FIELDS[1:])
    band = base
    if listed:
        p = d.get("priority")
        if isinstance(p, bool) or not isinstance(p, int) or not -(2**31) <= p < 2**31:
            raise ConfigError(f"{where}.priority: expected an integer, got {p!r}")
        band = replace(band, priority=p)
    defaults = BandConfig()  # a limit of 0 is the default's
    if "maxRequests" in d:
        band = replace(band, max_requests=parse_quantity(d["maxRequests"], f"{where}.maxRequests")
                       or defaults.max_requests)
    if "maxBytes" in d:
        band = replace(band, max_bytes=parse_quantity(d["maxBytes"], f"{where}.maxBytes") or defaults.max_bytes)
    if "defaultRequestTTL" in d:
        band = replace(band, request_ttl_s=_duration(d["defaultRequestTTL"], f"{where}.defaultRequestTTL"))
    if "fairnessPolicyRef" in d:
        band = replace(band, fairness=_plugin_ref(d["fairnessPolicyRef"], f"{where}.fairnessPolicyRef", plugins,
                                                  FAIRNESS_POLICIES))
    if "orderingPolicyRef" in d:
        band = replace(band, ordering=_plugin_ref(d["orderingPolicyRef"], f"{where}.orderingPolicyRef", plugins,
                                                  ORDERING_POLICIES))
    return band


def parse_flow_control(section: Any, plugins: Mapping[str, str], enabled: bool,
                       base: FlowControlConfig) -> FlowControlConfig:
    """The `flowControl` section (None: absent) over `base`; `plugins`: declared name -> type."""
    doc = mapping(section, "flowControl", SECTION_FIELDS)
    for key in _UNSUPPORTED:
        if key in doc:
            raise ConfigError(f"flowControl.{key}: not supported by prefix-epp (every band may dispatch "
                              "until the pool is saturated, highest priority first)")
    if doc.get("enableEviction", False) is not False:
        raise ConfigError(f"flowControl.enableEviction: only false is supported (in-flight requests are never "
                          f"evicted), got {doc['enableEviction']!r}")
    cfg = replace(base, enabled=enabled)
    if "maxRequests" in doc:
        cfg = replace(cfg, max_requests=parse_quantity(doc["maxRequests"], "flowControl.maxRequests"))
    if "maxBytes" in doc:
        cfg = replace(cfg, max_bytes=parse_quantity(doc["maxBytes"], "flowControl.maxBytes"))
    if "defaultRequestTTL" in doc:
        cfg = replace(cfg, default_request_ttl_s=_duration(doc["defaultRequestTTL"], "flowControl.defaultRequestTTL"))
    if "noEndpointRequestTTL" in doc:
        cfg = replace(cfg, no_endpoint_request_ttl_s=_duration(doc["noEndpointRequestTTL"],
                                                               "flowControl.noEndpointRequestTTL"))
    if "saturationDetector" in doc:
        d = mapping(doc["saturationDetector"], "flowControl.saturationDetector", ("pluginRef",))
        cfg = replace(cfg, detector=_plugin_ref(d.get("pluginRef"), "flowControl.saturationDetector.pluginRef",
                                                plugins, DETECTORS))
    if "defaultPriorityBand" in doc:
        cfg = replace(cfg, default_band=_band(doc["defaultPriorityBand"], "flowControl.defaultPriorityBand",
                                              plugins, BandConfig(), listed=False))
    if "defaultNegativePriorityBand" in doc:
        cfg = replace(cfg, default_negative_band=_band(
            doc["defaultNegativePriorityBand"], "flowControl.defaultNegativePriorityBand", plugins, BandConfig(),
            listed=False))
    bands = doc.get("priorityBands")
    if bands is not None and not isinstance(bands, list):
        raise ConfigError(f"flowControl.priorityBands: expected a list, got {type(bands).__name__}")
    listed: list[BandConfig] = []
    for i, entry in enumerate(bands or ()):
        band = _band(entry, f"flowControl.priorityBands[{i}]", plugins, BandConfig(), listed=True)
        if any(b.priority == band.priority for b in listed):
            raise ConfigError(f"flowControl.priorityBands[{i}].priority: {band.priority} is listed twice")
        listed.append(band)
    if bands is not None:
        cfg = replace(cfg, bands=tuple(listed))
    return cfg
