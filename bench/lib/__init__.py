"""The benchmarks' library: what the commands of bench/ are built from. A module per concept:

| module | what it holds |
|---|---|
| `workloads` | the seeded workload generator (shared prefix, multi-turn, hot prefix, cache pressure, ...) |
| `client` | the open-loop client: a workload replayed against a router, per-request results |
| `oracle` | the infinite-cache hit-rate bound of a workload, and the block size everything uses |
| `stats` | the arithmetic: percentiles, hit rate, histogram quantiles, replica load, summary rows |
| `targets` | the benchmark's goals, met or missed on the summary rows |
| `aggregate` | repetitions folded into mean and min-max per (workload, router) |
| `tables` | the Markdown tables of a run |
| `plots` | the PNG figures of a run |
| `report` | the results files of a run and where they go (`bench/results/`, `runs/`, `raw/`) |
| `routers` | the simulated replicas and every router setup the benchmark compares |
| `go_epp` | the Go endpoint picker's setup: a real kube-apiserver holding its pool, Envoy's wiring |
| `runner` | one run: fresh replicas, one router, one workload through it, summarised |
| `loadgen` | closed- and open-loop load against one URL (the overhead benchmark) |
| `fault_traffic` | paced closed-loop clients for the fault benchmark; every answer checked whole |
| `fault_scenarios` | one fault (replica killed, frozen, answering 500; picker killed, SIGTERM) under that traffic |
| `fault_summary` | what a fault did to the traffic: failures by kind, in flight at it, recovery time |
"""
