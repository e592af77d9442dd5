"""Parameter kinds of the EndpointPickerConfig loader (extproc/scheduling/config_loader.py).

A `Param` is how one plugin parameter is read (`convert`: value, where -> a checked value or a
ConfigError naming `where`) and where it lands (`apply`: EppConfig, value -> EppConfig).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from extproc.config.flag_kinds import check_tier_weights
from extproc.config.settings import EppConfig
from extproc.config.values import ConfigError, mapping

Apply = Callable[[EppConfig, Any], EppConfig]
Convert = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Param:
    convert: Convert
    apply: Apply


def at_least(lo: int) -> Convert:
    def conv(v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(f"{where}: expected an integer >= {lo}, got {v!r}")
        return v
    return conv


def number(lo: float, hi: float = float("inf"), lo_open: bool = False) -> Convert:
    def conv(v: Any, where: str) -> float:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            raise ConfigError(f"{where}: expected a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
        return float(v)
    return conv


def boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: expected true or false, got {v!r}")
    return v


def one_of(*choices: str) -> Convert:
    def conv(v: Any, where: str) -> str:
        if v not in choices:
            raise ConfigError(f"{where}: expected one of {list(choices)}, got {v!r}")
        return str(v)
    return conv


def url_path(v: Any, where: str) -> str:
    if not isinstance(v, str) or not v.startswith("/"):
        raise ConfigError(f"{where}: expected a URL path starting with '/', got {v!r}")
    return v


def tier_weights(v: Any, where: str) -> tuple[tuple[str, float], ...]:
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


def set_field(section: str, name: str) -> Apply:
    def apply(cfg: EppConfig, value: Any) -> EppConfig:
        if not section:
            return replace(cfg, **{name: value})
        return replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    return apply


def block_tokens(cfg: EppConfig, tokens: int) -> EppConfig:
    return replace(cfg, prefix=replace(cfg.prefix, block_size_bytes=tokens * cfg.prefix.bytes_per_token))


def prefix_tokens(cfg: EppConfig, tokens: int) -> EppConfig:
    blocks = -(-tokens * cfg.prefix.bytes_per_token // cfg.prefix.block_size_bytes)
    return replace(cfg, prefix=replace(cfg.prefix, max_prefix_blocks=blocks))


APPLIED_LAST = ("maxPrefixTokensToMatch",)  # reads the block size, which may be set beside it


def default_engine(cfg: EppConfig, engine: str) -> EppConfig:
    return cfg  # validated to be "vllm": the only metric names scraped (extproc/scraping/scraper.py)


def concurrency(name: str) -> Apply:
    def apply(cfg: EppConfig, value: Any) -> EppConfig:
        fc = cfg.flow_control
        return replace(cfg, flow_control=replace(fc, concurrency=replace(fc.concurrency, **{name: value})))
    return apply
