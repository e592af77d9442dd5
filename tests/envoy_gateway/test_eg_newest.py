"""The chart beside a real Envoy Gateway (EG_VERSION of versions.env, v1.9.1): EG's own translation
of the chart, and real OpenAI requests through the Envoy it configured.

One rig for the module (testkit/envoy_gateway.py: ~30 s to come up): two picker replicas with fallbacks and
decision explanations (`picker.maxEndpoints: 2`, `picker.explainDecisions: true`), verified TLS
to the picker (the chart's generated CA and BackendTLSPolicy), three simulated vLLM pods. Tests
that stop something restore it; the ones that stop pickers run last.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.eg_client import client, metric, scrape, settled, total
from testkit.envoy_gateway import EnvoyGatewayRig, Pod, running_rig
from testkit.k8s_objects import IMAGE
from testkit.versions import Versions

pytestmark = [pytest.mark.envoy_gateway, pytest.mark.timeout(900)]

VERSION = Versions.load().eg
VALUES: dict[str, Any] = {
    **IMAGE,
    "replicas": 2,
    "picker": {"explainDecisions": True, "maxEndpoints": 2},
    "envoyGateway": {"enabled": True, "version": VERSION, "envoyProxy": {"serviceType": "ClusterIP",
                                                                           "gracefulExtProcClose": True}},
}
# 2 ms per token, so a 6,000-token answer streams for 12 s; prompts of several MiB fit.
SIM = ("--inter-token-latency", "2", "--max-model-len", "4000000", "--kv-cache-blocks", "300000",
       "--prefill-time-per-token", "0.0005")
GRACEFUL = "envoy.reloadable_features.ext_proc_graceful_grpc_close"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyGatewayRig]:
    with running_rig(tmp_path_factory.mktemp("eg"), VERSION, VALUES, sim_args=SIM) as r:
        yield r


def served_by(raw: Any) -> str:
    return str(raw.headers["x-served-by"])


def decision(raw: Any) -> str:
    return str(raw.headers["x-prefix-epp-decision"])


def predicted_ttft(raw: Any) -> dict[str, float]:
    """{endpoint: predicted ms} from the decision header's predicted_ttft_ms=ip:port:ms,..."""
    field = next(f.strip() for f in decision(raw).split(";") if f.strip().startswith("predicted_ttft_ms="))
    pairs = (item.rsplit(":", 1) for item in field.removeprefix("predicted_ttft_ms=").split(","))
    return {ep: float(ms) for ep, ms in pairs}


def first_choice(raw: Any) -> str:
    return decision(raw).split(";")[0].removeprefix("endpoint=")


def test_envoy_gateway_accepted_every_object_of_the_chart(rig: EnvoyGatewayRig) -> None:
    c = rig.cluster
    assert c is not None
    name = c.fullname
    assert c.conditions("Gateway", f"{name}-gateway").get("Accepted") == "True"
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy", "ClientTrafficPolicy"):
        assert c.conditions(kind, name).get("Accepted") == "True", (kind, c.conditions(kind, name))
    assert c.conditions("BackendTLSPolicy", name).get("Accepted") == "True"


def test_graceful_close_flag_is_in_the_bootstrap_envoy_gateway_generated(rig: EnvoyGatewayRig) -> None:
    layers = rig.bootstrap["layered_runtime"]["layers"]
    assert layers[0]["static_layer"][GRACEFUL] is True
    # And the running Envoy has it (runtime as Envoy reports it).
    runtime = json.loads(rig.envoy_admin("/runtime"))
    assert runtime["entries"][GRACEFUL]["final_value"] == "true"


def records_applied(rig: EnvoyGatewayRig) -> float:
    """Peers' index records applied, summed over the picker replicas."""
    return sum(total(scrape(rig, p), "prefix_epp_sync_records_applied_total") for p in rig.picker_pods)


def applied_reaches(rig: EnvoyGatewayRig, n: float) -> float:
    """Wait until the pickers applied `n` peers' records in all; how many they have then."""
    wait_for(lambda: records_applied(rig) >= n)
    return records_applied(rig)


def wait_for(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_shared_prefix_lands_on_one_pod_with_the_decision_header(rig: EnvoyGatewayRig) -> None:
    # The two pickers share records every 20 ms (sync's flush interval): a request may reach the
    # other picker sooner than that after the one before it. Each request's record is waited
    # for at the other picker, so the test asks what the pool knows, not how the race falls.
    wait_for(lambda: all(total(scrape(rig, p), "prefix_epp_sync_peers_connected") >= 1 for p in rig.picker_pods))
    oa = client(rig)
    served, decisions = set(), []
    applied = records_applied(rig)
    for i in range(6):
        prompt = "You are a careful assistant. " * 120 + f"Question {i}: what is {i} + {i}?"
        raw = oa.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=4)
        assert raw.http_response.status_code == 200
        served.add(served_by(raw))
        decisions.append(decision(raw))
        assert decision(raw).startswith("endpoint=")
        if i > 0:
            assert "affinity" in decision(raw) or "matched" in decision(raw), decision(raw)
        applied = applied_reaches(rig, applied + 1)
    assert len(served) == 1, (served, decisions)
    assert served <= {f"{p.ip}:8000" for p in rig.model_pods}


def test_streamed_chat_arrives_intact_with_usage(rig: EnvoyGatewayRig) -> None:
    oa = client(rig)
    stream = oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count to forty"}],
                                        max_tokens=40, stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 40 and usage.prompt_tokens > 0
    assert len([p for p in pieces if p]) == 40


@pytest.mark.parametrize("size", [40 * 1024, 3 * 1024 * 1024], ids=["40KiB", "3MiB"])
def test_large_prompts_pass_envoy_gateways_buffer_limits(rig: EnvoyGatewayRig, size: int) -> None:
    words = "lorem ipsum dolor sit amet "
    prompt = (words * (size // len(words) + 1))[:size]
    raw = client(rig, timeout=120).completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2)
    assert raw.http_response.status_code == 200
    body = raw.parse()
    assert body.usage is not None and body.usage.prompt_tokens > size // 8, body.usage


def test_generation_longer_than_ten_seconds_ends_intact(rig: EnvoyGatewayRig) -> None:
    """EG gives the ext_proc service a 10 s gRPC timeout; the picker's stream lasts the whole answer
    (it asked for the response trailers) and must outlive it, ending closed, not reset."""
    before = settled(rig)
    oa = client(rig, timeout=120)
    t0 = time.monotonic()
    stream = oa.completions.create(model="tiny", prompt="tell a long story", max_tokens=6000, stream=True,
                                   stream_options={"include_usage": True})
    n, usage, open_late = 0, None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            n += 1
        if chunk.usage is not None:
            usage = chunk.usage
        if open_late is None and time.monotonic() - t0 > 10.5:
            open_late = sum(total(scrape(rig, p), "prefix_epp_open_streams") for p in rig.picker_pods)
    assert time.monotonic() - t0 > 10.5  # the answer really outlived the 10 s timeout
    assert n == 6000 and usage is not None and usage.completion_tokens == 6000
    assert open_late == 1.0  # the ext_proc stream was still open after 10 s
    after = settled(rig)
    name = "prefix_epp_extproc_streams_total"
    ends = {(end, by): sum(metric(a, name, end=end, closed_by=by) - metric(b, name, end=end, closed_by=by)
                           for a, b in zip(after, before, strict=True))
            for end in ("complete", "reset") for by in ("picker", "proxy")}
    assert ends == {("complete", "picker"): 1.0, ("complete", "proxy"): 0.0, ("reset", "picker"): 0.0,
                    ("reset", "proxy"): 0.0}, ends


def test_streams_spread_over_both_pickers_and_none_is_reset(rig: EnvoyGatewayRig) -> None:
    before = settled(rig)
    oa = client(rig)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: oa.completions.with_raw_response.create(
            model="tiny", prompt=f"request {i}", max_tokens=1).http_response.status_code, range(400)))
    assert codes == [200] * 400
    after = settled(rig)
    name = "prefix_epp_extproc_streams_total"
    closed = [metric(a, name, end="complete", closed_by="picker") - metric(b, name, end="complete", closed_by="picker")
              for a, b in zip(after, before, strict=True)]
    reset = [metric(a, name, closed_by="proxy", end="complete") - metric(b, name, closed_by="proxy", end="complete")
             for a, b in zip(after, before, strict=True)]
    assert sum(closed) == 400 and reset == [0.0, 0.0], (closed, reset)
    assert min(closed) >= 40, f"streams per picker: {closed}"


def rss_kib(pod: Pod) -> int:
    assert pod.proc is not None
    for line in Path(f"/proc/{pod.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_picker_memory_stays_flat_over_thousands_of_requests(rig: EnvoyGatewayRig) -> None:
    oa = client(rig)

    def burst(n: int, tag: str) -> list[int]:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda i: oa.completions.with_raw_response.create(
                model="tiny", prompt=f"{tag} {i % 50}", max_tokens=1).http_response.status_code, range(n)))

    assert burst(1000, "warm") == [200] * 1000
    start = [rss_kib(p) for p in rig.picker_pods]
    resets0 = sum(metric(scrape(rig, p), "prefix_epp_extproc_streams_total", end="complete", closed_by="proxy")
                  for p in rig.picker_pods)
    assert burst(3000, "warm") == [200] * 3000
    end = [rss_kib(p) for p in rig.picker_pods]
    resets = sum(metric(scrape(rig, p), "prefix_epp_extproc_streams_total", end="complete", closed_by="proxy")
                 for p in rig.picker_pods)
    assert resets == resets0 == 0
    # ~1,500 streams per picker: the leak the flag fixes (~160 B/stream) would be small, so the bound
    # is a growth far below what any per-stream retention of the stream's messages would add.
    assert all(e - s < 8 * 1024 for s, e in zip(start, end, strict=True)), (start, end)


def test_dead_first_choice_is_retried_on_the_fallback_and_the_served_endpoint_learned(
        rig: EnvoyGatewayRig) -> None:
    """The engine that holds a prefix dies: Envoy's retry walks the picker's fallback list (or the
    picker already left the pod out), x-gateway-destination-endpoint-served reports the endpoint
    that answered, and the picker's prefix record is there, so the next request goes straight to it."""
    for extra in rig.picker_pods[1:]:  # one replica: the one that sees the served endpoint decides next
        rig.stop_picker(extra, signal.SIGKILL)
    oa = client(rig)
    # Long enough that its prefill, which the cache hit saves, dwarfs a request's fixed cost in the
    # prediction: bytes per token is measured from the first answer, and at ~430 tokens the two
    # were close and the ratio below sat at ~3.
    prompt = "a conversation with history: " + "the same long prefix " * 720

    def ask() -> Any:
        raw = oa.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=1)
        assert raw.http_response.status_code == 200
        return raw

    for _ in range(3):  # the prefix is recorded on one pod
        holder = served_by(ask())
    pod = next(p for p in rig.model_pods if f"{p.ip}:8000" == holder)
    rig.kill_model(pod)
    try:
        retried = ask()
        # Either the picker still trusted the dead pod (its scrape had not failed yet) and Envoy's
        # retry walked to the fallback, or the failed scrape had already taken the pod out of
        # rotation (extproc/control/health.py): no request fails either way.
        assert served_by(retried) != holder
        assert retried.headers["x-gateway-destination-endpoint-served"] == served_by(retried)
        # The picker moved that request's prefix record to the endpoint that served it: its predicted
        # time to first token for the prefix drops from an uncached prefill to a cache hit.
        after, live = ask(), served_by(retried)
        assert predicted_ttft(after)[live] < predicted_ttft(retried)[live] / 3, (decision(retried), decision(after))
        assert served_by(after) != holder
    finally:
        rig.start_model(pod)
        rig.start_pickers()


def test_typo_in_values_fails_at_helm_install_naming_it(rig: EnvoyGatewayRig) -> None:
    assert rig.cluster is not None
    proc = rig.cluster.helm_install({"picker": {"maxEndpoint": 2}}, release="typo")
    assert proc.returncode != 0
    assert "maxEndpoint" in proc.stderr, proc.stderr


def test_replica_stopped_mid_traffic_loses_no_request(rig: EnvoyGatewayRig) -> None:
    """SIGTERM after the chart's preStop sleep, as the kubelet does; the EndpointSlice drops the pod
    first (the endpoints controller), then the picker drains its open streams."""
    oa = client(rig)
    stop = rig.picker_pods[1]
    results: list[int] = []

    def one(i: int) -> int:
        return int(oa.completions.with_raw_response.create(
            model="tiny", prompt=f"during the rollout {i}", max_tokens=30, stream=False).http_response.status_code)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(300)]
        time.sleep(0)  # traffic is in flight before the stop starts (the first futures)
        while sum(f.done() for f in futures) < 30:
            time.sleep(0.05)
        rig.stop_picker(stop, signal.SIGTERM)
        results = [f.result() for f in futures]
    assert results == [200] * 300
    rig.start_pickers()


def test_crashed_picker_is_left_out_by_envoys_health_check(rig: EnvoyGatewayRig) -> None:
    """Envoy Gateway's ext_proc cluster has no health check of its own; the chart's active gRPC check
    takes a crashed replica out before its EndpointSlice changes."""
    crashed = rig.picker_pods[1]
    assert rig.ext_proc_health()[crashed.ip] == "healthy"
    rig.crash_picker(crashed)
    try:
        deadline = time.monotonic() + 30
        while "failed_active_hc" not in rig.ext_proc_health()[crashed.ip]:
            assert time.monotonic() < deadline, rig.ext_proc_health()
            time.sleep(0.1)
        oa = client(rig)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda i: oa.completions.with_raw_response.create(
                model="tiny", prompt=f"after the crash {i}", max_tokens=1).http_response.status_code, range(100)))
        assert codes == [200] * 100
    finally:
        rig.start_pickers()


def test_picker_crash_cuts_no_routed_generation_and_new_requests_go_unsteered(rig: EnvoyGatewayRig) -> None:
    """Fail open (inferencePool.failureMode's default): every picker crashes while a generation
    streams; Envoy lets the routed request run to its end instead of cutting it, and a new request
    goes on without a decision (least request over the model pods) until a picker is back."""
    stream = iter(client(rig, timeout=120).completions.create(model="tiny", prompt="a long story",
                                                              max_tokens=3000, stream=True))
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].text)
        if got == 50:
            break
    for pod in list(rig.picker_pods):
        rig.crash_picker(pod)
    try:
        raw = client(rig).completions.with_raw_response.create(model="tiny", prompt="anyone there?", max_tokens=1)
        assert raw.http_response.status_code == 200 and "x-prefix-epp-decision" not in raw.headers
        got += sum(1 for c in stream if c.choices and c.choices[0].text)
        assert got == 3000  # the generation routed before the crash ran to its end
    finally:
        rig.start_pickers()
    assert client(rig).completions.create(model="tiny", prompt="back", max_tokens=1).choices
