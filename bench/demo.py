"""`make demo`: prefix-epp against random load balancing on a short shared-prefix workload.

For each of `random` (Envoy, lb_policy RANDOM) and `prefix-epp` (Envoy + the picker): start 4
fresh simulated vLLM replicas (real time, KV cache sized so the prompts' shared prefixes fit the
pool but not one replica), start the router, send the same 120 streaming requests (24 groups x
5 prompts sharing a 6000-token system prompt, 10 requests/s, Poisson), stop everything. Then
print hit rate (with the infinite-cache oracle), TTFT p50/p99 and requests per replica.
One line per phase shows progress; about a minute in all. Ctrl-C stops every process it started
(each runs in its own process group and is killed on the way out).

    python -m bench.demo [--replicas 4] [--groups 24] [--rate 10]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.lib.oracle import workload_oracle
from bench.lib.runner import RouterSpec, run_one, sim_settings
from bench.lib.tables import fmt
from bench.lib.workloads import SharedPrefixParams, Workload, shared_prefix

ROUTERS = ("random", "prefix-epp")
DEMO_WORKLOAD = SharedPrefixParams(groups=24, rate=10.0)


@dataclass
class DemoResult:
    workload: Workload
    oracle_hit_rate: float
    rows: dict[str, dict[str, Any]]  # router -> bench.lib.stats.summarize row

    def table(self) -> str:
        lines = ["| router | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | requests per replica | errors |",
                 "|---|---:|---:|---:|---|---:|",
                 f"| oracle (infinite cache) | {self.oracle_hit_rate:.1%} | | | | |"]
        for router, r in self.rows.items():
            per_replica = " ".join(str(n) for n in r["requests_per_replica"].values())
            lines.append(f"| {router} | {r['hit_rate']:.1%} | {fmt(r['ttft_ms']['p50'])} | {fmt(r['ttft_ms']['p99'])} "
                         f"| {per_replica} | {r['errors']} |")
        return "\n".join(lines)


def demo(params: SharedPrefixParams = DEMO_WORKLOAD, *, replicas: int = 4,
         routers: Sequence[str] = ROUTERS, log: Callable[[str], None] = print) -> DemoResult:
    workload = shared_prefix(params)
    oracle = workload_oracle(workload)
    sim = sim_settings(oracle, replicas, 1.0)
    log(f"workload: {workload.requests} requests, {params.groups} groups x {params.per_group} sharing a "
        f"{params.system_tokens}-token system prompt; oracle hit rate {oracle.hit_rate:.1%}")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="prefix-epp-demo-") as tmp:
        for name in routers:
            rows[name] = run_one(Path(tmp) / name, workload, RouterSpec(name), sim, log).summary
    return DemoResult(workload, oracle.hit_rate, rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--groups", type=int, default=DEMO_WORKLOAD.groups, help="system prompts; 5 requests each")
    p.add_argument("--rate", type=float, default=DEMO_WORKLOAD.rate, help="requests per second")
    args = p.parse_args(argv)
    began = time.monotonic()
    try:
        result = demo(replace(DEMO_WORKLOAD, groups=args.groups, rate=args.rate), replicas=args.replicas,
                      log=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print("interrupted; every process the demo started has been stopped", file=sys.stderr)
        return 130
    print()
    print(result.table())
    print(f"\n{time.monotonic() - began:.0f} s. Full side-by-side benchmark (8 routers x 7 workloads x 3): make bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
