"""The chart's high-availability pieces: replicas, PDB, rollouts, spread, peer sync, drain, workers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from extproc.commands.serve import add_arguments, config_from_args
from extproc.discovery.pool import selector_matches
from extproc.sync.kube_peers import parse_selector
from testkit.helm import Helm
from testkit.k8s_objects import CHART, NAMESPACE, RELEASE, Obj, container, find, find_all, with_image

Render = Callable[[str], list[Obj]]


def serve_config(deploy: Obj) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    args = container(deploy)["args"]
    assert args[0] == "serve"
    return parser.parse_args(args[1:])


def sync_secret_name(deploy: Obj) -> str:
    """The Secret mounted where --sync-secret-file points, holding the key "secret" at that path."""
    config = config_from_args(serve_config(deploy))
    c = container(deploy)
    directory, _, filename = config.sync.secret_file.rpartition("/")
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == directory]
    assert mount["readOnly"] is True
    [volume] = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["items"] == [{"key": "secret", "path": filename}]
    name: str = volume["secret"]["secretName"]
    return name


def test_default_is_two_synced_replicas_that_roll_without_a_gap(render: Render) -> None:
    objs = render("default")
    deploy = find(objs, "Deployment")
    spec, pod = deploy["spec"], deploy["spec"]["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pdb = find(objs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    assert all(c["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
               for c in pod["topologySpreadConstraints"])

    config = config_from_args(serve_config(deploy))
    c = container(deploy)
    # Peers are the pods of this very Deployment, reached on the port the pod declares.
    assert selector_matches(tuple(labels.items()), parse_selector(config.sync.peer_selector))
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["sync"] == config.sync.port
    peers = find(objs, "Service", f"{RELEASE}-peers")
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["ports"][0]["targetPort"] == "sync"
    assert peers["spec"]["ports"][0]["port"] == config.sync.port
    # The shared secret comes from a Secret the chart renders, as a file (never an environment variable).
    secret = find(objs, "Secret", sync_secret_name(deploy))
    assert len(secret["data"]["secret"]) >= 24
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "PREFIX_EPP_SYNC_SECRET" not in {e["name"] for e in c["env"]}
    # preStop sleep + drain fit in the grace period, so the kubelet never kills a draining picker.
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert sleep > 0 and sleep + config.drain.timeout_s < pod["terminationGracePeriodSeconds"]
    assert config.workers == 1


def test_ha_values_flow_into_the_pod(helm: Helm) -> None:
    objs = helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values=with_image({
        "replicas": 1, "terminationGracePeriodSeconds": 60,
        "ha": {"workers": 3, "sync": {"enabled": False}, "drain": {"preStopSleepSeconds": 0},
               "spread": {"enabled": False}}}))
    deploy = find(objs, "Deployment")
    config = config_from_args(serve_config(deploy))
    c = container(deploy)
    assert config.workers == 3 and config.sync.port == 0 and config.drain.timeout_s == 58
    assert "lifecycle" not in c and "topologySpreadConstraints" not in deploy["spec"]["template"]["spec"]
    assert not find_all(objs, "PodDisruptionBudget")
    assert [s["metadata"]["name"] for s in find_all(objs, "Secret")] == [f"{RELEASE}-tls"]  # no sync secret
    assert [s["metadata"]["name"] for s in find_all(objs, "Service")] == [RELEASE]
    assert config.sync.secret_file == ""
    assert not [v for v in deploy["spec"]["template"]["spec"]["volumes"] if "sync" in v["name"]]


def test_existing_sync_secret_is_used_not_made(helm: Helm) -> None:
    objs = helm.template(CHART, release=RELEASE, namespace=NAMESPACE,
                         values=with_image({"ha": {"sync": {"existingSecret": "mine"}}}))
    assert sync_secret_name(find(objs, "Deployment")) == "mine"
    assert not [s for s in find_all(objs, "Secret") if s["metadata"]["name"].endswith("-sync")]


def test_generated_sync_secret_differs_per_render(helm: Helm) -> None:
    """Without a cluster to look it up in, each render makes a new random secret: no install
    shares a value with another (the reason GitOps renders must use existingSecret)."""
    values = with_image({"networkPolicy": {"enabled": False}})
    first, second = (find(helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values=values), "Secret",
                          f"{RELEASE}-sync")["data"]["secret"] for _ in range(2))
    assert first != second
