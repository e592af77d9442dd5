"""Prefill/decode configuration in llm-d's form: disagg-profile-handler (and pd-profile-handler),
prefix-based-pd-decider, prefill-filter/decode-filter, profiles `prefill` and `decode`
(extproc/scheduling/pd_config.py, config_loader.py, build.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from extproc.commands import serve
from extproc.config.settings import EppConfig
from extproc.config.validate import StartupError
from extproc.config.values import ConfigError
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler
from extproc.scheduling.config_loader import load_text
from extproc.scheduling.deciders import AlwaysDecider, PrefixBasedDecider
from extproc.scheduling.filters.roles import RoleFilter
from testkit.pd import LLMD_PD


def test_an_llm_d_pd_config_loads_into_a_decode_profile_with_its_prefill_profile() -> None:
    cfg, profile = load_text(LLMD_PD, EppConfig())
    assert profile is not None
    assert profile.name == "decode" and profile.filters == ("decode-filter",)
    assert profile.scorers == (("prefix-cache-scorer", 2.0), ("queue-scorer", 1.0))
    assert profile.prefill is not None and profile.prefill.name == "prefill"
    assert profile.prefill.filters == ("prefill-filter",)
    assert profile.prefill.scorers == (("prefix-cache-scorer", 2.0), ("queue-scorer", 1.0))
    assert profile.decider == "prefix-based-pd-decider"
    assert cfg.disagg.non_cached_tokens == 48 and cfg.disagg.prompt_tokens == 0
    # The producer's parameters: 16 tokens x 4 bytes a block, 4096 tokens = 256 blocks.
    assert cfg.prefix.block_size_bytes == 64 and cfg.prefix.max_prefix_blocks == 256
    assert cfg.prefix.lru_capacity_per_server == 20000 and cfg.prefix.auto_tune is False
    assert profile.scorer_types() == ["prefix-cache-scorer", "queue-scorer"] * 2

    sched = build_scheduler(cfg, PrefixIndex(10), profile)
    assert [f.name for f in sched.filters] == ["decode-filter"] and sched.max_endpoints == 1
    assert sched.prefill is not None
    assert isinstance(sched.prefill.decider, PrefixBasedDecider) and sched.prefill.decider.non_cached_tokens == 48
    prefill = sched.prefill.scheduler
    assert [f.name for f in prefill.filters] == ["prefill-filter"] and isinstance(prefill.filters[0], RoleFilter)
    assert [(w.scorer.name, w.weight) for w in prefill.scorers] == [("prefix-cache-scorer", 2.0),
                                                                    ("queue-scorer", 1.0)]
    assert prefill.index is sched.index and prefill.prefill is None


def test_the_token_limit_is_read_after_the_block_size_whatever_their_order() -> None:
    text = LLMD_PD.replace("    blockSizeTokens: 16\n", "").replace(
        "lruCapacityPerServer: 20000", "lruCapacityPerServer: 20000\n    blockSizeTokens: 32")
    cfg, _ = load_text(text, EppConfig())
    assert cfg.prefix.block_size_bytes == 128 and cfg.prefix.max_prefix_blocks == 128


def test_max_endpoints_gives_decode_fallbacks_and_one_prefill_endpoint() -> None:
    text = LLMD_PD.replace("- type: max-score-picker\n",
                           "- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 2}\n")
    cfg, profile = load_text(text, EppConfig())
    sched = build_scheduler(cfg, PrefixIndex(10), profile)
    assert sched.max_endpoints == 2  # the decode pick's fallbacks
    assert sched.prefill is not None and sched.prefill.scheduler.max_endpoints == 1  # one prefill endpoint


def test_the_deprecated_pd_profile_handler_is_an_alias() -> None:
    text = LLMD_PD.replace("""- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: prefix-based-pd-decider
""", "- type: pd-profile-handler\n")
    cfg, profile = load_text(text, EppConfig())
    assert profile is not None and profile.prefill is not None and profile.decider == "prefix-based-pd-decider"
    named = text.replace("- type: pd-profile-handler\n", """- type: pd-profile-handler
  parameters: {decodeProfile: d, prefillProfile: p, deciderPluginName: always, primaryPort: 0}
- name: always
  type: always-disagg-pd-decider
""").replace("- name: prefill\n", "- name: p\n").replace("- name: decode\n", "- name: d\n")
    cfg, profile = load_text(named, EppConfig())
    assert profile is not None and profile.name == "d" and profile.prefill is not None
    assert profile.prefill.name == "p" and profile.decider == "always-disagg-pd-decider"
    sched = build_scheduler(cfg, PrefixIndex(10), profile)
    assert sched.prefill is not None and isinstance(sched.prefill.decider, AlwaysDecider)


def test_custom_profile_names_and_no_decider_means_decode_only() -> None:
    text = LLMD_PD.replace("    deciders:\n      prefill: prefix-based-pd-decider\n",
                           "    profiles: {decode: d, prefill: p}\n")
    text = text.replace("- name: prefill\n", "- name: p\n").replace("- name: decode\n", "- name: d\n")
    cfg, profile = load_text(text, EppConfig())
    assert profile is not None and profile.name == "d" and profile.filters == ("decode-filter",)
    assert profile.prefill is None and profile.decider == ""
    assert build_scheduler(cfg, PrefixIndex(10), profile).prefill is None


@pytest.mark.parametrize(("old", "new", "needle"), [
    ("      prefill: prefix-based-pd-decider\n", "      prefill: nowhere\n", "no plugin named 'nowhere'"),
    ("      prefill: prefix-based-pd-decider\n", "      prefill: queue-scorer\n", "expected a decider"),
    ("      prefill: prefix-based-pd-decider\n",
     "      prefill: prefix-based-pd-decider\n      encode: x\n", "deciders.encode"),
    ("    deciders:\n", "    stageOrder: prefill-first\n    deciders:\n", "stageOrder"),
    ("    deciders:\n", "    profiles: {fallback: agg}\n    deciders:\n", "profiles.fallback"),
    ("- name: prefill\n", "- name: encode\n", "got 'encode'"),
    ("- name: decode\n", "- name: prefill\n", "each once"),
    ("    nonCachedTokens: 48\n", "    nonCachedTokens: -1\n", "nonCachedTokens"),
    ("    nonCachedTokens: 48\n", "    nonCachedToken: 48\n", "unknown parameter 'nonCachedToken'"),
    ("- type: max-score-picker\n", "- type: max-score-picker\n- type: pd-profile-handler\n",
     "a second P/D profile handler"),
])
def test_what_is_not_served_or_misspelt_is_refused_by_name(old: str, new: str, needle: str) -> None:
    assert old in LLMD_PD
    with pytest.raises(ConfigError, match=needle):
        load_text(LLMD_PD.replace(old, new, 1), EppConfig())


def test_a_missing_prefill_profile_is_refused_when_a_decider_needs_it() -> None:
    text = LLMD_PD[:LLMD_PD.index("- name: prefill")] + LLMD_PD[LLMD_PD.index("- name: decode"):]
    with pytest.raises(ConfigError, match="needs a profile named 'prefill'"):
        load_text(text, EppConfig())


def test_serve_starts_from_the_pd_config_and_refuses_roles_of_unknown_endpoints(tmp_path: Path) -> None:
    path = tmp_path / "pd.yaml"
    path.write_text(LLMD_PD)
    base = EppConfig(endpoints=("127.0.0.1:8001", "127.0.0.1:8002"), config_file=str(path))
    serve.validate(base)  # no error
    serve.validate(replace(base, endpoint_roles=("127.0.0.1:8001=prefill", "127.0.0.1:8002=decode")))
    with pytest.raises(StartupError, match=r"127\.0\.0\.1:8009, not among --endpoints"):
        serve.validate(replace(base, endpoint_roles=("127.0.0.1:8009=prefill",)))
