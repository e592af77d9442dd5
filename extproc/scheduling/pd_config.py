"""The P/D profile handlers of an EndpointPickerConfig (llm-d's), read by extproc/scheduling/config_loader.py.

    - type: disagg-profile-handler
      parameters:
        profiles: {decode: decode, prefill: prefill}    # the profile names (these defaults)
        deciders: {prefill: prefix-based-pd-decider}    # a decider plugin's name; none: decode only
        stageOrder: decode-first                        # the only order served here

    - type: pd-profile-handler                          # deprecated in llm-d; the same, flat
      parameters: {decodeProfile, prefillProfile, deciderPluginName (default prefix-based-pd-decider),
                   primaryPort (0 only), prefixPluginType, prefixPluginName, prefixMatchInfoProducerName}

Decoding is strict like the rest of the file. Refused by name, not ignored: an encode decider
(E/P/D), `profiles.fallback`, `stageOrder: prefill-first` and pd-profile-handler's `primaryPort`
(the data-parallel port rewrite: a rank's port is an endpoint of its own here). The profile names
must name schedulingProfiles entries (checked by the loader); the decider must be a plugin of a
decider type (extproc/scheduling/deciders.py), declared anywhere in `plugins`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.config.values import ConfigError, mapping
from extproc.scheduling.deciders import DECIDERS, PREFIX_BASED

DISAGG = "disagg-profile-handler"
PD = "pd-profile-handler"
HANDLERS = (DISAGG, PD)
_DECODE_FIRST = ("", "decode-first", "decodefirst", "decode", "decode_first")


@dataclass(frozen=True)
class Handler:
    """Which profiles a P/D handler runs, and its prefill decider's type ("": decode only)."""

    decode: str = "decode"
    prefill: str = "prefill"
    decider: str = ""


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a name, got {value!r}")
    return value


def _decider(name: str, plugins: dict[str, str], where: str) -> str:
    ptype = plugins.get(name)
    if ptype is None:
        raise ConfigError(f"{where}: no plugin named {name!r}")
    if ptype not in DECIDERS:
        raise ConfigError(f"{where}: {name!r} is a {ptype}, expected a decider ({', '.join(DECIDERS)})")
    return ptype


def parse_handler(ptype: str, params: Any, where: str, plugins: dict[str, str]) -> Handler:
    """A P/D handler's parameters, its decider resolved among `plugins` (name -> type)."""
    if ptype == PD:
        return _pd(params, where, plugins)
    doc = mapping(params or {}, where, ("profiles", "deciders", "stageOrder"))
    order = doc.get("stageOrder") or ""
    if not isinstance(order, str) or order.lower() not in _DECODE_FIRST:
        raise ConfigError(f"{where}.stageOrder: only decode-first is served, got {order!r}")
    profiles = mapping(doc.get("profiles") or {}, f"{where}.profiles", ("decode", "prefill", "encode", "fallback"))
    if "fallback" in profiles:
        raise ConfigError(f"{where}.profiles.fallback: an aggregated fallback profile is not served")
    deciders = mapping(doc.get("deciders") or {}, f"{where}.deciders", ("prefill", "encode"))
    if "encode" in deciders:
        raise ConfigError(f"{where}.deciders.encode: encode disaggregation (E/P/D) is not served")
    decider = ""
    if "prefill" in deciders:
        decider = _decider(_name(deciders["prefill"], f"{where}.deciders.prefill"), plugins,
                           f"{where}.deciders.prefill")
    return Handler(decode=_name(profiles.get("decode", "decode"), f"{where}.profiles.decode"),
                   prefill=_name(profiles.get("prefill", "prefill"), f"{where}.profiles.prefill"),
                   decider=decider)


def _pd(params: Any, where: str, plugins: dict[str, str]) -> Handler:
    doc = mapping(params or {}, where, ("decodeProfile", "prefillProfile", "deciderPluginName", "primaryPort",
                                        "prefixPluginType", "prefixPluginName", "prefixMatchInfoProducerName"))
    if doc.get("primaryPort", 0) != 0:
        raise ConfigError(f"{where}.primaryPort: the data-parallel port rewrite is not served (each target "
                          "port is an endpoint of its own)")
    name = _name(doc.get("deciderPluginName", PREFIX_BASED), f"{where}.deciderPluginName")
    return Handler(decode=_name(doc.get("decodeProfile", "decode"), f"{where}.decodeProfile"),
                   prefill=_name(doc.get("prefillProfile", "prefill"), f"{where}.prefillProfile"),
                   decider=_decider(name, plugins, f"{where}.deciderPluginName"))
