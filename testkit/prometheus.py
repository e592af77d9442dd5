"""A real Prometheus for tests: Debian's `prometheus` package, installed on demand, run on a free port.

- `ensure_prometheus()`: the server binary's path. `prometheus` on PATH (or /usr/bin/prometheus)
  is used as it is; when missing, Debian's package is installed with apt-get (`apt-get update`
  first, no recommended packages), as scripts/build-image.sh installs podman. A flock in the
  user cache makes concurrent test sessions install once; apt-get waits for a dpkg lock held by
  someone else instead of failing. A machine without apt-get, or an install that fails, raises
  `PrometheusUnavailable`: the tests that need the server fail, never skip. The package's own
  service is nothing to the tests (where no init system runs, as in the project's containers,
  its install does not start it); every test runs a server of its own.
- `python -m testkit.prometheus`: installs it when missing and prints the path (`make prometheus`,
  a prerequisite of `make test`, so the install is not paid inside a test's time limit).
- `running_prometheus(tmp, targets, rule_files)`: a server for the `with` body, on 127.0.0.1 and a
  free port, with a generated configuration (one scrape job per `Target`, every `interval`
  seconds; scrape and rule evaluation intervals equal) and its data under `tmp`. It returns once
  `/-/ready` answers 200; a server that exits first fails with its log. Stopped (TERM, then KILL)
  when the block ends.
- `Prometheus`: its HTTP API: `query` (/api/v1/query: the result list; a query Prometheus
  refuses raises `PromQLError` with its message), `label_values` (/api/v1/label/<name>/values),
  `rules` (/api/v1/rules), `targets` (/api/v1/targets, active ones).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testkit.procs import Proc, free_port
from testkit.user_cache import cache_dir, locked

PACKAGE = "prometheus"
APT_TIMEOUT_S = 900


class PrometheusUnavailable(RuntimeError):
    """The Prometheus server binary is missing and could not be installed."""


class PromQLError(RuntimeError):
    """Prometheus refused a query (its `error` message), or answered with an error status."""


def _found() -> Path | None:
    on_path = shutil.which("prometheus")
    if on_path:
        return Path(on_path)
    debian = Path("/usr/bin/prometheus")
    return debian if os.access(debian, os.X_OK) else None


def ensure_prometheus() -> Path:
    """The prometheus binary, installed from Debian's package with apt-get when missing."""
    binary = _found()
    if binary is not None:
        return binary
    with locked(cache_dir("prometheus", ".lock")):
        binary = _found()  # another session installed it while this one waited
        if binary is not None:
            return binary
        if shutil.which("apt-get") is None:
            raise PrometheusUnavailable("prometheus is missing and there is no apt-get to install it: "
                                        "install Debian's (or the upstream) prometheus server, then run again")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        wait_lock = ["-o", f"DPkg::Lock::Timeout={APT_TIMEOUT_S}"]
        for args in (["apt-get", *wait_lock, "update", "-qq"],
                     ["apt-get", *wait_lock, "install", "-y", "-qq", "--no-install-recommends", PACKAGE]):
            done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise PrometheusUnavailable(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    binary = _found()
    if binary is None:
        raise PrometheusUnavailable(f"apt-get installed {PACKAGE} but no prometheus binary is on PATH")
    return binary


@dataclass(frozen=True)
class Target:
    """One scrape job: `address` (host:port, /metrics) and the labels Prometheus attaches to its
    series (a Kubernetes scrape attaches `namespace` and `pod` by relabelling)."""

    job: str
    address: str
    labels: dict[str, str] = field(default_factory=dict)


def config(targets: Sequence[Target], rule_files: Sequence[Path], interval: float) -> dict[str, Any]:
    every = f"{int(interval * 1000)}ms"
    return {
        "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": t.job, "static_configs": [{"targets": [t.address], "labels": t.labels}]}
                           for t in targets],
    }


class Prometheus:
    def __init__(self, port: int, proc: Proc) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = proc

    def _get(self, path: str, params: Sequence[tuple[str, str]] = ()) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}" if params else f"{self.url}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 400/422/503 carry {"status": "error", "error": ...}
            body = exc.read()
            try:
                doc = json.loads(body)
            except ValueError:
                raise PromQLError(f"{path}: HTTP {exc.code}: {body[:500]!r}") from exc
        if doc.get("status") != "success":
            raise PromQLError(f"{doc.get('errorType', 'error')}: {doc.get('error', doc)}")
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant query's result: a list of {"metric": labels, "value": [t, "v"]} (a scalar
        or string result becomes one such entry without labels)."""
        params = [("query", expr)] + ([("time", f"{at:.3f}")] if at is not None else [])
        data = self._get("/api/v1/query", params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        values: list[str] = self._get(f"/api/v1/label/{label}/values", [("match[]", match)])
        return values

    def rules(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self._get("/api/v1/rules")["groups"]
        return groups

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self._get("/api/v1/targets")["activeTargets"]
        return active


def _wait_ready(url: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"prometheus exited with {proc.popen.returncode}:\n{proc.log_text()[-4000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(f"prometheus not ready after {timeout}s:\n{proc.log_text()[-4000:]}")


@contextlib.contextmanager
def running_prometheus(tmp: Path, targets: Sequence[Target], rule_files: Sequence[Path] = (),
                       interval: float = 1.0, timeout: float = 30.0) -> Iterator[Prometheus]:
    binary = ensure_prometheus()
    tmp.mkdir(parents=True, exist_ok=True)
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config(targets, rule_files, interval), sort_keys=False))
    port = free_port()
    args = [str(binary), f"--config.file={config_file}", f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}"]
    proc = Proc(args, tmp / "prometheus.log")
    try:
        server = Prometheus(port, proc)
        _wait_ready(server.url, proc, timeout)
        yield server
    finally:
        proc.stop()


if __name__ == "__main__":
    try:
        print(ensure_prometheus())
    except PrometheusUnavailable as exc:
        sys.exit(str(exc))
