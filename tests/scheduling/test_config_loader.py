"""EndpointPickerConfig loading: the Go EPP's format, strict validation, defaults from EppConfig."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from extproc.commands import serve
from extproc.config.settings import EppConfig, defaults_of
from extproc.config.validate import overridden
from extproc.config.values import ConfigError
from extproc.prefix.index import PrefixIndex
from extproc.scheduling.build import build_scheduler
from extproc.scheduling.config_loader import load_config, load_text

FULL = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [dataLayer]
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: lora-affinity-scorer
- type: prefix-cache-scorer
  parameters: {autoTune: false, blockSizeTokens: 32, maxPrefixBlocksToMatch: 128, lruCapacityPerServer: 5000}
- type: hot-spot-spill-filter
  parameters: {relative: 2.0, absolute: 8}
- name: picker
  type: max-score-picker
  parameters: {maxNumOfEndpoints: 2}
- type: utilization-detector
  parameters: {queueDepthThreshold: 7, kvCacheUtilThreshold: 0.9, metricsStalenessThreshold: 300ms, headroom: 0.1}
- type: metrics-data-source
  parameters: {scheme: http, path: /custom-metrics, insecureSkipVerify: true}
- type: core-metrics-extractor
  parameters: {engineLabelKey: inference.networking.k8s.io/engine-type, defaultEngine: vllm}
- type: single-profile-handler
- type: openai-parser
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: hot-spot-spill-filter}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: lora-affinity-scorer}
  - {pluginRef: picker}
saturationDetector: {pluginRef: utilization-detector}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
parser: {pluginRef: openai-parser}
"""

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"


def test_full_go_style_config_lands_in_eppconfig_and_the_profile() -> None:
    cfg, profile = load_text(FULL, EppConfig())
    assert profile is not None
    assert cfg.prefix.block_size_bytes == 32 * 4 and cfg.prefix.max_prefix_blocks == 128
    assert cfg.prefix.lru_capacity_per_server == 5000 and cfg.prefix.auto_tune is False
    assert (cfg.spill.relative, cfg.spill.absolute) == (2.0, 8.0)
    assert cfg.max_endpoints == 2
    assert (cfg.saturation.queue_depth_threshold, cfg.saturation.kv_cache_util_threshold) == (7, 0.9)
    assert cfg.saturation.metrics_staleness_threshold_s == pytest.approx(0.3) and cfg.saturation.headroom == 0.1
    assert cfg.metrics_source.path == "/custom-metrics"
    assert profile.filters == ("hot-spot-spill-filter",)
    assert profile.scorers == (("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0),
                               ("prefix-cache-scorer", 3.0), ("lora-affinity-scorer", 1.0))
    sched = build_scheduler(cfg, PrefixIndex(10), profile)
    assert [(w.scorer.name, w.weight) for w in sched.scorers][-1] == ("lora-affinity-scorer", 1.0)
    assert sched.max_endpoints == 2


def test_absent_parameters_keep_eppconfig_values_and_no_profiles_means_all_plugins() -> None:
    base = replace(EppConfig(), max_endpoints=3)
    cfg, profile = load_text(HEAD + "plugins:\n- type: queue-scorer\n- type: prefix-cache-scorer\n"
                             "- type: max-score-picker\n", base)
    assert cfg.max_endpoints == 3 and cfg.prefix == base.prefix and cfg.saturation == base.saturation
    assert profile is not None
    assert profile.scorers == (("queue-scorer", 1.0), ("prefix-cache-scorer", 1.0))
    assert profile.filters == () and profile.picker == "max-score-picker"


def test_no_scheduling_plugins_means_the_default_profile() -> None:
    cfg, profile = load_text(HEAD + "plugins:\n- type: metrics-data-source\n", EppConfig())
    assert profile is None and cfg == EppConfig()
    assert load_config(EppConfig()) == (EppConfig(), None)


def test_legacy_inline_saturation_detector_and_detector_as_filter() -> None:
    cfg, profile = load_text(HEAD + "plugins:\n- type: utilization-detector\n- type: queue-scorer\n"
                             "saturationDetector: {queueDepthThreshold: 9, metricsStalenessThreshold: 1s}\n",
                             EppConfig())
    assert cfg.saturation.queue_depth_threshold == 9 and cfg.saturation.metrics_staleness_threshold_s == 1.0
    assert profile is not None and profile.filters == ("utilization-detector",)


@pytest.mark.parametrize(("text", "needle"), [
    (HEAD + "plugins: []\nscheduling: {}\n", "unknown field 'scheduling'"),
    (HEAD + "plugins:\n- type: random-picker\n", "unknown plugin type 'random-picker'"),
    (HEAD + "plugins:\n- type: queue-scorer\n  parameters: {threshold: 1}\n", "unknown parameter 'threshold'"),
    (HEAD + "plugins:\n- type: prefix-cache-scorer\n  parameters: {blockSizeTokens: 0}\n", "blockSizeTokens"),
    (HEAD + "plugins:\n- type: prefix-cache-scorer\n  parameters: {autoTune: 'yes'}\n", "autoTune"),
    (HEAD + "plugins:\n- type: queue-scorer\n  extra: 1\n", "unknown field 'extra'"),
    (HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- plugins: [{pluginRef: nope}]\n",
     "no plugin named 'nope'"),
    (HEAD + "plugins:\n- type: max-score-picker\nschedulingProfiles:\n- plugins: [{pluginRef: max-score-picker, "
     "weight: 2}]\n", "only scorers take a weight"),
    (HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- plugins: [{pluginRef: queue-scorer, w: 1}]\n",
     "unknown field 'w'"),
    (HEAD + "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- {name: a}\n- {name: b}\n", "one profile"),
    (HEAD + "plugins:\n- type: metrics-data-source\nschedulingProfiles:\n- plugins: [{pluginRef: "
     "metrics-data-source}]\n", "cannot be part of a scheduling profile"),
    (HEAD + "plugins:\n- type: queue-scorer\n- type: queue-scorer\n  name: q2\n", "configured twice"),
    (HEAD + "plugins:\n- type: queue-scorer\n- type: kv-cache-utilization-scorer\n  name: queue-scorer\n",
     "used twice"),
    (HEAD + "featureGates: [flowcontrol]\n", "unsupported feature gate 'flowcontrol' (supported: dataLayer, "
     "flowControl)"),
    (HEAD + "flowControl: {maxBytez: 10Gi}\n", "flowControl: unknown field 'maxBytez' (known: maxRequests"),
    ("apiVersion: v1\nkind: EndpointPickerConfig\n", "apiVersion must be one of"),
    ("apiVersion: llm-d.ai/v1alpha1\nkind: Pod\n", "kind must be EndpointPickerConfig"),
    (HEAD + "plugins:\n- type: utilization-detector\n  parameters: {metricsStalenessThreshold: 0.2}\n",
     "expected a duration"),
    (HEAD + "plugins:\n- type: core-metrics-extractor\n  parameters: {defaultEngine: sglang}\n", "'sglang'"),
    (HEAD + "saturationDetector: {pluginRef: missing}\n", "no plugin named 'missing'"),
    (HEAD + "plugins:\n- type: queue-scorer\ndataLayer:\n  sources: [{pluginRef: queue-scorer}]\n",
     "expected metrics-data-source"),
    (HEAD + "plugins: [\n", "not valid YAML"),
    ("- just\n- a list\n", "expected a mapping"),
])
def test_strict_validation_names_the_offender(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_text(text, EppConfig())
    assert needle in str(err.value)
    assert str(err.value).startswith("--config-text: ")


def test_predicted_ttft_parameters_land_in_latency_and_replace_the_flags() -> None:
    text = HEAD + ("plugins:\n- type: predicted-ttft-scorer\n  parameters: {prefillMsPerToken: 0.05, evictionWeight: 3,"
                   " newPrefixPlacement: churn, affinityCredit: 0.25, calibrate: false}\n")
    flags = replace(EppConfig(), latency=replace(EppConfig().latency, new_prefix_placement="homes",
                                                 eviction_weight=1.0))
    cfg, profile = load_text(text, flags)
    lat = cfg.latency
    assert (lat.prefill_ms_per_token, lat.eviction_weight, lat.affinity_credit) == (0.05, 3.0, 0.25)
    assert lat.new_prefix_placement == "churn" and lat.calibrate is False
    assert profile is not None and profile.scorers == (("predicted-ttft-scorer", 1.0),)
    assert overridden(flags, cfg) == [("--eviction-weight", 1.0, 3.0)]  # homes is the default: not reported
    flags = replace(flags, latency=replace(flags.latency, new_prefix_placement="churn"))
    cfg, _ = load_text(text.replace("churn", "homes"), flags)
    assert ("--new-prefix-placement", "churn", "homes") in overridden(flags, cfg)
    with pytest.raises(ConfigError, match="newPrefixPlacement"):
        load_text(text.replace("churn", "nearest"), EppConfig())


def test_serve_reads_config_file_and_refuses_bad_config_at_startup(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(FULL)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--endpoints", "127.0.0.1:1", "--config-file", str(path),
                              "--refresh-metrics-interval", "100ms", "--metrics-staleness-threshold", "3"])
    cfg = serve.config_from_args(args)
    assert cfg.refresh_metrics_interval_s == pytest.approx(0.1) and cfg.metrics_staleness_threshold_s == 3.0
    serve.validate(cfg)
    loaded, profile = load_config(cfg)
    assert loaded.max_endpoints == 2 and profile is not None
    path.write_text(HEAD + "plugins:\n- type: bogus-scorer\n")
    with pytest.raises(SystemExit, match=r"--config-file .*epp.yaml: plugins\[0\]: unknown plugin type 'bogus-scorer'"):
        serve.validate(cfg)
    with pytest.raises(SystemExit, match="not both"):
        serve.validate(replace(cfg, config_text=FULL))


def test_cli_defaults_come_from_eppconfig() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--endpoints", "127.0.0.1:1"])
    d = defaults_of(EppConfig)
    assert args.refresh_metrics_interval == d["refresh_metrics_interval_s"]
    assert args.metrics_staleness_threshold == d["metrics_staleness_threshold_s"]
    assert args.config_file == d["config_file"] and args.config_text == d["config_text"]


def test_engine_label_key_other_than_the_default_is_refused() -> None:
    text = HEAD + "plugins:\n- type: core-metrics-extractor\n  parameters: {engineLabelKey: my.org/engine}\n"
    with pytest.raises(ConfigError, match="engineLabelKey: expected one of"):
        load_text(text, EppConfig())
