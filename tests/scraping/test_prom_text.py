"""The narrow Prometheus line reader and the vLLM extraction, against real exposition text."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.prefix.capacity import auto_tuned_capacity
from extproc.scraping.prom_text import samples
from extproc.scraping.scraper import FAMILIES, ScrapeError, parse_vllm_metrics
from testkit.vllm_text import exposition, noise, restrict

WANTED = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info", "vllm:lora_requests_info")


def test_agrees_with_prometheus_client_on_every_wanted_sample() -> None:
    text = exposition(3, 2, 0.25, engines=2, loras=[("a,b", "c", 4, 100.0), ("x", "", 8, 200.0)])
    assert len(text) > 100_000  # histogram noise like a real vLLM page
    reference: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name in WANTED:
                reference.setdefault(s.name, []).append((dict(s.labels), s.value))
    assert set(reference) == set(WANTED)
    for name in WANTED:
        assert samples(text, name.encode()) == reference[name], name


def test_decoy_names_comments_and_histograms_are_not_read() -> None:
    text = exposition(1, 0, 0.0)
    assert b"vllm:num_requests_waiting_decoy" in text and b"# HELP vllm:num_requests_waiting " in text
    assert samples(text, b"vllm:num_requests_waiting") == [({"model_name": "m", "engine": "0"}, 1.0)]
    assert samples(text, b"vllm:time_to_first_token_seconds") == []  # only _bucket/_sum/_count lines exist


def test_label_escapes_special_values_timestamps_and_malformed_lines() -> None:
    text = (b'first{a="x"} 1\n'
            b'm{path="C:\\\\dir",q="say \\"hi\\", ok",nl="a\\nb",} 2.5 1700000000000\n'
            b'm{ spaced = "v" } NaN\n'
            b'm +Inf\n'
            b'm{broken="unterminated} 3\n'
            b'm{a="1"} notanumber\n'
            b'm -1.5e3')
    got = samples(text, b"m")
    assert got[0] == ({"path": "C:\\dir", "q": 'say "hi", ok', "nl": "a\nb"}, 2.5)
    assert got[1][0] == {"spaced": "v"} and got[1][1] != got[1][1]  # NaN
    assert got[2:] == [({}, float("inf")), ({}, -1500.0)]
    assert samples(text, b"first") == [({"a": "x"}, 1.0)]


def test_vllm_extraction_sums_engines_and_takes_the_newest_lora_series() -> None:
    m = parse_vllm_metrics(exposition(3, 2, 0.4, engines=2, num_gpu_blocks=2048,
                                      loras=[("new1,new2", "w", 4, 300.0), ("old", "", 2, 100.0)]), now=12.5)
    assert (m.waiting, m.running, m.kv_usage) == (6.0, 4.0, 0.4)
    assert (m.block_size, m.num_gpu_blocks) == (16, 2048)
    assert m.running_loras == {"new1", "new2"} and m.waiting_loras == {"w"} and m.max_lora == 4
    assert m.model_names == {"m"}
    assert m.ok and m.updated_at == 12.5
    # The latency model's counters: TTFT histogram (3 engines x 20 observations) and prompt tokens.
    assert m.ttft_count == 60.0 and 0 < m.ttft_sum_s < 60.0 and m.prompt_tokens == 12345.0
    bare = parse_vllm_metrics(exposition(1, 1, with_noise=False), now=1.0)
    assert bare.ttft_count == -1.0 and bare.prompt_tokens == -1.0  # not exported: no calibration


def test_v0_kv_name_is_a_fallback_and_no_load_metric_is_an_error() -> None:
    m = parse_vllm_metrics(b"vllm:gpu_cache_usage_perc 0.7\n", 0.0)
    assert m.kv_usage == 0.7 and m.num_gpu_blocks == 0
    with pytest.raises(ScrapeError):
        parse_vllm_metrics(b'{"served_by": "echo"}', 0.0)
    with pytest.raises(ScrapeError):
        parse_vllm_metrics(noise(), 0.0)  # histograms and a decoy, but no load gauge


def test_process_start_time_is_read_and_unknown_without_it() -> None:
    body = exposition(1, 1, with_noise=False) + b"process_start_time_seconds 1.79615401851e+09\n"
    assert parse_vllm_metrics(body, 0.0).started_at == 1796154018.51
    assert parse_vllm_metrics(exposition(1, 1, with_noise=False), 0.0).started_at == -1.0


def test_auto_tune_formula() -> None:
    m = parse_vllm_metrics(exposition(0, 0, 0.0, block_size=16, num_gpu_blocks=1000, with_noise=False), 0.0)
    assert auto_tuned_capacity(m, block_size_bytes=64, bytes_per_token=4) == 1000  # 1000*16*4/64
    assert auto_tuned_capacity(m, block_size_bytes=128, bytes_per_token=4) == 500
    m.num_gpu_blocks = 0
    assert auto_tuned_capacity(m, 64, 4) is None


def test_waiting_by_reason_is_read_where_exported_and_unknown_elsewhere() -> None:
    text = (b'vllm:num_requests_waiting{model_name="m"} 5\n'
            b'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 3\n'
            b'vllm:num_requests_waiting_by_reason{model_name="m",reason="deferred"} 2\n')
    m = parse_vllm_metrics(text, 0.0)
    assert (m.waiting, m.waiting_capacity) == (5, 3)
    assert parse_vllm_metrics(b'vllm:num_requests_waiting{model_name="m"} 5\n', 0.0).waiting_capacity == -1


def test_the_filtered_page_carries_every_family_parsed() -> None:
    """A filtered scrape (`?name[]=` for each of FAMILIES) reads what the whole page gives: a family
    parsed but missing from FAMILIES would be silently unknown on every real vLLM."""
    page = exposition(4, 3, 0.5, engines=2, loras=[("a", "", 4, 100.0)]) + (
        b'vllm:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 2\n'
        b'process_start_time_seconds 1.7e9\n')
    whole = parse_vllm_metrics(page, 0.0)
    filtered = parse_vllm_metrics(restrict(page, frozenset(f.decode() for f in FAMILIES)), 0.0)
    assert whole.waiting_capacity == 2
    assert filtered == whole
