"""Where a router's cache misses come from: replay a benchmark's requests through the engines' caches.

    python -m bench.replay bench-seeds            # after `python -m bench.run ... --name bench-seeds`

For every single-turn workload, router and repetition of a results file ({name}.json and its
per-request records under raw/, which bench.run writes), rebuild the workload as it was drawn
(its seed, or seed + k - 1 with --vary-seed) and replay the requests in time order through one
`prefix_epp_sim.kvcache.KVCache` per replica (the simulator's own cache: vLLM's prefix-cache and LRU
rules, the run's size): a request takes its blocks (prompt + max_tokens) when it was sent and
frees them when its response ended, on the replica that served it. Chat workloads are skipped:
their prompts hold the answers, which the records do not keep.

Checks and reports, per (workload, router), summed over the repetitions:
- agreement: requests whose replayed cached tokens are within one block of what the engine
  reported (the replay is only evidence where this is near 100%);
- each request, by what the caches held when it was sent (prefix = its leading blocks):
  `hit` (some replica held part of its prefix, and it was served where the most was held),
  `cold` (its group's first request: no replica held any of it), `evicted` (a later request of
  its group, and no replica held any of its prefix any more), `sent away` (another replica held
  more of its prefix than the one that served it: the router chose load over cache), with the
  prompt tokens lost to `sent away`;
- sticky: the replayed hit rate had every group stayed on the replica of its first request, same
  timing (what the router's moves gained or lost).

Writes bench/results/{name}-replay.json and {name}-replay.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.oracle import BLOCK_SIZE, prompt_tokens
from bench.lib.report import raw_path
from bench.lib.workloads import MODEL, Workload, body, build
from prefix_epp_sim.kvcache import Allocation, KVCache, block_hash_seed, hash_blocks

KINDS = ("hit", "cold", "evicted", "sent away")


@dataclass(frozen=True, slots=True)
class Sent:
    """One request as the run saw it, with its prompt's block hashes."""

    session: int
    group: str
    start: float
    end: float
    replica: str
    prompt_tokens: int
    max_tokens: int
    hashes: tuple[int, ...]
    cached: int  # what the engine reported


def records(workload: Workload, raw: Iterable[dict[str, Any]]) -> list[Sent]:
    sessions = {s.id: s for s in workload.sessions}
    seed = block_hash_seed(MODEL)
    out = []
    for r in raw:
        if r["status"] != 200 or r["error"] or not r["served_by"]:
            continue
        s = sessions[r["session"]]
        tokens = prompt_tokens(*body(s, 0, []))
        out.append(Sent(s.id, s.label, r["sent_s"], r["sent_s"] + r["e2e_s"], r["served_by"][-1], len(tokens),
                        s.max_tokens, tuple(hash_blocks(tokens, BLOCK_SIZE, seed)), r["cached_tokens"]))
    return sorted(out, key=lambda x: x.start)


def replay(sent: Sequence[Sent], blocks: int, placement: dict[int, str] | None = None) -> dict[str, Any]:
    """Replay `sent` (on `placement`[session] if given); cached tokens and a kind per request."""
    where = placement or {x.session: x.replica for x in sent}
    caches = {r: KVCache(blocks, BLOCK_SIZE) for r in sorted(set(where.values()))}
    events = sorted([(x.start, 1, i) for i, x in enumerate(sent)] + [(x.end, 0, i) for i, x in enumerate(sent)])
    allocs: dict[int, Allocation] = {}
    unique = itertools.count(1 << 62)  # output blocks: never shared
    seen: set[str] = set()
    cached: dict[int, int] = {}
    kinds: Counter[str] = Counter()
    lost = 0
    for _, starts, i in events:
        x = sent[i]
        cache = caches[where[x.session]]
        if not starts:
            alloc = allocs.pop(i, None)
            if alloc is not None:
                cache.free(alloc)
            continue
        held = {r: c.match_prefix(x.hashes) for r, c in caches.items()}
        best, mine = max(held.values()), held[where[x.session]]
        kind = ("cold" if x.group not in seen else "evicted") if best == 0 else "hit" if mine == best else "sent away"
        seen.add(x.group)
        kinds[kind] += 1
        if kind == "sent away":
            lost += (best - mine) * BLOCK_SIZE
        alloc = cache.allocate(list(x.hashes), x.prompt_tokens, x.prompt_tokens + x.max_tokens)
        cached[x.session] = alloc.cached_tokens if alloc is not None else 0
        if alloc is None:  # the engine had made it wait for room; it rarely matters for the totals
            kinds["no room"] += 1
            continue
        extra = [next(unique) for _ in range(len(alloc.blocks) - len(x.hashes))]
        cache.commit(alloc, list(x.hashes) + extra, [0] * ((len(x.hashes) + len(extra)) * BLOCK_SIZE))
        allocs[i] = alloc
    return {"cached": cached, "kinds": kinds, "lost_tokens": lost}


def analyse(sent: Sequence[Sent], blocks: int) -> dict[str, Any]:
    as_run = replay(sent, blocks)
    first: dict[str, str] = {}
    for x in sent:
        first.setdefault(x.group, x.replica)
    sticky = replay(sent, blocks, {x.session: first[x.group] for x in sent})
    prompt = sum(x.prompt_tokens for x in sent)
    return {
        "requests": len(sent), "prompt_tokens": prompt,
        "hit_rate": sum(x.cached for x in sent) / prompt,
        "replayed_hit_rate": sum(as_run["cached"].values()) / prompt,
        "agree": sum(1 for x in sent if abs(as_run["cached"][x.session] - x.cached) < BLOCK_SIZE),
        "kinds": dict(as_run["kinds"]), "sent_away_tokens": as_run["lost_tokens"],
        "sticky_hit_rate": sum(sticky["cached"].values()) / prompt,
    }


def run(out_dir: Path, name: str) -> dict[str, Any]:
    doc = json.loads((out_dir / f"{name}.json").read_text())
    cfg = doc["config"]
    seed, vary = cfg.get("seed", 0), cfg.get("vary_seed", False)
    result: dict[str, Any] = {}
    for k, (raw_name, rep) in enumerate(zip(cfg["raw_names"], doc["repetitions"], strict=True)):
        for wname, rows in rep.items():
            workload = build(wname, quick=cfg["quick"], seed=seed + k if vary else seed, load=cfg["load"])
            if any(s.api != "completion" or s.turns != 1 for s in workload.sessions):
                continue
            blocks = cfg["workloads"][wname]["kv_cache_blocks_per_replica"]
            for router in rows:
                path = raw_path(out_dir, raw_name, wname, router)
                if not path.exists():
                    raise SystemExit(f"{path} is missing: rerun the benchmark that wrote {name}.json")
                one = analyse(records(workload, json.loads(path.read_text())), blocks)
                result.setdefault(wname, {}).setdefault(router, []).append(one)
    return result


def render(name: str, result: dict[str, Any]) -> str:
    lines = [f"# Cache misses replayed (`python -m bench.replay {name}`)", "",
             "Per router, summed over the repetitions; hit rates are means, with min-max.", "",
             "| workload | router | hit rate | replayed | agree | hit | cold | evicted | sent away (tokens) "
             "| sticky replay |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def rate(runs: list[dict[str, Any]], key: str) -> str:
        v = [r[key] * 100 for r in runs]
        return f"{sum(v) / len(v):.1f}% ({min(v):.1f}-{max(v):.1f})"

    for wname, routers in result.items():
        for router, runs in routers.items():
            kinds: Counter[str] = Counter()
            for r in runs:
                kinds.update(r["kinds"])
            n = sum(r["requests"] for r in runs)
            agree = sum(r["agree"] for r in runs) / n
            away = sum(r["sent_away_tokens"] for r in runs)
            lines.append(f"| {wname} | {router} | {rate(runs, 'hit_rate')} | {rate(runs, 'replayed_hit_rate')} "
                         f"| {agree:.1%} | {kinds['hit']} | {kinds['cold']} | {kinds['evicted']} "
                         f"| {kinds['sent away']} ({away:,}) | {rate(runs, 'sticky_hit_rate')} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="results file stem, e.g. bench-seeds")
    ap.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    result = run(args.out_dir, args.name)
    (args.out_dir / f"{args.name}-replay.json").write_text(json.dumps(result, indent=1) + "\n")
    md = render(args.name, result)
    (args.out_dir / f"{args.name}-replay.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
