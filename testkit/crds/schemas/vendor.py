"""Regenerate the vendored upstream CRDs of testkit/crds/schemas/ from local clones of the upstream
repositories (read with `git show <tag>:<path>`, nothing is downloaded):

    .venv/bin/python -m testkit.crds.schemas.vendor \\
        --envoy-gateway ~/src/envoyproxy/gateway \\
        --inference-extension ~/src/kubernetes-sigs/gateway-api-inference-extension

For every (project, version) of versions.env's minimum and newest, each CRD the chart or the
manifests use is written as `<project>/<version>/<crd name>.yaml.gz`: the CRD's YAML document
exactly as upstream ships it (one document of a multi-document file where upstream bundles
several), gzip-compressed to keep the repository small. `SOURCES.yaml` records, per file, the
repository, tag, commit, upstream path and the SHA-256 of the uncompressed document, which the
tests check on every run. A tag the Envoy Gateway clone lacks is read from the Go module cache
instead (`--eg-module-cache "$(go env GOMODCACHE)"`, after `bench/peers/build.sh envoy-gateway`
downloaded it): the module zip holds the tag's tree, and the record names the module and its h1
checksum in place of the commit.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from testkit.versions import VERSIONS

HERE = Path(__file__).parent

EG_REPO = "envoyproxy/gateway"
GIE_REPO = "kubernetes-sigs/gateway-api-inference-extension"

# Envoy Gateway's Helm chart installs these CRD files; the Gateway API CRDs are bundled in one file.
EG_GENERATED = ("gateway.envoyproxy.io_backends.yaml", "gateway.envoyproxy.io_backendtrafficpolicies.yaml",
                "gateway.envoyproxy.io_clienttrafficpolicies.yaml",
                "gateway.envoyproxy.io_envoyextensionpolicies.yaml", "gateway.envoyproxy.io_envoyproxies.yaml")
GATEWAY_API_CRDS = ("gatewayclasses.gateway.networking.k8s.io", "gateways.gateway.networking.k8s.io",
                    "httproutes.gateway.networking.k8s.io", "backendtlspolicies.gateway.networking.k8s.io")


@dataclass(frozen=True)
class Source:
    project: str  # directory under testkit/crds/schemas/
    repo: str
    version: str
    path: str
    crds: tuple[str, ...] = ()  # only these documents of a multi-document file


def eg_crd_dir(version: str) -> str:
    """Where Envoy Gateway's gateway-helm chart keeps its CRDs (moved into a subchart in v1.9)."""
    major_minor = tuple(int(p) for p in version.lstrip("v").split(".")[:2])
    return "charts/gateway-helm/charts/crds/crds" if major_minor >= (1, 9) else "charts/gateway-helm/crds"


def sources() -> list[Source]:
    out: list[Source] = []
    for version in (VERSIONS.eg_min, VERSIONS.eg_verified_tls_min, VERSIONS.eg):
        base = eg_crd_dir(version)
        out += [Source("envoy-gateway", EG_REPO, version, f"{base}/generated/{f}") for f in EG_GENERATED]
        out.append(Source("envoy-gateway", EG_REPO, version, f"{base}/gatewayapi-crds.yaml", GATEWAY_API_CRDS))
    for version in (VERSIONS.gie_min, VERSIONS.gie):
        out.append(Source("inference-extension", GIE_REPO, version,
                          "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"))
    return out


def git(repo_dir: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir" if (repo_dir / "HEAD").exists() else "-C", str(repo_dir), *args],
                          capture_output=True, text=True, check=True).stdout


def documents(text: str) -> list[str]:
    parts = [p for p in text.split("\n---\n") if p.strip() and yaml.safe_load(p) is not None]
    return [p if p.endswith("\n") else p + "\n" for p in (q.removeprefix("---\n") for q in parts)]


def eg_module_source(cache: Path, src: Source) -> tuple[dict[str, str], str]:
    """({module, module_sum}, text) of `src` read from the Go module cache's copy of the tag."""
    module = f"github.com/{EG_REPO}@{src.version}"
    ziphash = cache / "cache" / "download" / "github.com" / EG_REPO / "@v" / f"{src.version}.ziphash"
    return ({"module": module, "module_sum": ziphash.read_text().strip()},
            (cache / "github.com" / f"{EG_REPO}@{src.version}" / src.path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envoy-gateway", type=Path, required=True,
                        help="clone (or bare git dir) of envoyproxy/gateway")
    parser.add_argument("--inference-extension", type=Path, required=True,
                        help="clone (or bare git dir) of kubernetes-sigs/gateway-api-inference-extension")
    parser.add_argument("--eg-module-cache", type=Path,
                        help="Go module cache (`go env GOMODCACHE`) holding github.com/envoyproxy/gateway@<tag>: "
                             "the source of a tag the clone lacks (the module zip is the tag's tree, verified by "
                             "the checksum database; the record names the module and its h1 checksum)")
    args = parser.parse_args()
    dirs = {EG_REPO: args.envoy_gateway, GIE_REPO: args.inference_extension}
    records = []
    for src in sources():
        repo_dir = dirs[src.repo]
        origin: dict[str, str]
        try:
            origin = {"commit": git(repo_dir, "rev-parse", f"{src.version}^{{commit}}").strip()}
            text = git(repo_dir, "show", f"{src.version}:{src.path}")
        except subprocess.CalledProcessError:
            if src.repo != EG_REPO or args.eg_module_cache is None:
                raise
            origin, text = eg_module_source(args.eg_module_cache, src)
        for doc in documents(text):
            crd = yaml.safe_load(doc)
            name = crd["metadata"]["name"]
            if crd.get("kind") != "CustomResourceDefinition" or (src.crds and name not in src.crds):
                continue
            target = HERE / src.project / src.version / f"{name}.yaml.gz"
            target.parent.mkdir(parents=True, exist_ok=True)
            # mtime=0: the same input gives the same bytes, so regenerating changes nothing.
            target.write_bytes(gzip.compress(doc.encode(), compresslevel=9, mtime=0))
            records.append({"file": target.relative_to(HERE).as_posix(), "repository": src.repo,
                            "tag": src.version, **origin, "path": src.path,
                            "sha256": hashlib.sha256(doc.encode()).hexdigest()})
    header = ("# Upstream CRDs vendored by testkit/crds/schemas/vendor.py (see its docstring).\n"
              "# sha256: of the uncompressed CRD document, as it appears in the upstream file at that tag.\n")
    (HERE / "SOURCES.yaml").write_text(header + yaml.safe_dump({"crds": records}, sort_keys=False))


if __name__ == "__main__":
    main()
