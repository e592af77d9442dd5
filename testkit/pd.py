"""Prefill/decode disaggregation for tests: an EndpointPickerConfig in llm-d's form.

`LLMD_PD` has the shape of llm-d's P/D example configurations (deploy/config/*pd-epp-config.yaml
there), written here: the handler declared before the decider it names, one prefix producer, the
same scorers and picker referenced by both profiles, `nonCachedTokens` 48.
"""

from __future__ import annotations

LLMD_PD = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters:
    blockSizeTokens: 16
    autoTune: false
    maxPrefixTokensToMatch: 4096
    lruCapacityPerServer: 20000
- type: prefix-cache-scorer
- type: queue-scorer
- type: prefill-filter
- type: decode-filter
- type: max-score-picker
- type: disagg-profile-handler
  parameters:
    deciders:
      prefill: prefix-based-pd-decider
- type: prefix-based-pd-decider
  parameters:
    nonCachedTokens: 48
schedulingProfiles:
- name: prefill
  plugins:
  - pluginRef: prefill-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
- name: decode
  plugins:
  - pluginRef: decode-filter
  - pluginRef: max-score-picker
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
"""
