"""inference-perf (kubernetes-sigs, PyPI 0.7.0) as a second load generator: its config, a run, its report.

The published shape every llm-d and Inference Extension number comes from (`PUBLISHED`):
`data.type: shared_prefix`, 150 groups x 5 prompts, a 6000-token system prompt and a
1200-token question, 1000 output tokens, streaming completions, a Poisson ladder from 3 to 60
QPS. `scaled_config` scales it to 2 cores the way `bench.lib.workloads` scales our shared-prefix
(`SCALED`): the same per-request prefill (6000 + 1200 tokens), fewer groups (90, our
shared-prefix's), 64 output tokens, and a shorter ladder (3, 6 and 10 QPS for 15 s each: our
generator's peak rate, ~45 s of load).

Tokens: one tokenizer directory for everyone (`testkit.inference_perf_env.tokenizer_dir`: a
byte-level BPE over printable ASCII without merges, so random token ids decode to text that
encodes back to exactly them; with a real model's merges inference-perf cannot build a prompt of
exactly 1200 or 6000 tokens and aborts). inference-perf counts with that directory (no hub
access), the replicas count with its tokenizer.json (`prefix-epp sim --tokenizer`), and so do the
prefix-epp pickers (`--tokenizer`), so a 6000-token prompt is 6000 tokens everywhere.

Its quirks, handled here:
- it exits 0 when every request fails: `read_report` takes the success and failure counts from
  its report and `RunFailed` is raised when nothing succeeded;
- its arrival times are not seeded (its load timer draws from an unseeded generator;
  `load.base_seed` only seeds prompt choice), so repetitions differ in arrivals: repeat runs;
- client and server token counts differ unless `report.request_lifecycle.use_server_output_tokens`
  is on (it is);
- bursts of streamed chunks give zero inter-token latencies, so TPOT and TTFT are the figures
  to compare, ITL is reported for completeness.

`read_report` maps `summary_lifecycle_metrics.json` to one flat row: TTFT p50/p90/p99, ITL
p50/p99, TPOT p50/p99 (ms), throughput (requests/s, output tokens/s), the cached share of prompt
tokens from the servers' usage (`prompt_tokens.cached / total`), successes and failures.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from testkit.inference_perf_env import InferencePerfEnv

PUBLISHED: dict[str, Any] = {"num_groups": 150, "num_prompts_per_group": 5, "system_prompt_len": 6000,
                             "question_len": 1200, "output_len": 1000, "ladder_qps_from": 3, "ladder_qps_to": 60}


@dataclass(frozen=True)
class Scale:
    """The shared-prefix shape as run here (module docstring)."""

    num_groups: int = 90
    num_prompts_per_group: int = 5
    system_prompt_len: int = 6000
    question_len: int = 1200
    output_len: int = 64
    ladder_qps: tuple[float, ...] = (3.0, 6.0, 10.0)
    stage_s: int = 15
    seed: int = 0

    @property
    def requests(self) -> float:
        return sum(q * self.stage_s for q in self.ladder_qps)

    @property
    def duration_s(self) -> float:
        return float(len(self.ladder_qps) * self.stage_s)


SCALED = Scale()
QUICK = Scale(num_groups=30, ladder_qps=(3.0, 6.0), stage_s=10)
TIMEOUT_MARGIN_S = 120.0  # past the planned load: start-up, the tokenizer, the drain, the report


class RunFailed(RuntimeError):
    """inference-perf ran but no request succeeded (it still exits 0), or it wrote no report."""


def scaled_config(scale: Scale, base_url: str, tokenizer_dir: Path, out_dir: Path,
                  model: str = "sim-model") -> dict[str, Any]:
    """The inference-perf config for one run against `base_url`, its report under `out_dir`."""
    return {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": scale.num_groups, "num_prompts_per_group": scale.num_prompts_per_group,
            "system_prompt_len": scale.system_prompt_len, "question_len": scale.question_len,
            "output_len": scale.output_len, "seed": scale.seed}},
        "load": {"type": "poisson", "stages": [{"rate": q, "duration": scale.stage_s} for q in scale.ladder_qps],
                 "num_workers": 1, "base_seed": scale.seed},
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False,
                                         "use_server_output_tokens": True}},
        "storage": {"local_storage": {"path": str(out_dir)}},
    }


def _ms(block: dict[str, Any] | None, key: str) -> float:
    value = (block or {}).get(key)
    return float(value) * 1000.0 if isinstance(value, (int, float)) else float("nan")


def read_report(report_dir: Path) -> dict[str, Any]:
    """One flat row from inference-perf's summary report (module docstring); RunFailed on none."""
    path = report_dir / "summary_lifecycle_metrics.json"
    if not path.is_file():
        raise RunFailed(f"inference-perf wrote no {path.name} under {report_dir}")
    doc = json.loads(path.read_text())
    ok, failed = doc.get("successes") or {}, doc.get("failures") or {}
    successes, failures = int(ok.get("count") or 0), int(failed.get("count") or 0)
    if successes == 0:
        raise RunFailed(f"inference-perf: no request succeeded ({failures} failed); see {report_dir}")
    lat, thr, prompt = ok.get("latency") or {}, ok.get("throughput") or {}, ok.get("prompt_tokens") or {}
    ttft, itl, tpot = lat.get("time_to_first_token"), lat.get("inter_token_latency"), lat.get("time_per_output_token")
    total, cached = float(prompt.get("total") or 0.0), float(prompt.get("cached") or 0.0)
    wall = float(doc.get("benchmark_time_seconds") or 0.0)
    return {
        "requests": successes + failures, "successes": successes, "failures": failures,
        "ttft_ms": {"p50": _ms(ttft, "median"), "p90": _ms(ttft, "p90"), "p99": _ms(ttft, "p99")},
        "itl_ms": {"p50": _ms(itl, "median"), "p99": _ms(itl, "p99")},
        "tpot_ms": {"p50": _ms(tpot, "median"), "p99": _ms(tpot, "p99")},
        "requests_per_s": successes / wall if wall > 0 else float("nan"),
        "output_tokens_per_s": float(thr.get("output_tokens_per_sec") or float("nan")),
        "cached_share": cached / total if total else float("nan"),
        "wall_s": wall,
    }


def run(env: InferencePerfEnv, config: dict[str, Any], work: Path, timeout_s: float) -> dict[str, Any]:
    """Write `config`, run inference-perf on it (offline), and read its report (`read_report`)."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / "inference-perf.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = work / "inference-perf.log"
    with open(log, "wb") as out:
        proc = subprocess.run([str(env.command), "--config_file", str(path)], stdout=out, stderr=subprocess.STDOUT,
                              cwd=work, timeout=timeout_s, check=False,
                              env={"PATH": "/usr/bin:/bin", "HOME": str(work), "HF_HUB_OFFLINE": "1",
                                   "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(work / "hf")})
    if proc.returncode != 0:
        raise RunFailed(f"inference-perf exited {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
    return read_report(Path(config["storage"]["local_storage"]["path"]))
