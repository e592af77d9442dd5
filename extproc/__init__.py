"""prefix-epp: a prefix-cache-aware Endpoint Picker for Envoy ext_proc."""
