"""InferencePool/Pod -> endpoints: the pure rules of discovery."""

from __future__ import annotations

import pytest

from extproc.discovery.pool import (
    LEGACY_GROUP,
    V1_GROUP,
    PoolError,
    objective_priority,
    parse_pod,
    parse_pool,
    pod_endpoints,
    pool_version,
    selector_matches,
)
from testkit.kube import objective, pod, pool_legacy, pool_v1


def test_v1_and_legacy_pool_shapes() -> None:
    p = parse_pool(pool_v1("p", {"app": "v", "tier": "a"}, [8000, 8002]), V1_GROUP)
    assert p.selector == (("app", "v"), ("tier", "a")) and p.target_ports == (8000, 8002)
    assert p.label_selector() == "app=v,tier=a" and p.namespace == "default"
    legacy = parse_pool(pool_legacy("p", {"app": "v"}, 9000), LEGACY_GROUP)
    assert legacy.selector == (("app", "v"),) and legacy.target_ports == (9000,)
    assert pool_version(V1_GROUP) == "v1" and pool_version(LEGACY_GROUP) == "v1alpha2"
    with pytest.raises(PoolError, match="unsupported --pool-group"):
        pool_version("example.com")


@pytest.mark.parametrize(("obj", "group", "needle"), [
    (pool_v1("p", {}, [8000]), V1_GROUP, "selector is empty"),
    (pool_v1("p", {"a": "b"}, []), V1_GROUP, "1..8 target ports"),
    (pool_v1("p", {"a": "b"}, [8000, 8000]), V1_GROUP, "duplicate"),
    (pool_v1("p", {"a": "b"}, [70000]), V1_GROUP, "invalid target port"),
    (pool_v1("p", {"a": "b"}, list(range(8000, 8009))), V1_GROUP, "1..8 target ports"),
    (pool_v1("p", {"a": "b"}, [8000]), LEGACY_GROUP, "map of strings"),  # a v1 object read as legacy
    ({"spec": {"selector": {"matchLabels": {"a": 1}}, "targetPorts": [{"number": 1}]}}, V1_GROUP, "map of strings"),
])
def test_invalid_pools(obj: dict[str, object], group: str, needle: str) -> None:
    with pytest.raises(PoolError, match=needle):
        parse_pool(obj, group)  # type: ignore[arg-type]


def test_only_ready_selected_addressed_pods_yield_endpoints_named_by_rank() -> None:
    pool = parse_pool(pool_v1("p", {"app": "v"}, [8000, 8001]), V1_GROUP)
    ok = parse_pod(pod("vllm-0", {"app": "v", "extra": "x"}, ip="10.0.0.7"))
    eps = pod_endpoints(ok, pool)
    assert [(e.key, e.name, e.namespace) for e in eps] == [
        ("10.0.0.7:8000", "vllm-0-rank-0", "default"), ("10.0.0.7:8001", "vllm-0-rank-1", "default")]
    assert pod_endpoints(parse_pod(pod("a", {"app": "v"}, ready=False)), pool) == []
    assert pod_endpoints(parse_pod(pod("a", {"app": "other"})), pool) == []
    assert pod_endpoints(parse_pod(pod("a", {"app": "v"}, ip="")), pool) == []
    deleting = pod("a", {"app": "v"})
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert pod_endpoints(parse_pod(deleting), pool) == []
    no_conditions = pod("a", {"app": "v"})
    no_conditions["status"]["conditions"] = [{"type": "ContainersReady", "status": "True"}]
    assert pod_endpoints(parse_pod(no_conditions), pool) == []


def test_active_ports_annotation() -> None:
    pool = parse_pool(pool_v1("p", {"app": "v"}, [8000, 8001, 8002]), V1_GROUP)
    only_2 = parse_pod(pod("a", {"app": "v"}, active_ports=[8002, 9999]))
    assert [(e.port, e.name) for e in pod_endpoints(only_2, pool)] == [(8002, "a-rank-2")]
    none = parse_pod(pod("a", {"app": "v"}, active_ports=[]))
    assert none.active_ports == frozenset() and pod_endpoints(none, pool) == []
    llmd = pod("a", {"app": "v"})
    llmd["metadata"]["annotations"] = {"llm-d.ai/active-ports": "8001",
                                       "inference.networking.k8s.io/active-ports": "8000"}
    assert [e.port for e in pod_endpoints(parse_pod(llmd), pool)] == [8001]


def test_kv_events_endpoint_annotation() -> None:
    pool = parse_pool(pool_v1("p", {"app": "v"}, [8000]), V1_GROUP)
    plain = pod_endpoints(parse_pod(pod("a", {"app": "v"}, ip="10.0.0.9")), pool)
    assert plain[0].kv_events_endpoint == ""  # the picker uses tcp://<pod IP>:--kv-events-port
    annotated = pod("b", {"app": "v"}, ip="10.0.0.9")
    annotated["metadata"]["annotations"] = {"prefix-epp.io/kv-events-endpoint": " tcp://10.0.0.9:6000 "}
    assert pod_endpoints(parse_pod(annotated), pool)[0].kv_events_endpoint == "tcp://10.0.0.9:6000"


@pytest.mark.parametrize(("value", "resolved"), [
    ("6000", "tcp://10.0.0.9:6000"),
    ("tcp://*:6000", "tcp://10.0.0.9:6000"),
    ("tcp://10.0.0.9:6000@tcp://*:6001", "tcp://10.0.0.9:6000@tcp://10.0.0.9:6001"),
    ("6000@6001", "tcp://10.0.0.9:6000@tcp://10.0.0.9:6001"),
])
def test_kv_events_annotation_may_name_ports_of_the_pod(value: str, resolved: str) -> None:
    pool = parse_pool(pool_v1("p", {"app": "v"}, [8000]), V1_GROUP)
    annotated = pod("b", {"app": "v"}, ip="10.0.0.9")
    annotated["metadata"]["annotations"] = {"prefix-epp.io/kv-events-endpoint": value}
    info = parse_pod(annotated)
    assert info.kv_events_refused == "" and pod_endpoints(info, pool)[0].kv_events_endpoint == resolved


@pytest.mark.parametrize("value", [
    "tcp://10.0.0.10:6000",  # another pod
    "tcp://169.254.169.254:80",  # a node-local service
    "tcp://kv.example.com:6000",  # a name (it could resolve anywhere)
    "tcp://10.0.0.9:6000@tcp://10.0.0.1:6001",  # the replay elsewhere
    "tcp://10.0.0.9:70000", "ipc:///tmp/kv", "tcp://10.0.0.9", "1@2@3",
])
def test_kv_events_annotation_naming_another_host_is_refused(value: str) -> None:
    pool = parse_pool(pool_v1("p", {"app": "v"}, [8000]), V1_GROUP)
    annotated = pod("b", {"app": "v"}, ip="10.0.0.9")
    annotated["metadata"]["annotations"] = {"prefix-epp.io/kv-events-endpoint": value}
    info = parse_pod(annotated)
    assert info.kv_events_refused and info.kv_events_raw == value
    assert pod_endpoints(info, pool)[0].kv_events_endpoint == ""  # the default: tcp://<pod IP>:--kv-events-port


def test_a_pod_ip_that_is_no_ip_address_gives_no_endpoint() -> None:
    pool = parse_pool(pool_v1("p", {"app": "v"}, [8000]), V1_GROUP)
    assert pod_endpoints(parse_pod(pod("a", {"app": "v"}, ip="evil.example.com")), pool) == []


def test_selector_and_objectives() -> None:
    assert selector_matches((("a", "1"), ("b", "2")), (("a", "1"),))
    assert not selector_matches((("a", "1"),), (("a", "1"), ("b", "2")))
    assert objective_priority(objective("o", "p", -3), "p") == -3
    assert objective_priority(objective("o", "p", None), "p") == 0
    assert objective_priority(objective("o", "other", 5), "p") is None


def test_a_pods_llm_d_role_label_is_its_endpoints_role() -> None:
    pool = parse_pool(pool_v1("p", {"app": "v"}, [8000, 8001]), V1_GROUP)
    prefill = pod_endpoints(parse_pod(pod("p-0", {"app": "v", "llm-d.ai/role": "prefill"}, ip="10.0.0.7")), pool)
    assert [e.role for e in prefill] == ["prefill", "prefill"]  # every rank of the pod
    assert [e.role for e in pod_endpoints(parse_pod(pod("d-0", {"app": "v"}, ip="10.0.0.8")), pool)] == ["", ""]
