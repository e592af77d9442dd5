"""A real Kubernetes API for tests and the benchmark: etcd + kube-apiserver on 127.0.0.1.

The binaries come from `bench/peers/build.sh kube` (kube-apiserver v1.35.4 and etcd v3.6.5 built
from source with the Go module proxy, cached outside the repository; the first call builds them,
minutes on 2 cores). `RealKube` starts them on free loopback ports in a scratch directory:

- etcd with one member, `--unsafe-no-fsync` (test data, speed);
- kube-apiserver on HTTPS with a freshly generated CA and serving certificate (SAN 127.0.0.1),
  static bearer tokens (`--token-auth-file`): `admin` (group system:masters) and one per
  ServiceAccount the test asks for (`token_for`), whose user name is the ServiceAccount's
  (`system:serviceaccount:<ns>:<name>`), so RoleBindings to that ServiceAccount apply to it;
  authorization RBAC; no controller manager, so the ServiceAccount admission plugin is off;
  etcd compaction by the apiserver off (`--etcd-compaction-interval=0`): tests compact on demand
  (`compact()`, through etcd's JSON gateway);
- pods are watched straight from etcd (`--watch-cache-sizes=pods#0`), so a watch from a compacted
  resourceVersion gets 410 Gone as clients see it in production after compaction; every other
  resource is served from the apiserver's watch cache, which sends BOOKMARK events.
`stop_apiserver()` / `start_apiserver()` restart the apiserver on the same port, etcd keeps the
data (clients see a dropped connection, then the same API again).

Objects: `request()` is a raw HTTP call with the admin token; `create_pod()` creates a pod and
then sets its status (podIP, Ready) through the status subresource, as a kubelet would.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import urllib3
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from testkit.procs import REPO_ROOT, Proc, free_ports, wait_for_port

BUILD_SCRIPT = REPO_ROOT / "bench" / "peers" / "build.sh"
CRD_DIR = Path(__file__).parent / "crds" / "apiserver" / "gie-v1.5.0"
ADMIN_TOKEN_USER = "admin"


class BuildFailed(RuntimeError):
    """bench/peers/build.sh could not produce the binaries (no Go toolchain, no module proxy)."""


def built(target: str) -> Path:
    """Directory holding the binaries of `target` (bench/peers/build.sh), building them if needed."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), target], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildFailed(f"bench/peers/build.sh {target} failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def _pem_key(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_certificates(d: Path) -> None:
    """ca.crt, server.crt/server.key (127.0.0.1, localhost) and the ServiceAccount signing pair."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefix-epp-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
                x509.DNSName("kubernetes.default.svc")]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "server.key").write_bytes(_pem_key(key))
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "sa.key").write_bytes(_pem_key(sa))
    (d / "sa.pub").write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo))


class RealKube:
    """etcd + kube-apiserver for one test session (or one benchmark run)."""

    def __init__(self, workdir: Path, service_accounts: tuple[tuple[str, str], ...] = (("default", "prefix-epp"),)
                 ) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bin = built("kube")
        self.etcd_port, peer_port, self.port = free_ports(3)
        self._peer_port = peer_port
        self.tokens: dict[str, str] = {ADMIN_TOKEN_USER: base64.urlsafe_b64encode(os.urandom(24)).decode()}
        lines = [f"{self.tokens[ADMIN_TOKEN_USER]},admin,admin-uid,system:masters"]
        for ns, name in service_accounts:
            user = f"system:serviceaccount:{ns}:{name}"
            self.tokens[user] = base64.urlsafe_b64encode(os.urandom(24)).decode()
            lines.append(f'{self.tokens[user]},{user},{name}-uid,"system:serviceaccounts,system:serviceaccounts:{ns}"')
        (self.dir / "tokens.csv").write_text("\n".join(lines) + "\n")
        write_certificates(self.dir)
        self._http = urllib3.PoolManager(ca_certs=str(self.dir / "ca.crt"), cert_reqs="CERT_REQUIRED", maxsize=4)
        self.etcd: Proc | None = None
        self.apiserver: Proc | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.etcd_port}"

    def token_for(self, namespace: str, name: str) -> str:
        return self.tokens[f"system:serviceaccount:{namespace}:{name}"]

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> RealKube:
        peer = f"http://127.0.0.1:{self._peer_port}"
        self.etcd = Proc([str(self.bin / "server"), "--name", "default", "--data-dir", str(self.dir / "etcd"),
                          "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                          "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                          "--initial-cluster", f"default={peer}", "--log-level", "warn", "--unsafe-no-fsync"],
                         self.dir / "etcd.log")
        wait_for_port(self.etcd_port, timeout=30, proc=self.etcd.popen)
        self.start_apiserver()
        return self

    def start_apiserver(self, timeout: float = 90.0) -> None:
        d = self.dir
        args = [str(self.bin / "kube-apiserver"), f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1",
                f"--secure-port={self.port}", "--advertise-address=127.0.0.1",
                f"--tls-cert-file={d / 'server.crt'}", f"--tls-private-key-file={d / 'server.key'}",
                f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={d / 'sa.pub'}", f"--service-account-signing-key-file={d / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/24", "--disable-admission-plugins=ServiceAccount",
                "--etcd-compaction-interval=0", "--watch-cache-sizes=pods#0", "--enable-priority-and-fairness=false",
                "--profiling=false", f"--cert-dir={d / 'certs'}", "--v=0"]
        self.apiserver = Proc(args, d / "apiserver.log")
        deadline = time.monotonic() + timeout
        wait_for_port(self.port, timeout=timeout, proc=self.apiserver.popen)
        while True:
            with contextlib.suppress(urllib3.exceptions.HTTPError):
                status, _ = self.request("GET", "/readyz")
                if status == 200:
                    return
            if not self.apiserver.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"kube-apiserver not ready:\n{self.apiserver.log_text()[-3000:]}")
            time.sleep(0.1)

    def stop_apiserver(self) -> None:
        if self.apiserver is not None:
            self.apiserver.stop(timeout=20)
            self.apiserver = None

    def close(self) -> None:
        self.stop_apiserver()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        self._http.clear()

    def __enter__(self) -> RealKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- clients --------------------------------------------------------------------------------
    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
               "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                         "certificate-authority": str(self.dir / "ca.crt")}}],
               "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
               "users": [{"name": "test", "user": {"token": token or self.tokens[ADMIN_TOKEN_USER]}}]}
        path.write_text(yaml.safe_dump(doc))
        return path

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                content_type: str = "application/json", timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
        """(status, JSON document) of one API call, with the admin token unless `token`."""
        headers = {"authorization": f"Bearer {token or self.tokens[ADMIN_TOKEN_USER]}", "content-type": content_type,
                   "accept": "application/json"}
        data = body if isinstance(body, bytes) or body is None else orjson.dumps(body)
        resp = self._http.request(method, self.url + path, body=data, headers=headers, timeout=timeout,
                                  retries=False)
        try:
            doc = orjson.loads(resp.data) if resp.data else {}
        except orjson.JSONDecodeError:
            doc = {"text": resp.data.decode(errors="replace")}
        return resp.status, doc if isinstance(doc, dict) else {"value": doc}

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        status, doc = self.request(method, path, body, **kw)
        if status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {status} {str(doc)[:400]}")
        return doc

    def apply_crds(self, directory: Path = CRD_DIR, timeout: float = 30.0) -> list[str]:
        """Create every CRD in `directory` (vendored upstream YAML) and wait until each is Established."""
        names = []
        for f in sorted(directory.glob("*.yaml")):
            crd = yaml.safe_load(f.read_text())
            self.ok("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
            names.append(crd["metadata"]["name"])
        deadline = time.monotonic() + timeout
        self.wait_established(names, deadline)
        # Discovery of a new group can lag Established by a moment: wait until a LIST works.
        for f in sorted(directory.glob("*.yaml")):
            crd = yaml.safe_load(f.read_text())
            group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
            version = next(v["name"] for v in crd["spec"]["versions"] if v.get("served"))
            while self.request("GET", f"/apis/{group}/{version}/{plural}")[0] != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{plural} not served")
                time.sleep(0.05)
        return names

    def wait_established(self, names: list[str], deadline: float) -> None:
        """Wait until each named CRD is Established (TimeoutError past `deadline`, monotonic)."""
        for name in names:
            while True:
                doc = self.ok("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                conds = {c["type"]: c["status"] for c in (doc.get("status") or {}).get("conditions") or []}
                if conds.get("Established") == "True":
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CRD {name} not established")
                time.sleep(0.05)

    def create_pod(self, name: str, labels: dict[str, str], ip: str = "127.0.0.1", ready: bool = True,
                   namespace: str = "default", annotations: dict[str, str] | None = None) -> dict[str, Any]:
        """Create a pod (one container, never scheduled) and set its status as a kubelet would."""
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
        if annotations:
            meta["annotations"] = annotations
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"containers": [{"name": "model", "image": "registry.invalid/model:1"}]}}
        self.ok("POST", f"/api/v1/namespaces/{namespace}/pods", body)
        return self.set_pod_status(name, ip, ready, namespace)

    def set_pod_status(self, name: str, ip: str, ready: bool, namespace: str = "default") -> dict[str, Any]:
        status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                             "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        return self.ok("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}/status", status,
                       content_type="application/merge-patch+json")

    def compact(self) -> int:
        """Compact etcd at its current revision (physically); returns that revision."""
        http = urllib3.PoolManager()
        try:
            key = base64.b64encode(b"/registry").decode()
            rng = orjson.loads(http.request("POST", self.etcd_url + "/v3/kv/range",
                                            body=orjson.dumps({"key": key, "count_only": True}), timeout=5.0).data)
            rev = int(rng["header"]["revision"])
            resp = http.request("POST", self.etcd_url + "/v3/kv/compaction",
                                body=orjson.dumps({"revision": rev, "physical": True}), timeout=10.0)
            if resp.status != 200:
                raise RuntimeError(f"etcd compaction: HTTP {resp.status} {resp.data[:200]!r}")
            return rev
        finally:
            http.clear()
