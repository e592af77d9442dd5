"""inference-perf as the second load generator: its config, its quirks, a run through a router.

inference-perf runs from its own cached environment (testkit/inference_perf_env.py, Python >=
3.12); where it is not built the tests that run it skip (`python -m testkit.inference_perf_env`
builds it). The config is validated by inference-perf's own loader, not by a copy of its schema.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from bench import inference_perf as cmd
from bench.lib import inference_perf as ip
from testkit.inference_perf_env import built, tokenizer_dir
from testkit.procs import free_ports

needs_env = pytest.mark.skipif(built() is None, reason="inference-perf's environment is not built here")
TINY = ip.Scale(num_groups=3, num_prompts_per_group=2, system_prompt_len=600, question_len=100, output_len=8,
                ladder_qps=(2.0,), stage_s=5)


def test_scaled_shape_keeps_the_published_prefill_with_fewer_groups_and_a_shorter_ladder() -> None:
    s, pub = ip.SCALED, ip.PUBLISHED
    assert (s.system_prompt_len, s.question_len) == (pub["system_prompt_len"], pub["question_len"])
    assert s.num_groups < pub["num_groups"] and s.num_prompts_per_group == pub["num_prompts_per_group"]
    assert min(s.ladder_qps) == pub["ladder_qps_from"] and max(s.ladder_qps) <= 10 < pub["ladder_qps_to"]
    assert s.requests == 285 and s.duration_s == 45


@needs_env
@pytest.mark.timeout(180)
def test_the_shared_tokenizer_lets_inference_perf_build_the_full_scaled_prompts(tmp_path: Path) -> None:
    """Exact-length prompts of 6000 + 1200 tokens, built by inference-perf's own generator."""
    env = built()
    assert env is not None
    config = ip.scaled_config(ip.Scale(num_groups=2, num_prompts_per_group=2), "http://127.0.0.1:1", tokenizer_dir(),
                              tmp_path / "out")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    check = ("from inference_perf.config import read_config; "
             "from inference_perf.utils.custom_tokenizer import CustomTokenizer; "
             "from inference_perf.datagen.synthetic.shared_prefix_datagen import SharedPrefixDataGenerator; "
             f"c = read_config({str(path)!r}); t = CustomTokenizer(c.tokenizer); "
             "SharedPrefixDataGenerator(c.api, c.data, t); print('built')")
    out = subprocess.run([str(env.python), "-c", check], capture_output=True, text=True, timeout=150, check=False,
                         env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.split()[-1] == "built", out.stderr[-2000:]


@needs_env
def test_config_is_accepted_by_inference_perfs_own_loader(tmp_path: Path) -> None:
    env = built()
    assert env is not None
    config = ip.scaled_config(ip.SCALED, "http://127.0.0.1:1", tmp_path / "tok", tmp_path / "out")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    check = (f"from inference_perf.config import read_config; c = read_config({str(path)!r}); "
             "print(c.data.shared_prefix.num_groups, c.load.type.value, len(c.load.stages), "
             "c.report.request_lifecycle.use_server_output_tokens)")
    out = subprocess.run([str(env.python), "-c", check], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-4:] == ["90", "poisson", "3", "True"]


@needs_env
@pytest.mark.timeout(180)
def test_total_failure_exits_zero_and_is_caught(tmp_path: Path) -> None:
    env = built()
    assert env is not None
    [port] = free_ports(1)  # nothing listens there: every request fails
    config = ip.scaled_config(TINY, f"http://127.0.0.1:{port}", tokenizer_dir(), tmp_path / "report")
    with pytest.raises(ip.RunFailed, match="no request succeeded"):  # not "exited": it exits 0
        ip.run(env, config, tmp_path, 120)


@pytest.mark.e2e
@needs_env
@pytest.mark.timeout(240)
@pytest.mark.parametrize("router", ["random", "prefix-epp"])
def test_inference_perf_through_a_router_reads_its_own_report(router: str, tmp_path: Path) -> None:
    row = cmd.run_router(router, tmp_path / router, TINY, 2, tokenizer_dir())
    assert row["successes"] == row["requests"] == 10 and row["failures"] == 0
    assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
    assert 0 < row["cached_share"] < 1  # 3 system prompts over 10 requests: some reuse, never all
    agg = cmd.aggregate([{router: row}])
    assert agg[router]["repetitions"] == 1 and agg[router]["ttft_p90"]["mean"] == row["ttft_ms"]["p90"]
    assert f"| {router} |" in cmd.table(agg, {})
