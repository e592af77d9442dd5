"""The `prefix-epp` CLI: `main` (the dispatcher), `serve`, `envoy-config`, `sidecar` (the prefill/decode
sidecar of a decode pod); `sim` runs the simulator (package `prefix_epp_sim`)."""
