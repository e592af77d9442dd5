"""manifests/base/prefix-epp.yaml: the chart rendered with manifests/values-kind.yaml and
manifests/values-kubectl.yaml (which names the Secrets each overlay generates), for `kubectl apply`.

    .venv/bin/python -m testkit.render_manifests     # rewrite the file
    .venv/bin/python -m testkit.render_manifests --check

The file is generated so the kubectl rollout and the Helm chart cannot drift apart;
tests/deploy/test_manifests.py fails when it differs from a fresh render. Helm-only labels
(helm.sh/chart, app.kubernetes.io/managed-by) and the `# Source:` lines are removed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import yaml

from testkit.helm import Helm, ensure_layer_tools
from testkit.k8s_objects import CHART, MANIFESTS, NAMESPACE, RELEASE, Obj

OUTPUT = MANIFESTS / "base" / "prefix-epp.yaml"
VALUES = MANIFESTS / "values-kind.yaml"
KUBECTL_VALUES = MANIFESTS / "values-kubectl.yaml"
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
HEADER = """\
# Generated from charts/prefix-epp with manifests/values-kind.yaml and values-kubectl.yaml; do not edit.
# Regenerate: .venv/bin/python -m testkit.render_manifests
# Needs the InferencePool CRDs and Envoy Gateway first (manifests/README.md).
"""


class _BlockDumper(yaml.SafeDumper):
    """Writes multi-line strings (the EndpointPickerConfig) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def _strip(obj: Obj) -> Obj:
    for meta in (obj.get("metadata", {}), obj.get("spec", {}).get("template", {}).get("metadata", {})):
        labels = meta.get("labels")
        if isinstance(labels, dict):
            for key in HELM_ONLY_LABELS:
                labels.pop(key, None)
    return obj


def render(helm: Helm) -> str:
    objs = helm.template(CHART, release=RELEASE, namespace=NAMESPACE, values_files=[VALUES, KUBECTL_VALUES])
    docs = [yaml.dump(_strip(o), Dumper=_BlockDumper, sort_keys=False, width=120) for o in objs]
    return HEADER + "---\n" + "---\n".join(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as home:
        text = render(Helm(binary=ensure_layer_tools()[0], home=Path(home)))
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date; run: .venv/bin/python -m testkit.render_manifests")
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
