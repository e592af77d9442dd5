"""Benchmarks of prefix-epp: the commands here, their library in `bench.lib`, their reports in results/.

Commands (`python -m bench.<name>`): `run` (the side-by-side benchmark, `make bench`), `demo`
(`make demo`), `overhead`, `components`, `replicas`, `soak` (`make soak`), `replay`,
`sim_throughput`, and `peers.compare` (prefix-epp against the Go picker over repeated runs).
bench/results/ holds the reports a reader opens; bench/results/runs/ each repetition's own.
Support code shared with the tests (processes, Envoy, backends, the Kubernetes API) is `testkit`.
"""
