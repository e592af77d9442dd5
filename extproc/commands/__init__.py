"""The `prefix-epp` CLI: `main` (the dispatcher), `serve`, `envoy-config`; `sim` runs the simulator
(package `prefix_epp_sim`)."""
